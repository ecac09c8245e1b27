"""GPU check and benchmark of the device prover (not part of CPU CI).

1. Correctness: chunks of a device row store (full ones and partial ones, more than one graph
   bucket, more than one piece) proven by `DeviceProver` with CUDA graphs give toploc's bytes
   (those that differ may only differ by the order of ties in |x|, so each of them must still
   verify with toploc against its own rows).
2. Host cost: the launching thread's time per job, graph replay vs op by op.
3. Why the launches happen in the scheduler thread: latency of one job while another Python
   thread is busy (the scheduler of a host-bound server is), built by a second thread (the old
   way) vs launched by the busy thread itself.

    python benchmark/check_device_prover.py [--hidden 4096] [--topk 128]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from sglang_rl.fingerprint import Fingerprint, build_chunk_proofs, verify_rows
from sglang_rl.fingerprint.device_prover import DeviceProver

ROWS = 32


def check_bytes(prover: DeviceProver, store: torch.Tensor, topk: int) -> None:
    gen = torch.Generator().manual_seed(1)
    host = store.cpu()
    jobs = {
        "64 full": ([int(s) for s in torch.randperm(store.shape[0], generator=gen)[:64]], [ROWS] * 64),
        "37 mixed": ([int(s) for s in torch.randperm(store.shape[0], generator=gen)[:37]],
                     [int(r) for r in torch.randint(1, ROWS + 1, (37,), generator=gen)]),
        "150 mixed (3 pieces)": ([int(s) for s in torch.randint(0, store.shape[0], (150,), generator=gen)],
                                 [int(r) for r in torch.randint(1, ROWS + 1, (150,), generator=gen)]),
        "5 partial": ([3, 9, 200, 11, 7], [1, 2, 31, 5, 17]),
    }
    for name, (slots, rows) in jobs.items():
        with prover.on_stream():
            launched = prover.launch(store, slots, rows, topk)
        proofs = launched.proofs()
        chunks = [host[s, :r] for s, r in zip(slots, rows)]
        expected = build_chunk_proofs(chunks, topk)
        differ = [i for i, (a, b) in enumerate(zip(proofs, expected)) if a != b]
        for i in differ:
            fp = Fingerprint(topk=topk, chunk_size=ROWS, n_rows=rows[i], proofs=(proofs[i],))
            report = verify_rows(chunks[i], fp)
            assert report.verified, (name, i, report.to_dict())
        assert len(proofs) == len(slots)
        print(f"{name:22s} bytes equal to toploc's: {len(slots) - len(differ)}/{len(slots)}; "
              f"the rest verify: {len(differ)}/{len(differ)}")


def check_reuse(prover: DeviceProver, store: torch.Tensor, topk: int) -> None:
    """Jobs of one bucket launched back to back before any is read, then read in reverse order:
    each must keep its own host buffers until read, and give what the same job gives alone.
    Then a job over a second, larger store tensor (the store grew: the graphs must read the new
    one, where the old one's chunks now lie at other slots), and one over the first again."""
    gen = torch.Generator().manual_seed(2)

    def alone(on: torch.Tensor, slots: list[int], rows: list[int]) -> list[bytes]:
        with prover.on_stream():
            return prover.launch(on, slots, rows, topk).proofs()

    jobs = [[int(s) for s in torch.randperm(store.shape[0], generator=gen)[:20]] for _ in range(4)]
    expected = [alone(store, slots, [ROWS] * 20) for slots in jobs]
    with prover.on_stream():
        launched = [prover.launch(store, slots, [ROWS] * 20, topk) for slots in jobs]
    for i in reversed(range(len(jobs))):
        assert launched[i].proofs() == expected[i], f"job {i} read out of order differs"
    with prover.on_stream():
        grown = torch.cat([torch.randn_like(store, dtype=torch.float32).to(torch.bfloat16), store])
    moved = [store.shape[0] + 1, store.shape[0] + 2]  # the old store's slots 1 and 2
    assert alone(grown, moved, [ROWS, 9]) == alone(store, [1, 2], [ROWS, 9]), "the grown store was not read"
    assert alone(store, jobs[0], [ROWS] * 20) == expected[0], "back on the first store"
    print("jobs in flight together and read out of order, a grown store, and back: as each job alone")


def launch_cost(prover: DeviceProver, store: torch.Tensor, topk: int, count: int, runs: int = 50) -> float:
    """Median host microseconds of one launch of `count` full chunks."""
    slots = list(range(count))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        with prover.on_stream():
            launched = prover.launch(store, slots, [ROWS] * count, topk)
        times.append(time.perf_counter() - t)
        launched.proofs()
    return statistics.median(times) * 1e6


def busy_latency(store: torch.Tensor, topk: int, prover: DeviceProver, jobs: int = 8) -> dict:
    """Median ms from start to proofs of a 64-chunk job while a Python thread spins."""
    slots = list(range(64))
    out: dict[str, float] = {}

    def spin(stop: threading.Event) -> None:
        a = torch.zeros(4)
        while not stop.is_set():
            s = 0
            for i in range(2000):
                s += i
            a.add_(1)

    # the old way: a second thread builds the proofs op by op while this thread spins
    stop = threading.Event()
    times: list[float] = []

    def worker() -> None:
        with prover.on_stream():
            for _ in range(jobs):
                t = time.perf_counter()
                build_chunk_proofs(store.index_select(0, torch.tensor(slots, device=store.device)), topk)
                times.append(time.perf_counter() - t)
        stop.set()

    thread = threading.Thread(target=worker)
    thread.start()
    spin(stop)
    thread.join()
    out["proof thread beside a busy thread"] = statistics.median(times) * 1e3

    # the new way: the busy thread launches the job itself and polls for it between its work
    times = []
    a = torch.zeros(4)
    for _ in range(jobs):
        t = time.perf_counter()
        with prover.on_stream():
            launched = prover.launch(store, slots, [ROWS] * 64, topk)
        while not launched.ready():
            s = 0
            for i in range(2000):
                s += i
            a.add_(1)
        launched.proofs()
        times.append(time.perf_counter() - t)
    out["launched by the busy thread"] = statistics.median(times) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device=device)
    graphs = DeviceProver(device, stream)
    eager = DeviceProver(device, stream, graphs=False)
    with graphs.on_stream():
        store = torch.randn(256, ROWS, args.hidden, device=device).to(torch.bfloat16)
    torch.cuda.synchronize()
    print(f"# device prover on {torch.cuda.get_device_name(0)}, hidden {args.hidden}, topk {args.topk}")
    check_bytes(graphs, store, args.topk)
    assert graphs.use_graphs, "graph capture failed (see the warning above)"
    check_reuse(graphs, store, args.topk)
    check_bytes(eager, store, args.topk)
    print("\n| chunks per job | host us per launch, graph | host us per launch, op by op |")
    print("|---|---|---|")
    for count in (8, 64, 128):
        print(f"| {count} | {launch_cost(graphs, store, args.topk, count):.0f} | "
              f"{launch_cost(eager, store, args.topk, count):.0f} |")
    print("\n| 64-chunk job while another Python thread is busy | ms, start to proofs |")
    print("|---|---|")
    for name, ms in busy_latency(store, args.topk, graphs).items():
        print(f"| {name} | {ms:.1f} |")
    print("OK")


if __name__ == "__main__":
    main()
