"""GPU calibration records for `sglang-rl calibrate --stats`: many sglang servers of one
small model on one GPU, honest generators in several configurations and cheaper ones, each
checked by a bf16 verifier through `python -m sglang_rl.calibration.servers`.

    python toploc-scripts/make_cheat_model.py --model-path M --noise 0.01 --out /tmp/noise0.01
    python toploc-scripts/make_cheat_model.py --model-path M --noise 0.001 --seed 1 --out /tmp/noise0.001
    python toploc-scripts/make_cheat_model.py --model-path M --drop-layers 2 --out /tmp/pruned2
    python benchmark/calibrate_gpu_servers.py --model-path M --out-dir records/ [--only verifier,g_base,...]
    python benchmark/calibrate_gpu_servers.py --model-path M --out-dir records/ --tp2   # a host with 2 GPUs
    sglang-rl calibrate --model-path M --out cal.json --stats records/*.jsonl --no-measure

Servers start in two waves (the verifiers first): sglang sizes its KV cache from the memory that
is free while it loads, so servers that load at the same moment can refuse to start. A job runs
when its generator and verifier are up; the others are listed as skipped.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

COMMON = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.1",
          "--cuda-graph-max-bs", "64", "--toploc-verification", "--log-level", "error",
          "--max-running-requests", "64"]


def servers(model: str) -> dict[str, tuple[int, list[str], str]]:
    """name -> (port, extra flags, model folder)."""
    return {
        "verifier": (31000, [], model),
        "verifier_chunked": (31001, ["--chunked-prefill-size", "64"], model),
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


JOBS = [  # config name, generator, verifier, honest, prompts, first GSM8K prompt, requests in flight
    ("graphs_b1", "g_base", "verifier", True, 48, 0, 1),
    ("graphs_b16", "g_base", "verifier", True, 256, 48, 16),
    ("graphs_b64", "g_base", "verifier", True, 256, 304, 64),
    ("no_graphs_b16", "g_nograph", "verifier", True, 192, 560, 16),
    ("flashinfer_b16", "g_flashinfer", "verifier", True, 192, 752, 16),
    ("verifier_chunked64_b16", "g_base", "verifier_chunked", True, 160, 944, 16),
    ("graphs_b32", "g_base", "verifier", True, 192, 1104, 32),
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


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=5) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="the agreed model's folder")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--only", default="", help="comma-separated server names (default: all)")
    parser.add_argument("--start-timeout", type=float, default=330)
    parser.add_argument("--tp2", action="store_true", help="add TP=2 servers and jobs (needs 2 GPUs)")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = servers(args.model_path)
    jobs = list(JOBS)
    if args.tp2:
        table.update({name: (port, extra, args.model_path) for name, (port, extra) in TP2_SERVERS.items()})
        jobs += TP2_JOBS
    names = [n for n in table if not args.only or n in args.only.split(",")]
    procs: dict[str, subprocess.Popen] = {}
    up: set[str] = set()
    t0 = time.time()
    verifiers = [n for n in names if n.startswith("verifier")]
    for wave in (verifiers, [n for n in names if n not in verifiers]):
        for name in wave:
            port, extra, model = table[name]
            log = open(out / f"server_{name}.log", "w")
            procs[name] = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", model,
                                            "--port", str(port), *COMMON, *extra],
                                           stdout=log, stderr=subprocess.STDOUT)
        while time.time() - t0 < args.start_timeout and not set(wave) <= up:
            for name in wave:
                if name not in up and procs[name].poll() is None and _ready(table[name][0]):
                    up.add(name)
                    print(f"{name} up after {time.time() - t0:.0f}s", flush=True)
            if all(procs[n].poll() is not None for n in wave if n not in up):
                break
            time.sleep(2)

    def job(spec: tuple) -> str:
        name, gen, ver, honest, count, offset, batch = spec
        if gen not in procs or ver not in procs:
            return f"{name}: not in this run"
        if gen not in up or ver not in up:
            return f"{name}: skipped (server down, see {out}/server_*.log)"
        cmd = [sys.executable, "-m", "sglang_rl.calibration.servers",
               "--generator", f"http://127.0.0.1:{table[gen][0]}", "--verifier", f"http://127.0.0.1:{table[ver][0]}",
               "--model-path", args.model_path, "--config", name, "--prompts", str(count), "--offset", str(offset),
               "--batch", str(batch), "--max-tokens", "128", "--out", str(out / f"rec_{name}.jsonl")]
        result = subprocess.run(cmd + ([] if honest else ["--cheat"]), capture_output=True, text=True, timeout=400)
        return f"{name}: {result.stdout.strip()[-200:]} {result.stderr.strip()[-300:] if result.returncode else ''}"

    try:
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            for line in pool.map(job, jobs):
                print(line, flush=True)
    finally:
        for proc in procs.values():
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
