"""The scheduler-side cost of TOPLOC fingerprint builders, without a model: a loop of simulated
decode steps, each a fixed sleep standing in for the GPU's forward (it releases the GIL, as a
CUDA sync does) followed by the plugin's work on that step's rows (`add_builder_rows`), then
`finish_builders` for the whole batch. Plain decoding commits one row per request per step;
speculative decoding a run of 1..4 (`--spec`, mean about 3.4 as EAGLE's measured acceptance).

The table gives the loop's extra time per step over the same loop without builders (the final
proofs included); the scheduler's own time in the steps where requests finish, summed
(`finish_ms`: with the output hold it only starts the last proofs); how long the last outputs
wait after the loop for their proofs (`outputs_held_ms`, the idle scheduler's wait); and the
number of proof jobs started: every job costs the proof thread fixed host work that competes
with the scheduler loop for the GIL. `--eos` lets requests finish at their own steps, as in an
RL batch. No GPU needed; on a GPU host the proof jobs run there.

    python benchmark/bench_fingerprint_host.py                       # 64 requests, 128 tokens
    python benchmark/bench_fingerprint_host.py --spec --step-ms 10.9 # EAGLE-like runs
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402


def _schedule(requests: int, tokens: int, spec: bool, seed: int) -> list[list[int]]:
    """Rows committed per request per step until each request has `tokens` rows (the last run
    may overshoot, as a speculative step past the request's end does)."""
    rng = random.Random(seed)
    steps: list[list[int]] = []
    done = [0] * requests
    while min(done) < tokens:
        counts = [rng.choice((1, 3, 4, 4, 4)) if spec else 1 for _ in range(requests)]
        steps.append(counts)
        done = [d + c for d, c in zip(done, counts)]
    return steps


def _lengths(requests: int, tokens: int, eos: bool, seed: int) -> list[int]:
    """Output tokens per request: all `tokens` (ignore_eos), or with `eos` uniform in
    [tokens/4, tokens], so requests finish at their own steps as an RL batch's do."""
    rng = random.Random(seed + 1)
    return [rng.randint(tokens // 4, tokens) if eos else tokens for _ in range(requests)]


def _until_done(steps: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """The steps up to the one in which the last request reaches its length."""
    done = [0] * len(lengths)
    for n, counts in enumerate(steps, 1):
        done = [d + c for d, c in zip(done, counts)]
        if all(d >= length for d, length in zip(done, lengths)):
            return steps[:n]
    return steps


def _release(adapter, wait: bool) -> None:
    """Release the outputs the plugin's proof hold has ready (a tree before the hold posts them
    inline and has nothing to release)."""
    release = getattr(adapter, "release_finished", None)
    if release is not None:
        release(wait=wait)


def _run(steps: list[list[int]], lengths: list[int], hidden: int, topk: int, step_s: float,
         builders_on: bool) -> dict:
    """One pass of the step loop; returns wall time and proof jobs started. A request whose rows
    reach its length finishes in that step (the last run cut as sglang cuts it)."""
    from sglang_rl.adapters import toploc as adapter

    requests = len(steps[0])
    pool = torch.randn(requests * 4, hidden).to(torch.bfloat16)
    jobs = 0
    executor = adapter._proof_executor()
    submit = executor.submit

    def counting_submit(*args, **kwargs):
        nonlocal jobs
        jobs += 1
        return submit(*args, **kwargs)

    executor.submit = counting_submit
    builders = [adapter.FingerprintBuilder(topk) for _ in range(requests)] if builders_on else []
    seen = [0] * requests
    t = time.perf_counter()
    finish = held = 0.0
    try:
        for counts in steps:
            time.sleep(step_s)
            if not builders:
                continue
            live = [i for i in range(requests) if seen[i] < lengths[i]]
            adapter.add_builder_rows([builders[i] for i in live], pool[: sum(counts[i] for i in live)], topk,
                                     [counts[i] for i in live])
            ending = []
            for i in live:
                seen[i] += counts[i]
                if seen[i] >= lengths[i]:
                    ending.append(i)
            if not ending:
                _release(adapter, wait=False)
                continue
            started = time.perf_counter()
            reqs = [SimpleNamespace(finished_reason=None, output_ids_through_stop=[0] * lengths[i], rid=str(i))
                    for i in ending]
            adapter.finish_builders([(builders[i], r) for i, r in zip(ending, reqs)])
            _release(adapter, wait=False)
            finish += time.perf_counter() - started
        if builders:
            started = time.perf_counter()
            _release(adapter, wait=True)
            held = time.perf_counter() - started
    finally:
        executor.submit = submit
    return {"seconds": time.perf_counter() - t, "finish": finish, "held": held, "jobs": jobs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--topk", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=5.0, help="simulated forward time per step")
    p.add_argument("--spec", action="store_true", help="speculative runs of 1..4 rows per step")
    p.add_argument("--eos", action="store_true", help="requests finish at their own steps (lengths "
                   "uniform in [tokens/4, tokens]) instead of all at the last one")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=None,
                   help="steps a full chunk may wait for its proof job (default: the server's, 1 on the CPU)")
    args = p.parse_args()
    if args.max_steps is not None:
        from sglang_rl.adapters import toploc as adapter

        adapter._pending = adapter.PendingProofs(max_steps=args.max_steps)

    steps = _schedule(args.requests, args.tokens, args.spec, seed=0)
    lengths = _lengths(args.requests, args.tokens, args.eos, seed=0)
    steps = _until_done(steps, lengths)
    _run(steps, lengths, args.hidden, args.topk, args.step_ms / 1e3, True)  # warm-up: allocations
    rows = []
    for mode in ("without builders", "with builders"):
        runs = [_run(steps, lengths, args.hidden, args.topk, args.step_ms / 1e3, mode == "with builders")
                for _ in range(args.repeats)]
        seconds = [r["seconds"] for r in runs]
        rows.append({"mode": mode, "steps": len(steps), "median_s": round(statistics.median(seconds), 4),
                     "spread_s": f"{min(seconds):.3f}..{max(seconds):.3f}", "proof_jobs": runs[-1]["jobs"],
                     "finish_ms": round(statistics.median(r["finish"] for r in runs) * 1e3, 1),
                     "outputs_held_ms": round(statistics.median(r["held"] for r in runs) * 1e3, 1)})
    base = rows[0]["median_s"]
    for row in rows:
        row["extra_ms_per_step"] = round((row["median_s"] - base) * 1e3 / len(steps), 3)
    print(f"fingerprint builders on the host: {args.requests} requests x {args.tokens} tokens, hidden "
          f"{args.hidden}, topk {args.topk}, {'speculative runs' if args.spec else 'one row per step'}, "
          f"{args.step_ms} ms simulated forward, {args.repeats} runs per mode, "
          f"max_steps {args.max_steps or 'default'}")
    print_table(rows, ["mode", "steps", "median_s", "spread_s", "extra_ms_per_step", "finish_ms", "outputs_held_ms",
                       "proof_jobs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
