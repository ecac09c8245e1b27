"""Memory soak of drafter co-training on one CPU server: `make soak-cotrain`.

Starts an EAGLE server of the default model with a random-init drafter and `--drafter-cotrain`
(a small replay buffer, so that it fills early and then evicts), then keeps `--concurrency`
clients sending GSM8K chat rollouts for `--minutes`. Every `--sample-s` it records the server's
co-training statistics and the resident memory of its processes: the scheduler and the others
of the server, and the co-training process (its peak as the statistics report it).

Checks (exit 1 if any fails): every request answered; no co-training error and the trainer alive;
rounds applied all along; the buffer never above `--buffer-mib`; and once the buffer has filled,
neither the trainer's peak nor the server's memory grows by more than `--growth` over the second
half of the run. Writes one JSON line per sample to `--out` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test" / "e2e"))

from e2e_servers import start_server  # noqa: E402 - the e2e suite's CPU server launcher

SPEC_FLAGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4")


def gsm8k() -> list[list[dict]]:
    from sglang_rl.datasets import gsm8k_path

    return [json.loads(line)["messages"] for line in gsm8k_path().open()]


class Clients:
    """`n` threads sending chat rollouts one after another until stopped; counts answers and failures."""

    def __init__(self, url: str, prompts: list, n: int, max_tokens: int) -> None:
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.answered = self.failed = 0
        self.last_error = ""
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, index: int) -> None:
        i = index
        while not self.stop.is_set():
            body = {"model": "default", "messages": self.prompts[i % len(self.prompts)],
                    "max_tokens": self.max_tokens, "temperature": 0}
            try:
                requests.post(self.url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
                with self.lock:
                    self.answered += 1
            except requests.RequestException as exc:
                with self.lock:
                    self.failed += 1
                    self.last_error = str(exc)[:200]
            i += len(self.threads)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=700)


def memory(pid: int) -> dict:
    """Resident bytes of a server's processes: the co-training process and all the others."""
    root = psutil.Process(pid)
    trainer = server = 0
    for proc in [root] + root.children(recursive=True):
        try:
            rss = proc.memory_info().rss
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "drafter-cotrain" in cmdline:  # the co-training process's title (drafter/cotrain.py)
            trainer += rss
        else:
            server += rss
    return {"server_rss": server, "trainer_rss": trainer}


def growth(samples: list[dict], key: str) -> float:
    """Relative growth of `key` from the middle of the run to its end."""
    start, end = samples[len(samples) // 2][key], samples[-1][key]
    return (end - start) / start if start else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between two records")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--buffer-mib", type=int, default=16, help="--drafter-cotrain-buffer-bytes, in MiB")
    parser.add_argument("--growth", type=float, default=0.10, help="largest memory growth over the second half")
    parser.add_argument("--out", default="soak_cotrain.jsonl")
    args = parser.parse_args(argv)

    from sglang_rl.default_model import ensure_default_model

    model = str(ensure_default_model())
    draft = Path(tempfile.mkdtemp(prefix="sglang-rl-soak-")) / "drafter"
    subprocess.run([sys.executable, "-m", "sglang_rl.drafter", "init", "--model-path", model, "--out", str(draft)],
                   check=True, stdout=subprocess.DEVNULL)
    limit = args.buffer_mib * 2**20
    print(f"starting an EAGLE server with --drafter-cotrain (CPU, buffer {args.buffer_mib} MiB)...", flush=True)
    server = start_server(model, *SPEC_FLAGS, "--speculative-draft-model-path", str(draft), "--drafter-cotrain",
                          "--drafter-cotrain-buffer-bytes", str(limit), "--drafter-cotrain-samples-per-round", "16",
                          "--drafter-cotrain-steps", "10", "--drafter-cotrain-lr", "1e-3",
                          "--drafter-cotrain-soft-topk", "64", "--drafter-cotrain-threads", "1", log_name="soak-cotrain")
    samples: list[dict] = []
    start = time.time()
    clients = Clients(server.url, gsm8k(), args.concurrency, args.max_tokens)
    try:
        with open(args.out, "w") as out, tqdm(total=int(args.minutes * 60), unit="s", desc="soak") as bar:
            while time.time() - start < args.minutes * 60:
                time.sleep(min(args.sample_s, max(0.0, args.minutes * 60 - (time.time() - start))))
                stats = requests.get(server.url + "/drafter_cotrain_stats", timeout=600).json()
                record = {"minute": round((time.time() - start) / 60, 1), "answered": clients.answered,
                          "failed": clients.failed, "rounds": stats["rounds"], "samples": stats["samples"],
                          "buffer_samples": stats["buffer_samples"], "buffer_bytes": stats["buffer_bytes"],
                          "trainer_peak_rss": stats["trainer_peak_rss_bytes"] or 0,
                          "errors": len(stats["errors"]), "trainer_alive": stats["trainer_alive"],
                          **memory(server.proc.pid)}
                samples.append(record)
                out.write(json.dumps(record) + "\n")
                out.flush()
                bar.n = min(int(time.time() - start), bar.total)
                bar.set_postfix(rounds=record["rounds"], buffer_mib=round(record["buffer_bytes"] / 2**20, 1),
                                trainer_peak_mib=record["trainer_peak_rss"] // 2**20)
    finally:
        clients.close()
        server.stop()
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print("| minute | answered | rounds | buffer samples | buffer MiB | trainer peak MiB | trainer MiB | server MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in samples:
        print(f"| {r['minute']} | {r['answered']} | {r['rounds']} | {r['buffer_samples']} | {mib(r['buffer_bytes'])} "
              f"| {mib(r['trainer_peak_rss'])} | {mib(r['trainer_rss'])} | {mib(r['server_rss'])} |")
    failures = []
    if clients.failed:
        failures.append(f"{clients.failed} requests failed (last: {clients.last_error})")
    if any(r["errors"] or not r["trainer_alive"] for r in samples):
        failures.append("co-training reported errors or its process died")
    if len(samples) < 4 or samples[-1]["rounds"] <= samples[len(samples) // 2]["rounds"]:
        failures.append("rounds stopped being applied in the second half")
    if any(r["buffer_bytes"] > limit for r in samples):
        failures.append(f"the buffer went above {args.buffer_mib} MiB")
    full = [r for r in samples if r["buffer_bytes"] > 0.8 * limit]
    for key in ("trainer_peak_rss", "server_rss"):
        if len(full) >= 4 and growth(full, key) > args.growth:
            failures.append(f"{key} grew {100 * growth(full, key):.0f}% over the second half of the full-buffer run")
    if len(full) < 4:
        failures.append("the buffer never filled: run longer or give a smaller --buffer-mib")
    print("soak-cotrain: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
