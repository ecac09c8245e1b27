"""The scheduler's fingerprint builders (adapters/toploc.py) against toploc itself.

A builder receives each step's rows: one per request in plain decoding, a run of several under
speculative decoding, where the last run may go past the request's end (sglang cuts the extra
tokens with finished_len). The fingerprint must cover exactly the returned tokens: its proofs equal
toploc's own proofs of those rows, chunk by chunk, whatever the runs and wherever the cut falls
(inside the partial chunk, or reaching back into the last full one).
"""

from __future__ import annotations

import random

import pytest
import toploc
import torch

from sglang_rl.adapters import toploc as adapter
from sglang_rl.fingerprint import FingerprintError, decode_fingerprint

TOPK = 16
HIDDEN = 64


def toploc_proofs(rows: torch.Tensor) -> list[bytes]:
    """toploc's proofs of rows [n, H], 32 rows per chunk (the last one shorter)."""
    return toploc.build_proofs_bytes(rows.to(torch.bfloat16), decode_batching_size=32, topk=TOPK,
                                     skip_prefill=True)


def feed(builders: list, runs: list[list[int]], rows: list[torch.Tensor]) -> None:
    """Feed builder i its runs[i] (row counts per step) from rows[i], all builders per step."""
    steps = max(len(r) for r in runs)
    taken = [0] * len(builders)
    for step in range(steps):
        active = [i for i in range(len(builders)) if step < len(runs[i])]
        counts = [runs[i][step] for i in active]
        block = torch.cat([rows[i][taken[i] : taken[i] + c] for i, c in zip(active, counts)])
        adapter.add_builder_rows([builders[i] for i in active], block, TOPK, counts)
        for i, c in zip(active, counts):
            taken[i] += c


def fingerprint_of(builder, n_rows: int) -> list[bytes]:
    tail = builder.tail(n_rows)
    last = adapter._prove([tail], TOPK, None)[0] if tail is not None else None
    fp = decode_fingerprint(builder.finish(last), expected_topk=TOPK)
    assert fp.n_rows == n_rows
    return list(fp.proofs)


@pytest.mark.parametrize("seed", range(6))
def test_runs_and_cut_match_toploc(seed: int) -> None:
    rng = random.Random(seed)
    n_builders = 5
    runs = [[rng.randint(1, 5) for _ in range(rng.randint(3, 30))] for _ in range(n_builders)]
    rows = [torch.randn(sum(r), HIDDEN) for r in runs]
    builders = [adapter.FingerprintBuilder(TOPK) for _ in range(n_builders)]
    feed(builders, runs, rows)
    for builder, run, own in zip(builders, runs, rows):
        # the last run overshoots by up to its length - 1 (the request ended inside it)
        returned = sum(run) - rng.randint(0, run[-1] - 1)
        assert fingerprint_of(builder, returned) == toploc_proofs(own[:returned])


def test_cut_reaching_into_the_last_full_chunk() -> None:
    """33 rows, 3 of them past the end: the full chunk's proof is replaced by a 30-row one."""
    rows = torch.randn(33, HIDDEN)
    builder = adapter.FingerprintBuilder(TOPK)
    feed([builder], [[4] * 7 + [5]], [rows])
    assert fingerprint_of(builder, 30) == toploc_proofs(rows[:30])


def test_one_row_per_step_is_unchanged() -> None:
    rows = torch.randn(70, HIDDEN)
    builder = adapter.FingerprintBuilder(TOPK)
    feed([builder], [[1] * 70], [rows])
    assert fingerprint_of(builder, 70) == toploc_proofs(rows)


def test_more_rows_cut_than_a_run_can_overshoot_is_an_error() -> None:
    builder = adapter.FingerprintBuilder(TOPK)
    feed([builder], [[2] * 40], [torch.randn(80, HIDDEN)])
    with pytest.raises(FingerprintError, match="saw 80 rows for 10 returned tokens"):
        builder.tail(10)


def test_a_full_chunk_slot_is_not_reused_while_its_proof_job_may_read_it() -> None:
    from concurrent.futures import Future

    store = adapter.RowStore()
    first = store.acquire(HIDDEN)
    pending: Future = Future()
    store.release(first, pending)
    others = {store.acquire(HIDDEN) for _ in range(63)}
    assert first not in others  # lent: still read by the unfinished job
    pending.set_result([])
    assert store.acquire(HIDDEN) == first  # the job finished: the slot is back


def test_builders_of_many_requests_with_slots_lent_and_returned_match_toploc() -> None:
    """More chunks than the store's first 64 slots, across builders that fill at different steps:
    every fingerprint still equals toploc's (a slot reused too early would corrupt a proof)."""
    gen = torch.Generator().manual_seed(3)
    lengths = [97, 130, 64, 33, 200, 31] * 12
    rows = [torch.randn(n, HIDDEN, generator=gen) for n in lengths]
    builders = [adapter.FingerprintBuilder(TOPK) for _ in lengths]
    feed(builders, [[1] * n for n in lengths], rows)
    for builder, n, r in zip(builders, lengths, rows):
        assert fingerprint_of(builder, n) == toploc_proofs(r)
