"""The scheduler thread's own cost of TOPLOC per decode step: `decode_result_around` (the plugin's
hook on process_batch_result_decode) for a batch of fingerprinted requests, on stand-in sglang
objects with the step's rows already on the host, as sglang leaves them. This is the part that
the overlap scheduler cannot hide when it is bound by the host.

On the CPU no proof job runs (jobs are held back), so the table is the Python and the row copy
that every step pays. With `--device cuda` the store and the step's rows are on the GPU, as on a
GPU server that fingerprints (each step's rows are the private copy `copy_to_cpu_around` keeps
there, made in the timed step), writes are staged as there, and proof jobs are launched as
there (every `JOB_STEPS` steps or `JOB_CHUNKS` chunks), so the table is the host time of the
whole device path per step, launches included.

    python benchmark/bench_decode_hook.py                 # 64 requests, hidden 4096
    python benchmark/bench_decode_hook.py --hidden 1024   # the small EAGLE pair's width
    python benchmark/bench_decode_hook.py --device cuda   # a GPU server's path
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

ACCEPTED = (1, 3, 4, 4, 4)  # committed rows per request in a speculative step (mean ~3.4, as EAGLE's)


def per_step_us(requests: int, hidden: int, spec: bool, steps: int, repeats: int,
                device: str = "cpu") -> tuple[float, float, float]:
    """Best of `repeats` mean times per step of the hook over `steps` steps; then, best of the
    same passes, the host time per request of finishing them all in one output batch:
    `finish_builders` (the tails' job launched) and, once that job is done on the device,
    `release_finished` (proofs read back, fingerprints encoded and posted)."""
    from sglang_rl.adapters import scheduler
    from sglang_rl.adapters import toploc as adapter

    args = SimpleNamespace(toploc_verification=True, return_hidden_states_mode=None, drafter_cotrain=False,
                           device="cuda", toploc_verification_topk=128)
    scheduler.get_server_args = lambda: args
    on_gpu = device == "cuda"
    adapter._device, adapter._device_known = (torch.device("cuda", torch.cuda.current_device()) if on_gpu
                                              else None), True
    stride = 4 if spec else 1
    best = best_finish = best_release = float("inf")
    slots = requests * (steps * stride // 32 + 2)
    # one store tensor for every pass, as a server's store stays once grown (a new tensor
    # would have the prover capture its graphs again, inside the timed steps)
    data = torch.zeros(slots + 1, 32, hidden, dtype=torch.bfloat16, device=device)
    for _ in range(repeats + 1):  # the first pass warms up (and captures the proof graphs)
        adapter._pending = (adapter.PendingProofs() if on_gpu
                            else adapter.PendingProofs(max_chunks=10**9, max_steps=10**9))
        adapter._store = adapter.RowStore()
        adapter._store._set_data(data)
        adapter._store._free = list(range(slots - 1, -1, -1))
        reqs = []
        for i in range(requests):
            req = SimpleNamespace(origin_input_ids=[1] * 8, output_ids=[1] * 4, is_retracted=False, rid=str(i))
            req.finished = lambda: False
            setattr(req, scheduler.STATE_ATTR, adapter.FingerprintBuilder(128))
            reqs.append(req)
        accepted = torch.tensor([ACCEPTED[i % len(ACCEPTED)] for i in range(requests)]) if spec else None
        step_rows = torch.randn(requests * stride, hidden).to(torch.bfloat16).to(device)
        result = SimpleNamespace(copy_done=None, speculative_num_draft_tokens=stride if spec else None,
                                 logits_output=SimpleNamespace(hidden_states=step_rows),
                                 accept_lens=accepted)
        batch = SimpleNamespace(reqs=reqs, return_hidden_states=True)
        processor = SimpleNamespace(server_args=args)
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            if on_gpu:  # the private copy `copy_to_cpu_around` makes of each step's rows
                result.logits_output.hidden_states = adapter.keep_rows(step_rows)
            scheduler.decode_result_around(lambda *a: None, processor, batch, result)
        best = min(best, (time.perf_counter() - start) / steps * 1e6)
        items = []
        for req in reqs:
            builder = getattr(req, scheduler.STATE_ATTR)
            req.finished_reason = SimpleNamespace()
            req.output_ids_through_stop = [1] * (builder.rows_seen - 1)  # the last step went one past
            items.append((builder, req))
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        adapter.finish_builders(items)
        adapter._pending.flush()  # their job starts (on a GPU server a few steps later, with others' chunks)
        finished = time.perf_counter()
        if on_gpu:
            torch.cuda.synchronize()
        else:
            for job in adapter._held[-1].jobs:  # the proof thread's jobs: not the scheduler's host time
                job.result()
        released = time.perf_counter()
        assert len(adapter.release_finished(wait=True)) == requests
        done = time.perf_counter()
        best_finish = min(best_finish, (finished - start) / requests * 1e6)
        best_release = min(best_release, (done - released) / requests * 1e6)
    return best, best_finish, best_release


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the row store lives")
    args = p.parse_args()
    rows = []
    for spec in (False, True):
        step, finish, release = per_step_us(args.requests, args.hidden, spec, args.steps, args.repeats, args.device)
        rows.append({"step": "plain decoding (1 row per request)" if not spec else "speculative (1..4 rows, mean 3.2)",
                     "us_per_step": round(step, 1), "finish_us_per_request": round(finish, 1),
                     "release_us_per_request": round(release, 1)})
    print(f"decode hook per step: {args.requests} fingerprinted requests, hidden {args.hidden}, "
          f"store on {args.device}, best of {args.repeats} passes of {args.steps} steps")
    print_table(rows, ["step", "us_per_step", "finish_us_per_request", "release_us_per_request"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
