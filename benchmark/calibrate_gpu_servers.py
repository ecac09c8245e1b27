"""GPU calibration records for `sglang-rl calibrate --stats`: many sglang servers of one
small model, honest generators in several configurations and cheaper ones, each checked by a
bf16 verifier through `python -m sglang_rl.calibration.servers`.

    python toploc-scripts/make_cheat_model.py --model-path M --noise 0.01 --out /tmp/noise0.01
    python toploc-scripts/make_cheat_model.py --model-path M --noise 0.001 --seed 1 --out /tmp/noise0.001
    python toploc-scripts/make_cheat_model.py --model-path M --drop-layers 2 --out /tmp/pruned2
    python benchmark/calibrate_gpu_servers.py --model-path M --out-dir records/ [--only verifier,g_base,...]
    python benchmark/calibrate_gpu_servers.py --model-path M --out-dir records/ --gpus 4 --tp2 --dp2 \
        --save-rollouts rollouts/                      # also keep every response
    python benchmark/calibrate_gpu_servers.py --model-path M --out-dir records_x/ --gpus 4 --tp2 \
        --verify-rollouts rollouts/                    # on a host of another GPU type: verifiers only
    sglang-rl calibrate --model-path M --out cal.json --stats records/*.jsonl --stats records_x/*.jsonl --no-measure

A smoke run of the plumbing on the CPU (two small servers, a few prompts per job):

    python benchmark/calibrate_gpu_servers.py --model-path M --out-dir /tmp/a --cpu 4 --only verifier,g_base \
        --save-rollouts /tmp/r
    python benchmark/calibrate_gpu_servers.py --model-path M --out-dir /tmp/b --cpu 4 --verify-rollouts /tmp/r
    sglang-rl calibrate --model-path M --out /tmp/cal.json --no-measure --stats /tmp/a/rec_*.jsonl /tmp/b/rec_*.jsonl

`--gpus N` spreads the servers over GPUs 0..N-1: the verifiers on the last one (the TP=2 verifier
on the last two), the generators round-robin on the others (TP=2 and DP=2 generators on GPUs 0-1).
Servers start in two waves (the verifiers first): sglang sizes its KV cache from the memory that
is free while it loads, so servers that load at the same moment can refuse to start. A job runs
when its generator and verifier are up; the others are listed as skipped.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from sglang_rl.calibration.rollouts import gpu_name, rollout_files

CPU = ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32", "--max-total-tokens", "16384",
       "--toploc-verification", "--log-level", "error", "--sleep-on-idle"]
COMMON = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.1",
          "--cuda-graph-max-bs", "64", "--toploc-verification", "--log-level", "error",
          "--max-running-requests", "64"]


def servers(model: str) -> dict[str, tuple[int, list[str], str]]:
    """name -> (port, extra flags, model folder)."""
    return {
        "verifier": (31000, [], model),
        "verifier_chunked": (31001, ["--chunked-prefill-size", "64"], model),
        "verifier_flashinfer": (31003, ["--attention-backend", "flashinfer"], model),
        "g_base": (31010, [], model),
        "g_nograph": (31011, ["--disable-cuda-graph"], model),
        "g_flashinfer": (31012, ["--attention-backend", "flashinfer"], model),
        "g_fp8": (31013, ["--quantization", "fp8"], model),
        "g_fp8kv": (31014, ["--kv-cache-dtype", "fp8_e4m3"], model),
        "g_fp16": (31015, ["--dtype", "float16"], model),
        "g_noise1": (31016, [], "/tmp/noise0.01"),
        "g_noise01": (31017, [], "/tmp/noise0.001"),
        "g_pruned": (31018, [], "/tmp/pruned2"),
    }


TP2_SERVERS = {  # --tp2: tensor parallel over two GPUs, as generator and as verifier
    "verifier_tp2": (31002, ["--tp-size", "2"]),
    "g_tp2": (31019, ["--tp-size", "2"]),
}
DP2_SERVERS = {"g_dp2": (31020, ["--dp-size", "2"])}  # --dp2: two data-parallel replicas, one per GPU


JOBS = [  # config name, generator, verifier, honest, prompts, first GSM8K prompt, requests in flight
    ("graphs_b1", "g_base", "verifier", True, 48, 0, 1),
    ("graphs_b16", "g_base", "verifier", True, 256, 48, 16),
    ("graphs_b64", "g_base", "verifier", True, 256, 304, 64),
    ("no_graphs_b16", "g_nograph", "verifier", True, 192, 560, 16),
    ("flashinfer_b16", "g_flashinfer", "verifier", True, 192, 752, 16),
    ("verifier_chunked64_b16", "g_base", "verifier_chunked", True, 160, 944, 16),
    ("graphs_b32", "g_base", "verifier", True, 192, 1104, 32),
    ("verifier_flashinfer_b16", "g_base", "verifier_flashinfer", True, 192, 1127, 16),
    ("fp8_weights", "g_fp8", "verifier", False, 128, 0, 16),
    ("fp8_kv", "g_fp8kv", "verifier", False, 128, 0, 16),
    ("fp16", "g_fp16", "verifier", False, 128, 0, 16),
    ("noise0.01", "g_noise1", "verifier", False, 128, 0, 16),
    ("noise0.001", "g_noise01", "verifier", False, 128, 0, 16),
    ("pruned_2_layers", "g_pruned", "verifier", False, 128, 0, 16),
]

TP2_JOBS = [
    ("tp2_generator_b16", "g_tp2", "verifier", True, 192, 0, 16),
    ("tp2_verifier_b16", "g_base", "verifier_tp2", True, 192, 192, 16),
]
DP2_JOBS = [("dp2_generator_b32", "g_dp2", "verifier", True, 192, 384, 32)]


def placement(names: list[str], table: dict, gpus: int) -> dict[str, int]:
    """name -> first GPU (sglang's --base-gpu-id): verifiers on the last GPU (a TP=2 one on the
    last two), one-GPU generators round-robin on the others, two-GPU generators on GPUs 0-1."""
    if gpus <= 1:
        return {name: 0 for name in names}
    spare = list(range(gpus - 1))
    out, turn = {}, 0
    for name in names:
        wide = any(flag in ("--tp-size", "--dp-size") for flag in table[name][1])
        if name.startswith("verifier"):
            out[name] = gpus - 2 if wide else gpus - 1
        elif wide:
            out[name] = 0
        else:
            out[name], turn = spare[turn % len(spare)], turn + 1
    return out


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=5) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def start(names: list[str], table: dict, gpu: dict[str, int], out: Path, timeout: float,
          cpu: bool = False) -> tuple[dict, set]:
    """Start the servers in two waves (verifiers first); return the processes and the names up."""
    procs: dict[str, subprocess.Popen] = {}
    up: set[str] = set()
    t0 = time.time()
    verifiers = [n for n in names if n.startswith("verifier")]
    for wave in (verifiers, [n for n in names if n not in verifiers]):
        for name in wave:
            port, extra, model = table[name]
            log = open(out / f"server_{name}.log", "w")
            # on the CPU each server gets its own rendezvous port (servers starting together may pick one)
            flags = [*CPU, "--nccl-port", str(port + 1000)] if cpu else ["--base-gpu-id", str(gpu[name]), *COMMON, *extra]
            procs[name] = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", model,
                                            "--port", str(port), *flags],
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
                                           if cpu else None)
        while time.time() - t0 < timeout and not set(wave) <= up:
            for name in wave:
                if name not in up and procs[name].poll() is None and _ready(table[name][0]):
                    up.add(name)
                    print(f"{name} up on GPU {gpu[name]} after {time.time() - t0:.0f}s", flush=True)
            if all(procs[n].poll() is not None for n in wave if n not in up):
                break
            time.sleep(2)
    return procs, up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="the agreed model's folder")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--only", default="", help="comma-separated server names (default: all)")
    parser.add_argument("--start-timeout", type=float, default=330)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs to spread the servers over (default 1)")
    parser.add_argument("--tp2", action="store_true", help="add TP=2 servers and jobs (needs 2 GPUs)")
    parser.add_argument("--dp2", action="store_true", help="add a DP=2 generator and its job (needs 2 GPUs)")
    parser.add_argument("--save-rollouts", metavar="DIR", help="also write every job's responses to DIR "
                                                               "(rollouts_CONFIG.jsonl.gz)")
    parser.add_argument("--cpu", type=int, metavar="PROMPTS", help="smoke run on the CPU: at most PROMPTS "
                                                                "prompts per job, 40 tokens each")
    parser.add_argument("--verify-rollouts", metavar="DIR", help="start only the verifiers and verify every "
                                                                 "rollouts file in DIR on each of them")
    args = parser.parse_args()
    if (args.tp2 or args.dp2) and args.gpus < 2:
        parser.error("--tp2 and --dp2 need --gpus 2 or more")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = servers(args.model_path)
    jobs = list(JOBS)
    if args.tp2:
        table.update({name: (port, extra, args.model_path) for name, (port, extra) in TP2_SERVERS.items()})
        jobs += TP2_JOBS
    if args.dp2:
        table.update({name: (port, extra, args.model_path) for name, (port, extra) in DP2_SERVERS.items()})
        jobs += DP2_JOBS
    try:
        files = rollout_files([args.verify_rollouts]) if args.verify_rollouts else []
    except ValueError as exc:
        parser.error(f"--verify-rollouts: {exc}")
    names = [n for n in table if (not args.only or n in args.only.split(","))
             and (not files or n.startswith("verifier"))]
    gpu = placement(names, table, args.gpus)
    label = {name: gpu_name(index) for name, index in gpu.items()}
    if args.save_rollouts:
        Path(args.save_rollouts).mkdir(parents=True, exist_ok=True)
    procs, up = start(names, table, gpu, out, args.start_timeout, cpu=bool(args.cpu))

    def run(name: str, servers_needed: tuple[str, ...], cmd: list[str]) -> str:
        if any(s not in procs for s in servers_needed):
            return f"{name}: not in this run"
        if any(s not in up for s in servers_needed):
            return f"{name}: skipped (server down, see {out}/server_*.log)"
        result = subprocess.run([sys.executable, "-m", "sglang_rl.calibration.servers", *cmd],
                                capture_output=True, text=True, timeout=540)
        return f"{name}: {result.stdout.strip()[-200:]} {result.stderr.strip()[-300:] if result.returncode else ''}"

    def job(spec: tuple) -> str:
        name, gen, ver, honest, count, offset, batch = spec
        count, batch = (min(count, args.cpu), min(batch, 2)) if args.cpu else (count, batch)
        cmd = ["--generator", f"http://127.0.0.1:{table[gen][0]}", "--verifier", f"http://127.0.0.1:{table[ver][0]}",
               "--model-path", args.model_path, "--config", name, "--prompts", str(count), "--offset", str(offset),
               "--batch", str(batch), "--max-tokens", "40" if args.cpu else "128", "--out", str(out / f"rec_{name}.jsonl"),
               "--verifier-config", ver, "--generator-gpu", label.get(gen, ""), "--verifier-gpu", label.get(ver, "")]
        if args.save_rollouts:
            cmd += ["--save-rollouts", str(Path(args.save_rollouts) / f"rollouts_{name}.jsonl.gz")]
        return run(name, (gen, ver), cmd + ([] if honest else ["--cheat"]))

    def cross(pair: tuple[Path, str]) -> str:
        path, ver = pair
        stem = path.name.split(".jsonl")[0].removeprefix("rollouts_")
        cmd = ["--verify-rollouts", str(path), "--verifier", f"http://127.0.0.1:{table[ver][0]}",
               "--verifier-config", ver, "--verifier-gpu", label.get(ver, ""), "--batch", "16",
               "--out", str(out / f"rec_x_{stem}__{ver}.jsonl")]
        return run(f"{stem} on {ver}", (ver,), cmd)

    try:
        if files:
            pairs = [(path, ver) for path in files for ver in names]
            with cf.ThreadPoolExecutor(8) as pool:
                lines = pool.map(cross, pairs)
                for line in lines:
                    print(line, flush=True)
        else:
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                for line in pool.map(job, jobs):
                    print(line, flush=True)
    finally:
        for proc in procs.values():  # the server's own process group: its scheduler processes too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
