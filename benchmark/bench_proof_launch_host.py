"""Where the scheduler thread's time goes when it launches a proof job and reads one back (GPU only).

A fingerprinting server is bound by its scheduler thread's host time under EAGLE (the GPU waits
for it), so every microsecond of a launch (`DeviceProver.launch`) and of reading the proofs back
(`LaunchedProofs.proofs`) counts. This times each host operation of both, as the prover runs
them, with the chunks' graph already captured; the medians of `--runs` calls, per job size.

    python benchmark/bench_proof_launch_host.py [--hidden 4096] [--runs 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from sglang_rl.fingerprint.device_prover import BUCKETS, DeviceProver, _Buffers  # noqa: E402
from sglang_rl.fingerprint.proof import proofs_from_words  # noqa: E402

ROWS = 32


def breakdown(prover: DeviceProver, store: torch.Tensor, count: int, topk: int, runs: int) -> dict:
    """Median host microseconds of each step of one launch of `count` chunks (as `_piece` runs
    them), of a whole `launch()` and of reading its proofs back."""
    parts: dict[str, list[float]] = {}
    slots, rows = list(range(count)), [ROWS] * count
    with prover.on_stream():
        graph = prover._graph_for(count, store, topk)  # captured on the prover's stream, as it is served
        buffers = _Buffers(*graph.words.shape, ROWS)
    for _ in range(runs):
        torch.cuda.synchronize()
        marks = [("start", time.perf_counter())]
        with prover.on_stream():
            marks.append(("enter stream", time.perf_counter()))
            buffers.plan_view[0, :count] = slots
            buffers.plan_view[0, count:] = 0
            buffers.plan_view[1, :count] = rows
            marks.append(("fill plan", time.perf_counter()))
            graph.plan.copy_(buffers.plan, non_blocking=True)
            marks.append(("plan to device", time.perf_counter()))
            graph.graph.replay()
            marks.append(("graph replay", time.perf_counter()))
            buffers.words.copy_(graph.words, non_blocking=True)
            marks.append(("words to host", time.perf_counter()))
            event = torch.cuda.Event()
            event.record(prover.stream)
            marks.append(("event", time.perf_counter()))
        marks.append(("leave stream", time.perf_counter()))
        event.synchronize()
        marks.append(("(device done)", time.perf_counter()))
        proofs_from_words(buffers.words[:count], topk)
        marks.append(("proofs from words", time.perf_counter()))
        for (_, before), (name, after) in zip(marks, marks[1:]):
            parts.setdefault(name, []).append((after - before) * 1e6)
        start = time.perf_counter()
        launched = prover.launch(store, slots, rows, topk)
        launched_at = time.perf_counter()
        launched._event.synchronize()
        read_at = time.perf_counter()
        launched.proofs()
        done = time.perf_counter()
        parts.setdefault("whole launch()", []).append((launched_at - start) * 1e6)
        parts.setdefault("whole proofs() once done", []).append((done - read_at) * 1e6)
    return {name: round(statistics.median(times), 1) for name, times in parts.items() if name != "(device done)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--topk", type=int, default=128)
    p.add_argument("--runs", type=int, default=50)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    store = torch.randn(BUCKETS[-1] + 1, ROWS, args.hidden, device=device).to(torch.bfloat16)
    prover = DeviceProver(device, torch.cuda.Stream(device=device))
    rows = []
    for count in (1, 8, 64):
        cells = breakdown(prover, store, count, args.topk, args.runs)
        rows += [{"chunks": count, "host_op": name, "median_us": us} for name, us in cells.items()]
    print(f"proof launch and read-back, host time per operation: hidden {args.hidden}, topk {args.topk}, "
          f"medians of {args.runs}; {torch.cuda.get_device_name()}")
    print_table(rows, ["chunks", "host_op", "median_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
