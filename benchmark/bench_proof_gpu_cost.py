"""What a proof job costs the GPU, and what it costs a forward pass that runs beside it (GPU only).

A GPU server launches its proof jobs on a side stream (`fingerprint/device_prover.py`), so they
never wait for the forward and the scheduler never waits for them; but they share the GPU's SMs
with the forward. This prints, per job size (chunks of 32 rows):

* `job_gpu_us`: the job's own GPU time (events around one graph replay, nothing else running);
* `step_alone_us` / `step_beside_job_us`: a stand-in forward step on the main stream (the GEMMs of
  an 8-layer Llama at hidden 4096 for `--tokens` tokens, as the EAGLE benchmark's target verifies
  64 requests x 4 draft tokens) alone, and with one job launched beside it at the step's start;
* `added_us`: how much longer the step took with the job, which is what a host-bound serving loop
  waiting for that step's results pays;
* `job_done_beside_step_us`: when the job launched beside the step is done, from the step's
  start: the outputs that wait for a finishing job's proofs wait this long.

Both on a side stream of default priority and of the highest priority.

    python benchmark/bench_proof_gpu_cost.py [--hidden 4096] [--tokens 256] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from sglang_rl.fingerprint.device_prover import BUCKETS, DeviceProver  # noqa: E402

ROWS = 32


SLEEP_CYCLES = 5_000_000
"""A GPU sleep (a few ms) queued ahead of each measured span, so that everything in the span is
queued before the GPU reaches it: the events then time the GPU, not the launching thread."""


def gpu_us(fn, runs: int, stream: torch.cuda.Stream) -> float:
    """Median GPU microseconds of what `fn()` queues on `stream` (and on streams made to wait
    for it), between events recorded around it behind a GPU sleep."""
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def forward_step(weights: list[torch.Tensor], x: torch.Tensor) -> None:
    """GEMMs of one forward of a Llama-shaped stack (attention left out: a lower bound)."""
    h = x
    for w_in, w_out in weights:
        h = (h @ w_in)[:, : w_out.shape[0]] @ w_out


def beside_step(prover: DeviceProver, launch: Callable[[], None], weights: list, x: torch.Tensor,
                runs: int) -> tuple[float, float]:
    """Median GPU microseconds, from a stand-in step's start, until the step is done and until
    a job launched beside it (once the step is queued, as the scheduler launches its jobs while
    the GPU runs a forward) is done."""
    main_stream = torch.cuda.current_stream()
    step_times, job_times = [], []
    for _ in range(runs):
        start, step_end, job_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        prover.stream.wait_stream(main_stream)  # the job may start with the step, on its own stream
        forward_step(weights, x)
        step_end.record()
        launch()
        job_end.record(prover.stream)
        torch.cuda.synchronize()
        step_times.append(start.elapsed_time(step_end) * 1e3)
        job_times.append(start.elapsed_time(job_end) * 1e3)
    return statistics.median(step_times), statistics.median(job_times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--topk", type=int, default=128)
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    store = torch.randn(BUCKETS[-1] + 1, ROWS, args.hidden, device=device).to(torch.bfloat16)
    inter = 14336 * args.hidden // 4096
    weights = [(torch.randn(args.hidden, 2 * inter, device=device, dtype=torch.bfloat16) * 0.01,
                torch.randn(inter, args.hidden, device=device, dtype=torch.bfloat16) * 0.01)
               for _ in range(args.layers)]
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    alone = gpu_us(lambda: forward_step(weights, x), args.runs, torch.cuda.current_stream())
    rows = []
    for name, priority in (("default", 0), ("highest", -100)):
        prover = DeviceProver(device, torch.cuda.Stream(device=device, priority=priority))

        def launch(count: int) -> None:
            with prover.on_stream():
                prover.launch(store, list(range(count)), [ROWS] * count, args.topk)

        for count in BUCKETS:  # capture every bucket's graph first
            launch(count)
        torch.cuda.synchronize()
        for count in (1, *BUCKETS):
            job = gpu_us(lambda: launch(count), args.runs, prover.stream)
            step, job_done = beside_step(prover, lambda: launch(count), weights, x, args.runs)
            rows.append({"stream": f"{name} ({prover.stream.priority})", "chunks": count, "job_gpu_us": round(job),
                         "step_alone_us": round(alone), "step_beside_job_us": round(step),
                         "added_us": round(step - alone), "job_done_beside_step_us": round(job_done)})
    print(f"proof job GPU cost: hidden {args.hidden}, topk {args.topk}; stand-in step: {args.layers} layers x "
          f"{args.tokens} tokens; medians of {args.runs}; {torch.cuda.get_device_name()}")
    print_table(rows, ["stream", "chunks", "job_gpu_us", "step_alone_us", "step_beside_job_us", "added_us",
                       "job_done_beside_step_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
