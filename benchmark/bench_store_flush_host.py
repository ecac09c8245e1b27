"""Where the scheduler thread's time goes when a GPU server's row store writes its staged decode
steps (`RowStore.flush`), and what each step pays to stage its rows (GPU only).

Under EAGLE the scheduler thread bounds the server, and the phase timing of a sweep put a real
flush at ~350 us of host time (median of the flushes over 100 us), several times the sum its
few torch calls should take. This times each host operation of a flush as `RowStore` runs them,
for `--steps` staged steps of `--requests` requests of `--stride` rows each, then the whole
`flush()` and the per-step `write()` that stages a step, medians of `--runs`.

    python benchmark/bench_store_flush_host.py [--hidden 4096] [--requests 64] [--stride 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from sglang_rl.adapters import toploc  # noqa: E402
from sglang_rl.fingerprint.device_prover import device_index  # noqa: E402
from sglang_rl.fingerprint.row_ring import RowRing  # noqa: E402


def _runs(requests: int, stride: int, step: int) -> list[int]:
    """One speculative step's runs, flat (start, first, count) triples: request i commits
    1..stride rows into its own slot."""
    return [v for i in range(requests)
            for v in (i * stride, i * toploc.CHUNK_ROWS + (step % 8), 1 + (i + step) % stride)]


def breakdown(store: toploc.RowStore, requests: int, stride: int, steps: int, hidden: int,
              runs: int) -> dict[str, float]:
    """Median host microseconds of each operation of a flush of `steps` staged steps, of a whole
    `flush()`, and of a step's `keep_rows` (as `copy_to_cpu_around` keeps the rows) and `write`."""
    device = store.data.device
    source = torch.randn(requests * stride, hidden, device=device).to(torch.bfloat16)
    parts: dict[str, list[float]] = {}
    pinned = torch.empty(requests * stride * steps, dtype=torch.int64, pin_memory=True)
    reused = torch.cuda.Event()

    def timed(name: str, start: float) -> float:
        now = time.perf_counter()
        parts.setdefault(name, []).append((now - start) * 1e6)
        return now

    for _ in range(runs):
        torch.cuda.synchronize()
        staged = []
        for step in range(steps):
            start = time.perf_counter()
            rows = toploc.keep_rows(source)
            start = timed("per step: keep_rows (copy_to_cpu_around)", start)
            source.clone()
            timed("alt: per step: a clone instead of the ring", start)
            staged.append((rows, _runs(requests, stride, step)))
        start = time.perf_counter()
        index = toploc.staged_index([r for _, r in staged], [rows.shape[0] for rows, _ in staged],
                                    (store.data.shape[0] - 1) * toploc.CHUNK_ROWS)
        start = timed("flush: index array (staged_index)", start)
        with toploc._on_proof_stream():  # staged rows are `keep_rows` copies: no stream wait
            start = timed("flush: enter proof stream", start)
            joined = RowRing.join([r for r, _ in staged])
            start = timed("flush: join the ring's views", start)
            on_device = device_index(index, device)
            start = timed("flush: device_index", start)
            offset = 0
            for rows in joined.pieces:  # two where the views wrap round the ring's end
                n = rows.shape[0]
                store._words.index_copy_(0, on_device[offset : offset + n], rows.view(torch.int32))
                offset += n
            start = timed("flush: view int32 and index_copy_ (per piece)", start)
            event = store._hold(joined.loose)
            for ring in joined.rings:
                ring.fence(event)
            start = timed("flush: hold (event) and fence the ring", start)
        timed("flush: leave proof stream", start)
        torch.cuda.synchronize()
        alternatives(index, device, pinned, reused, timed)
        torch.cuda.synchronize()
        for step in range(steps):
            rows = toploc.keep_rows(source)
            start = time.perf_counter()
            store.write(_runs(requests, stride, step), rows, requests * stride)
            timed("whole write() (the last one flushes)" if step == steps - 1 else "whole write(), staged", start)
        torch.cuda.synchronize()
        for step in range(steps - 1):
            store.write(_runs(requests, stride, step), toploc.keep_rows(source), requests * stride)
        start = time.perf_counter()
        store.flush()
        timed("whole flush()", start)
    return {name: round(statistics.median(times), 1) for name, times in parts.items()}


def alternatives(index: np.ndarray, device: torch.device, pinned: torch.Tensor, reused: Any,
                 timed: Callable[[str, float], float]) -> None:
    """Other ways to do a flush's costly operations, timed alike (never used together here:
    the device is synchronised around them)."""
    start = time.perf_counter()
    torch.from_numpy(index).pin_memory().to(device, non_blocking=True)
    start = timed("alt: index page-locked, then to device", start)
    pinned.numpy()[: len(index)] = index
    pinned[: len(index)].to(device, non_blocking=True)
    start = timed("alt: index through a reused page-locked buffer", start)
    torch.cuda.Event().record()
    start = timed("alt: new event, recorded", start)
    reused.record()
    start = timed("alt: reused event, recorded", start)
    torch.cuda.current_stream()
    start = timed("alt: current_stream()", start)
    torch.cuda.set_stream(torch.cuda.current_stream())
    timed("alt: set_stream(current_stream())", start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--stride", type=int, default=4, help="rows per request per step (EAGLE's draft tokens)")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--steps", type=int, default=32, help="staged steps per flush (a server stages up to "
                   "STAGED_STEPS, fewer when STAGED_BYTES comes first)")
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    toploc._device, toploc._device_known = device, True
    store = toploc.RowStore()
    store._set_data(store._allocate(args.requests + 1, args.hidden))
    steps = args.steps
    store.staged_steps = steps
    cells = breakdown(store, args.requests, args.stride, steps, args.hidden, args.runs)
    print(f"row store flush, host time per operation: {steps} staged steps of {args.requests} requests x "
          f"{args.stride} rows, hidden {args.hidden}, medians of {args.runs}; {torch.cuda.get_device_name()}")
    print_table([{"host_op": name, "median_us": us} for name, us in cells.items()], ["host_op", "median_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
