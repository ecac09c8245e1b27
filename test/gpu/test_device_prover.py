"""`DeviceProver` on CUDA gives toploc's proofs of the chunks in a device row store (GPU).

A TOPLOC server proves its chunks with CUDA graphs that gather them from the store; the CPU
tests only reach the host path. Jobs mix full and partial chunks, more than one graph bucket
and more than one piece. A proof whose bytes differ from toploc's may only differ by the order
of ties in |x|, so each of those must still verify against its own rows.
"""

from __future__ import annotations

import pytest
import torch

from sglang_rl.fingerprint import Fingerprint, build_chunk_proofs, verify_rows
from sglang_rl.fingerprint.device_prover import DeviceProver

ROWS = 32
HIDDEN = 4096
TOPK = 128


@pytest.fixture(scope="module")
def stream():
    return torch.cuda.Stream(device=torch.device("cuda", 0))


@pytest.fixture(scope="module")
def store(stream) -> torch.Tensor:
    """A [256, ROWS, HIDDEN] bf16 store, written on the provers' stream."""
    with torch.cuda.stream(stream):
        rows = torch.randn(256, ROWS, HIDDEN, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    yield rows
    del rows
    torch.cuda.empty_cache()


def _prover(stream, graphs: bool) -> DeviceProver:
    return DeviceProver(torch.device("cuda", 0), stream, graphs=graphs)


def _assert_proofs_match_toploc(prover: DeviceProver, store: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(1)
    host = store.cpu()
    slots_of = store.shape[0]
    jobs = {
        "64 full": ([int(s) for s in torch.randperm(slots_of, generator=gen)[:64]], [ROWS] * 64),
        "37 mixed": ([int(s) for s in torch.randperm(slots_of, generator=gen)[:37]],
                     [int(r) for r in torch.randint(1, ROWS + 1, (37,), generator=gen)]),
        "150 mixed (3 pieces)": ([int(s) for s in torch.randint(0, slots_of, (150,), generator=gen)],
                                 [int(r) for r in torch.randint(1, ROWS + 1, (150,), generator=gen)]),
        "5 partial": ([3, 9, 200, 11, 7], [1, 2, 31, 5, 17]),
    }
    for name, (slots, rows) in jobs.items():
        with prover.on_stream():
            launched = prover.launch(store, slots, rows, TOPK)
        proofs = launched.proofs()
        assert len(proofs) == len(slots), name
        chunks = [host[s, :r] for s, r in zip(slots, rows)]
        expected = build_chunk_proofs(chunks, TOPK)
        differ = [i for i, (a, b) in enumerate(zip(proofs, expected)) if a != b]
        for i in differ:
            fp = Fingerprint(topk=TOPK, chunk_size=ROWS, n_rows=rows[i], proofs=(proofs[i],))
            report = verify_rows(chunks[i], fp)
            assert report.verified, (name, i, report.to_dict())
        print(f"{name}: bytes equal to toploc's {len(slots) - len(differ)}/{len(slots)}, the rest verify")


def test_graph_proofs_match_toploc(stream, store: torch.Tensor) -> None:
    prover = _prover(stream, graphs=True)
    _assert_proofs_match_toploc(prover, store)
    assert prover.use_graphs, "graph capture failed: the proofs ran op by op (see the warning)"


def test_op_by_op_proofs_match_toploc(stream, store: torch.Tensor) -> None:
    _assert_proofs_match_toploc(_prover(stream, graphs=False), store)


def test_jobs_in_flight_and_a_grown_store(stream, store: torch.Tensor) -> None:
    """Jobs of one bucket launched back to back before any is read, then read in reverse order:
    each keeps its own host buffers until read and gives what it gives alone. Then a job over a
    second, larger store tensor (the store grew: the graphs must read the new one, where the old
    one's chunks now lie at other slots), and one over the first store again."""
    prover = _prover(stream, graphs=True)
    gen = torch.Generator().manual_seed(2)

    def alone(on: torch.Tensor, slots: list[int], rows: list[int]) -> list[bytes]:
        with prover.on_stream():
            return prover.launch(on, slots, rows, TOPK).proofs()

    jobs = [[int(s) for s in torch.randperm(store.shape[0], generator=gen)[:20]] for _ in range(4)]
    expected = [alone(store, slots, [ROWS] * 20) for slots in jobs]
    with prover.on_stream():
        launched = [prover.launch(store, slots, [ROWS] * 20, TOPK) for slots in jobs]
    for i in reversed(range(len(jobs))):
        assert launched[i].proofs() == expected[i], f"job {i}, read out of order, differs"
    with prover.on_stream():
        grown = torch.cat([torch.randn_like(store, dtype=torch.float32).to(torch.bfloat16), store])
    moved = [store.shape[0] + 1, store.shape[0] + 2]  # the old store's slots 1 and 2
    assert alone(grown, moved, [ROWS, 9]) == alone(store, [1, 2], [ROWS, 9]), "the grown store was not read"
    assert alone(store, jobs[0], [ROWS] * 20) == expected[0], "back on the first store"
    assert prover.use_graphs, "graph capture failed: the proofs ran op by op (see the warning)"
