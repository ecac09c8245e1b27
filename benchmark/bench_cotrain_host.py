"""Host cost of co-training rows in the scheduler, per rollout batch (no GPU, no server).

A decode step of an EAGLE server hands the scheduler its rows on the host (`[requests x
draft tokens, H]`, bf16); co-training routes each request's accepted rows to its window
(`decode_routes`, `add_decode_rows`) between GPU steps, and once the scheduler is idle a finished
request's window becomes a training sample that is serialised for the trainer's queue
(`CotrainRows.sample`, `Sample.of`, pickle). This replays one batch of synthetic requests
(prompt and response lengths, acceptance) through those functions and prints the time of each
part per batch and per decode step.

    python benchmark/bench_cotrain_host.py                     # SmolLM2 rows (H 576)
    python benchmark/bench_cotrain_host.py --hidden 4096       # 8B-shaped rows
"""

from __future__ import annotations

import argparse
import pickle
import random
import time

import torch

from sglang_rl.adapters.cotrain_rows import CotrainRows
from sglang_rl.adapters.decode_step import add_decode_rows
from sglang_rl.adapters.request_state import state_of
from sglang_rl.adapters.scheduler import decode_routes
from sglang_rl.drafter.messages import Sample


class _Req:
    """The fields of sglang's Req that the co-training row path reads."""

    def __init__(self, prompt: int, response: int, window: int) -> None:
        self.origin_input_ids = list(range(prompt))
        self.output_ids: list[int] = []
        self.target = response
        self.is_retracted = False
        self.window = CotrainRows(prompt, window)
        state_of(self).add_rows(self.window)

    def finished(self) -> bool:
        return len(self.output_ids) >= self.target

    @property
    def output_ids_through_stop(self) -> list[int]:
        return self.output_ids[:self.target]


def run(requests: int, hidden: int, draft_tokens: int, window: int, acceptance: float, seed: int) -> dict:
    rng = random.Random(seed)
    reqs = [_Req(rng.randint(80, 170), rng.randint(30, 256), window) for _ in range(requests)]
    times = {"routes": 0.0, "rows": 0.0, "sample": 0.0, "wire": 0.0, "pickle": 0.0}
    steps = sent = 0
    running = list(reqs)
    while running:
        rows = torch.randn(len(running) * draft_tokens, hidden, dtype=torch.bfloat16)  # sglang's host copy
        accepted = [min(draft_tokens, 1 + int(rng.random() < acceptance - 1) + int(rng.random() < (acceptance - 1) / 2))
                    for _ in running]
        t0 = time.perf_counter()
        _, _, _, collectors = decode_routes(running, draft_tokens, accepted)
        t1 = time.perf_counter()
        add_decode_rows(collectors, rows)
        t2 = time.perf_counter()
        times["routes"] += t1 - t0
        times["rows"] += t2 - t1
        steps += 1
        for req, count in zip(running, accepted):
            req.output_ids.extend([7] * count)
        for req in [r for r in running if r.finished()]:
            t0 = time.perf_counter()
            rows = req.window
            rows.close(req, policy_version=0)
            sample = rows.sample()
            t1 = time.perf_counter()
            wire = Sample.of(sample)
            t2 = time.perf_counter()
            sent += len(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))
            t3 = time.perf_counter()
            times["sample"] += t1 - t0
            times["wire"] += t2 - t1
            times["pickle"] += t3 - t2
        running = [r for r in running if not r.finished()]
    return {**times, "steps": steps, "bytes": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests in the batch (default 64)")
    parser.add_argument("--hidden", type=int, default=576, help="row width (default 576, SmolLM2-135M)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="rows per request per step (default 4)")
    parser.add_argument("--window", type=int, default=512, help="rows kept per request (default 512)")
    parser.add_argument("--acceptance", type=float, default=1.43, help="mean tokens per step (default 1.43)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [run(args.requests, args.hidden, args.draft_tokens, args.window, args.acceptance, seed=0)
               for _ in range(args.repeats)]
    parts = ("routes", "rows", "sample", "wire", "pickle")
    best = min(results, key=lambda r: sum(r[k] for k in parts))  # the batch least disturbed by the host
    steps, sent = best["steps"], best["bytes"]
    total = sum(best[k] for k in parts)
    print(f"{args.requests} requests, H {args.hidden}, {args.draft_tokens} rows per step, window {args.window}, "
          f"{steps} decode steps; the fastest of {args.repeats} batches")
    print("| part | ms per batch | us per decode step |")
    print("|---|---|---|")
    names = {"routes": "between steps: route rows (`decode_routes`)",
             "rows": "between steps: keep rows (`add_decode_rows`)",
             "sample": "when idle: build samples (`CotrainRows.sample`)",
             "wire": "when idle: to bytes (`Sample.of`)", "pickle": "when idle: queue pickling"}
    for key, name in names.items():
        print(f"| {name} | {1e3 * best[key]:.1f} | {1e6 * best[key] / steps:.0f} |")
    path = best["routes"] + best["rows"]
    print(f"| between steps, total | {1e3 * path:.1f} | {1e6 * path / steps:.0f} |")
    print(f"| total | {1e3 * total:.1f} | {1e6 * total / steps:.0f} |")
    print(f"bytes to the trainer per batch: {sent / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
