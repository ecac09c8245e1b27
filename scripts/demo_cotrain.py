"""Drafter co-training on the default model, on the CPU: `make demo-cotrain`.

Starts an EAGLE server with a random-init drafter and --drafter-cotrain, measures acceptance
(tokens per verify step) on held-out GSM8K prompts, sends training rollouts round after round,
and prints how held-out acceptance moves as the server hot-swaps its co-trained drafter. Greedy
outputs never change; only acceptance does. Takes a few minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))

from conftest import Server  # noqa: E402 - the same CPU server launcher as the tests


def gsm8k() -> list[list[dict]]:
    from sglang_rl.datasets import gsm8k_path

    return [json.loads(line)["messages"] for line in gsm8k_path().open()]


def chat(url: str, messages: list[dict], max_tokens: int, opt_out: bool) -> list[int]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_output_ids": True, "drafter_cotrain": not opt_out}
    resp = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["output_ids"]


def held_out(url: str, prompts: list, max_tokens: int) -> tuple[float, list[list[int]]]:
    before = requests.get(url + "/drafter_cotrain_stats").json()
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda m: chat(url, m, max_tokens, opt_out=True), prompts))
    after = requests.get(url + "/drafter_cotrain_stats").json()
    tokens = after["held_out_tokens"][-1] - before["held_out_tokens"][-1]
    steps = after["held_out_verify_steps"][-1] - before["held_out_verify_steps"][-1]
    return tokens / max(steps, 1), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples-per-round", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    from sglang_rl.default_model import ensure_default_model

    model = str(ensure_default_model())
    prompts = gsm8k()
    evaluation = prompts[1200:1208]
    draft = Path(tempfile.mkdtemp(prefix="sglang-rl-demo-")) / "drafter"
    subprocess.run([sys.executable, "-m", "sglang_rl.drafter", "init", "--model-path", model, "--out", str(draft)],
                   check=True)
    print("starting an EAGLE server with --drafter-cotrain (CPU, ~1 minute)...", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    server = Server(model, "--sleep-on-idle", "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                    str(draft), "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", "4", "--drafter-cotrain",
                    "--drafter-cotrain-samples-per-round", str(args.samples_per_round),
                    "--drafter-cotrain-steps", "30", "--drafter-cotrain-lr", "1e-3",
                    "--drafter-cotrain-soft-topk", "64", "--drafter-cotrain-threads", "1", log_name="demo-cotrain")
    try:
        acc, first = held_out(server.url, evaluation, args.max_tokens)
        print(f"round 0 (random drafter): held-out acceptance {acc:.2f} tokens per verify step", flush=True)
        for r in range(1, args.rounds + 1):
            batch = prompts[(r - 1) * args.samples_per_round: r * args.samples_per_round]
            t0 = time.time()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda m: chat(server.url, m, args.max_tokens, opt_out=False), batch))
            while requests.get(server.url + "/drafter_cotrain_stats").json()["rounds"] < r:
                chat(server.url, [{"role": "user", "content": "Hi"}], 2, opt_out=True)  # rounds land between batches
                time.sleep(1)
            acc, ids = held_out(server.url, evaluation, args.max_tokens)
            stats = requests.get(server.url + "/drafter_cotrain_stats").json()
            print(f"round {r}: {r * args.samples_per_round} rollouts seen, loss {stats['loss'][-1]:.3f}, "
                  f"held-out acceptance {acc:.2f}, outputs unchanged: {ids == first} ({time.time() - t0:.0f}s)",
                  flush=True)
        print(json.dumps(requests.get(server.url + "/drafter_cotrain_stats").json(), indent=1)[:1500])
    finally:
        server.stop()


if __name__ == "__main__":
    main()
