"""The fingerprint pipeline's builders (fingerprint/builder.py, pipeline.py) against toploc itself.

A builder receives each step's rows: one per request in plain decoding, a run of several under
speculative decoding, where the last run may go past the request's end (sglang cuts the extra
tokens with finished_len). The fingerprint must cover exactly the returned tokens: its proofs equal
toploc's own proofs of those rows, chunk by chunk, whatever the runs and wherever the cut falls
(inside the partial chunk, or reaching back into the last full one).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import toploc
import torch

from sglang_rl.adapters import toploc as adapter
from sglang_rl.adapters.request_state import peek, state_of
from sglang_rl.fingerprint import FingerprintError, build_chunk_proofs, decode_fingerprint
from sglang_rl.fingerprint.builder import FingerprintBuilder
from sglang_rl.fingerprint.device_prover import DeviceProver
from sglang_rl.fingerprint.pipeline import FingerprintPipeline
from sglang_rl.fingerprint.row_ring import RowRing
from sglang_rl.fingerprint.row_store import RowStore, staged_index
from sglang_rl.fingerprint.settings import CHUNK_ROWS, PipelineSettings
from sglang_rl.request_options import FINGERPRINTS_FIELD

TOPK = 16
HIDDEN = 64


def toploc_proofs(rows: torch.Tensor) -> list[bytes]:
    """toploc's proofs of rows [n, H], 32 rows per chunk (the last one shorter)."""
    return toploc.build_proofs_bytes(rows.to(torch.bfloat16), decode_batching_size=32, topk=TOPK,
                                     skip_prefill=True)


STRIDE = 5  # rows per request in a speculative step's block (its draft tokens)


def feed(pipeline: FingerprintPipeline, builders: list, runs: list[list[int]], rows: list[torch.Tensor]) -> None:
    """Feed builder i its runs[i] (row counts per step) from rows[i], all builders per step.
    Odd steps pack the runs one after another; even steps lay them out as a speculative step
    does, each request's run at the front of its block of STRIDE rows, the rest of the block
    rows that no fingerprint may take (random, and huge so a leak would change every proof)."""
    steps = max(len(r) for r in runs)
    taken = [0] * len(builders)
    for step in range(steps):
        active = [i for i in range(len(builders)) if step < len(runs[i])]
        counts = [runs[i][step] for i in active]
        own = [rows[i][taken[i] : taken[i] + c] for i, c in zip(active, counts)]
        if step % 2:
            pipeline.add_builder_rows([builders[i] for i in active], pipeline.keep_rows(torch.cat(own)), TOPK,
                                      counts)
        else:
            block = 1e4 * torch.randn(len(active) * STRIDE, HIDDEN)
            for n, run in enumerate(own):
                block[n * STRIDE : n * STRIDE + len(run)] = run
            starts = [n * STRIDE for n in range(len(active))]
            pipeline.add_builder_rows([builders[i] for i in active], pipeline.keep_rows(block), TOPK, counts,
                                      starts)
        for i, c in zip(active, counts):
            taken[i] += c


@pytest.fixture(params=["proof thread", "device launches", "device launches, staged writes",
                        "device launches, staged writes from a ring"])
def proof_path(request: pytest.FixtureRequest) -> str:
    """Both ways proofs are built: a CPU server's proof thread, and a GPU server's launches from
    the scheduler thread over a store on the device (here the CPU is that device: the same
    bookkeeping, with each launch computed at once), also with a GPU store's staged writes
    (decode steps written three at a time), and with the kept rows in a `RowRing` as on a GPU
    server: a small one here, so that staged steps wrap round its end and some steps do not
    fit and get tensors of their own (`pipeline_for` builds the pipeline of each)."""
    return request.param


def pipeline_for(path: str = "proof thread", **settings: int) -> FingerprintPipeline:
    """A pipeline on the CPU that builds proofs the way `path` (a `proof_path`) says, with
    `settings` (PipelineSettings fields) of its own."""
    prover = DeviceProver(torch.device("cpu")) if path.startswith("device launches") else None
    if "staged writes" in path:
        settings.setdefault("staged_steps", 3)
    pipeline = adapter.new_pipeline(None, PipelineSettings(**settings), prover=prover)
    if path.endswith("from a ring"):
        for dtype in (torch.float32, torch.bfloat16):
            pipeline.rings.by_kind[(dtype, HIDDEN, -1)] = RowRing(96, torch.empty(0, HIDDEN, dtype=dtype))
    return pipeline


def fingerprint_of(builder, n_rows: int) -> list[bytes]:
    tail = builder.tail(n_rows)
    last = None
    if tail is not None:
        slot, rows = tail.slot, tail.rows
        builder.store.flush()  # as the job that reads the tail would, first
        last = build_chunk_proofs([builder.store.data[slot, :rows].cpu()], TOPK)[0]
    fp = decode_fingerprint(builder.finish(last), expected_topk=TOPK)
    assert fp.n_rows == n_rows
    return list(fp.proofs)


@pytest.mark.parametrize("seed", range(6))
def test_runs_and_cut_match_toploc(seed: int, proof_path: str) -> None:
    rng = random.Random(seed)
    n_builders = 5
    runs = [[rng.randint(1, 5) for _ in range(rng.randint(3, 30))] for _ in range(n_builders)]
    rows = [torch.randn(sum(r), HIDDEN) for r in runs]
    builders = [FingerprintBuilder(TOPK) for _ in range(n_builders)]
    feed(pipeline_for(proof_path), builders, runs, rows)
    for builder, run, own in zip(builders, runs, rows):
        # the last run overshoots by up to its length - 1 (the request ended inside it)
        returned = sum(run) - rng.randint(0, run[-1] - 1)
        assert fingerprint_of(builder, returned) == toploc_proofs(own[:returned])


@pytest.mark.parametrize("max_steps", [1, 100])
def test_cut_reaching_into_the_last_full_chunk(max_steps: int, proof_path: str) -> None:
    """33 rows, 3 of them past the end: the full chunk's proof is replaced by a 30-row one,
    whether its job has started (max_steps 1) or the chunk is still queued (100)."""
    pipeline = pipeline_for(proof_path, max_chunks=100, max_steps=max_steps)
    pending = pipeline.pending
    rows = torch.randn(33, HIDDEN)
    builder = FingerprintBuilder(TOPK)
    feed(pipeline, [builder], [[4] * 7 + [5]], [rows])
    assert fingerprint_of(builder, 30) == toploc_proofs(rows[:30])
    assert pending.future is None and not pending.queue


def test_one_row_per_step_is_unchanged() -> None:
    rows = torch.randn(70, HIDDEN)
    builder = FingerprintBuilder(TOPK)
    feed(pipeline_for(), [builder], [[1] * 70], [rows])
    assert fingerprint_of(builder, 70) == toploc_proofs(rows)


def test_more_rows_cut_than_a_run_can_overshoot_is_an_error() -> None:
    builder = FingerprintBuilder(TOPK)
    feed(pipeline_for(), [builder], [[2] * 40], [torch.randn(80, HIDDEN)])
    with pytest.raises(FingerprintError, match="saw 80 rows for 10 returned tokens"):
        builder.tail(10)


def test_a_full_chunk_slot_is_not_reused_while_its_proof_job_may_read_it() -> None:
    from concurrent.futures import Future

    store = RowStore()
    first = store.acquire(HIDDEN)
    pending: Future = Future()
    store.release(first, pending)
    others = {store.acquire(HIDDEN) for _ in range(63)}
    assert first not in others  # lent: still read by the unfinished job
    pending.set_result([])
    assert store.acquire(HIDDEN) == first  # the job finished: the slot is back


def test_builders_of_many_requests_with_slots_lent_and_returned_match_toploc(
        monkeypatch: pytest.MonkeyPatch, proof_path: str) -> None:
    """More chunks than the store's first 64 slots, across builders that fill at different steps:
    every fingerprint still equals toploc's (a slot reused too early would corrupt a proof). The
    store grows while steps are staged: their rows keep their targets in the grown store."""
    pipeline = pipeline_for(proof_path)
    _refuse_double_targets(monkeypatch, pipeline.store)
    gen = torch.Generator().manual_seed(3)
    lengths = [97, 130, 64, 33, 200, 31] * 12
    rows = [torch.randn(n, HIDDEN, generator=gen) for n in lengths]
    builders = [FingerprintBuilder(TOPK) for _ in lengths]
    feed(pipeline, builders, [[1] * n for n in lengths], rows)
    for builder, n, r in zip(builders, lengths, rows):
        assert fingerprint_of(builder, n) == toploc_proofs(r)


def test_the_store_grows_under_staged_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """40 requests write two steps (one kept row in each block of two), which a GPU store holds
    staged, then 40 more join and the store grows: the staged rows still reach their own slots,
    and their unkept rows reach no slot that the grown store hands out."""
    pipeline = pipeline_for(staged_steps=3)
    _refuse_double_targets(monkeypatch, pipeline.store)
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randn(3, HIDDEN, generator=gen) for _ in range(80)]

    def step(builders: list, own: list[torch.Tensor]) -> None:
        block = 1e4 * torch.randn(2 * len(own), HIDDEN, generator=gen)
        block[0::2] = torch.stack(own)
        pipeline.add_builder_rows(builders, pipeline.keep_rows(block), TOPK, [1] * len(own),
                                  list(range(0, len(block), 2)))

    first = [FingerprintBuilder(TOPK) for _ in range(40)]
    for i in range(2):
        step(first, [r[i] for r in rows[:40]])
    assert pipeline.store.capacity == 64 and len(pipeline.store._staged) == 2
    later = [FingerprintBuilder(TOPK) for _ in range(40)]
    step(first + later, [r[2] for r in rows[:40]] + [r[0] for r in rows[40:]])
    assert pipeline.store.capacity == 128
    for builder, r in zip(first, rows):
        assert fingerprint_of(builder, 3) == toploc_proofs(r)
    for builder, r in zip(later, rows[40:]):
        assert fingerprint_of(builder, 1) == toploc_proofs(r[:1])


def test_rows_not_kept_are_written_at_once() -> None:
    """A staged store stages only rows of `keep_rows` (a private copy). Other rows, like a
    forward's own output buffer that the next forward overwrites, are written in their step:
    here the buffer is overwritten after every step, and the proofs are still those of the rows
    it held."""
    pipeline = pipeline_for(staged_steps=3)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 4, HIDDEN, generator=gen)  # 40 decode steps of 4 requests
    builders = [FingerprintBuilder(TOPK) for _ in range(4)]
    buffer = torch.empty(4, HIDDEN)
    for step in rows:
        buffer.copy_(step)
        pipeline.add_builder_rows(builders, buffer, TOPK)
        buffer.normal_(generator=gen)  # the next forward's output lands in the same buffer
    assert not pipeline.store._staged
    for i, builder in enumerate(builders):
        assert fingerprint_of(builder, 40) == toploc_proofs(rows[:, i])


def test_staged_index_puts_each_run_where_a_step_by_step_index_would() -> None:
    """The index a flush builds for all its staged steps at once (numpy, from the runs) equals
    the steps' indexes built one by one: each run's rows at its store rows, in order, every
    other row at the discard row."""
    rng = random.Random(3)
    discard = 999
    runs, sizes, expected = [], [], []
    for _ in range(20):
        size = rng.choice([1, 4, 12])
        step = [discard] * size
        step_runs, row = [], 0
        while row < size:
            count = rng.randint(0, size - row)
            if count and rng.random() < 0.8:
                first = rng.randrange(0, 900)
                step_runs += (row, first, count)
                step[row : row + count] = range(first, first + count)
            row += max(count, 1)
        runs.append(step_runs)
        sizes.append(size)
        expected += step
    assert staged_index(runs, sizes, discard).tolist() == expected
    assert staged_index([[]], [3], discard).tolist() == [discard] * 3


def test_a_job_starts_when_old_enough() -> None:
    """Full chunks gather into one proof job, started `max_steps` steps after its first chunk."""
    pipeline = pipeline_for(max_chunks=100, max_steps=3)
    pending = pipeline.pending
    gen = torch.Generator().manual_seed(8)
    rows = torch.randn(32, HIDDEN, generator=gen)
    builder, other = FingerprintBuilder(TOPK), FingerprintBuilder(TOPK)
    feed(pipeline, [builder], [[1] * 32], [rows])  # the chunk fills in the 32nd step: 1 step old
    chunk = builder.chunks[0]
    assert pending.queue == [chunk] and not chunk.job.running() and not chunk.job.done()
    feed(pipeline, [other], [[1, 1]], [torch.randn(2, HIDDEN, generator=gen)])  # 3 steps old: started
    assert pending.future is None
    chunk.job.result(timeout=30)
    assert chunk.proof is not None
    assert fingerprint_of(builder, 32) == toploc_proofs(rows)


def _finishing(n_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(finished_reason=None, output_ids_through_stop=[0] * n_tokens, rid="r")


def posted_proofs(req: SimpleNamespace) -> list[bytes]:
    fingerprint = state_of(req).pending_payload[FINGERPRINTS_FIELD][0]
    return list(decode_fingerprint(fingerprint, expected_topk=TOPK).proofs)


def test_finishing_requests_join_the_pending_job_which_starts_within_finish_steps(proof_path: str) -> None:
    """Finishing requests' last partial chunks join the pending job with everyone's queued full
    chunks; the job starts `finish_steps` steps later (steps without rows count too), the
    requests are held until then, and slots lent to the job stay lent until it has run. With
    nothing left to run (`release_finished(wait=True)`) the job starts at once."""
    pipeline = pipeline_for(proof_path, max_chunks=100, max_steps=100, finish_steps=3)
    pending = pipeline.pending
    gen = torch.Generator().manual_seed(10)
    lengths = [40, 70, 33, 75]
    rows = [torch.randn(n, HIDDEN, generator=gen) for n in lengths]
    builders = [FingerprintBuilder(TOPK) for _ in lengths]
    feed(pipeline, builders, [[1] * n for n in lengths], rows)
    job = pending.future
    assert len(pending.queue) == 6 and not job.done()
    retired = builders[1].chunks[0]  # its slot went back when the request's second chunk filled
    assert retired.released and retired.job is job and retired.slot not in pipeline.store._free

    first = [_finishing(40), _finishing(70)]
    assert adapter.finish_builders(pipeline, list(zip(builders[:2], first))) == first
    assert len(pending.queue) == 8 and pending.future is job  # their two tails joined the job
    for _ in range(2):
        pipeline.add_builder_rows([], torch.zeros(0, HIDDEN), TOPK)
        assert pending.future is job and pipeline.release_finished() == [] and pipeline.holds_requests()
    assert retired.slot not in pipeline.store._free
    pipeline.add_builder_rows([], torch.zeros(0, HIDDEN), TOPK)  # the third step: started
    assert pending.future is None and not pending.queue
    job.result(timeout=30)
    assert pipeline.release_finished() == first and not pipeline.holds_requests()
    assert [posted_proofs(r) for r in first] == [toploc_proofs(rows[0]), toploc_proofs(rows[1])]
    pipeline.store.reclaim()
    assert retired.slot in pipeline.store._free  # the job has run: the slot is back

    more = [torch.randn(20, HIDDEN, generator=gen) for _ in range(2)]
    feed(pipeline, builders[2:], [[1] * 20] * 2, more)  # 53 and 95 rows: a full chunk queued in a new job
    rest = [_finishing(53), _finishing(95)]
    assert adapter.finish_builders(pipeline, list(zip(builders[2:], rest))) == rest
    assert pending.future is not None
    assert pipeline.release_finished(wait=True) == rest
    assert [posted_proofs(r) for r in rest] == [toploc_proofs(torch.cat([rows[2], more[0]])),
                                                toploc_proofs(torch.cat([rows[3], more[1]]))]
    assert pending.future is None and not pending.queue


def test_finishing_never_waits_for_proofs_and_slots_stay_lent_until_they_are_built() -> None:
    """With the proof thread busy, finishing requests are held (nothing posted, nothing waited
    for), and the row slots their proofs will read are not handed out again; once the thread is
    free the held requests come back with toploc's proofs."""
    import threading

    pipeline = pipeline_for(max_chunks=100, max_steps=100)
    pending = pipeline.pending
    gen = torch.Generator().manual_seed(12)
    rows = [torch.randn(n, HIDDEN, generator=gen) for n in (100, 50)]
    builders = [FingerprintBuilder(TOPK) for _ in rows]
    feed(pipeline, builders, [[1] * 100, [1] * 50], rows)
    read_later = {c.slot for b in builders for c in b.chunks} | {b.slot for b in builders}

    gate = threading.Event()
    busy = pipeline.launcher.proof_thread().submit(gate.wait, 30)
    reqs = [_finishing(100), _finishing(50)]
    try:
        assert adapter.finish_builders(pipeline, list(zip(builders, reqs))) == reqs
        assert pipeline.release_finished() == [] and pipeline.holds_requests()
        assert not any(peek(r) and peek(r).pending_payload for r in reqs)
        assert pending.future is None  # the shared job was emptied and closed
        handed_out = {pipeline.store.acquire(HIDDEN) for _ in range(200)}
        assert not handed_out & read_later
    finally:
        gate.set()
    busy.result(timeout=30)
    assert pipeline.release_finished(wait=True) == reqs and not pipeline.holds_requests()
    assert [posted_proofs(r) for r in reqs] == [toploc_proofs(rows[0]), toploc_proofs(rows[1])]


def test_an_aborted_request_leaves_the_job() -> None:
    pipeline = pipeline_for(max_chunks=100, max_steps=100)
    pending = pipeline.pending
    builder = FingerprintBuilder(TOPK)
    feed(pipeline, [builder], [[1] * 64], [torch.randn(64, HIDDEN)])
    job = pending.future
    assert len(pending.queue) == 2
    builder.release()
    assert not pending.queue and pending.future is None and job.done()


def test_a_full_job_starts_at_once() -> None:
    pipeline = pipeline_for(max_chunks=4, max_steps=100)
    pending = pipeline.pending
    gen = torch.Generator().manual_seed(9)
    rows = [torch.randn(32, HIDDEN, generator=gen) for _ in range(4)]
    builders = [FingerprintBuilder(TOPK) for _ in rows]
    feed(pipeline, builders, [[1] * 32] * 4, rows)
    assert pending.future is None
    builders[0].chunks[0].job.result(timeout=30)  # runs without any finish
    assert all(b.chunks[0].proof is not None for b in builders)
    for builder, r in zip(builders, rows):
        assert fingerprint_of(builder, 32) == toploc_proofs(r)


def _refuse_double_targets(monkeypatch: pytest.MonkeyPatch, store: RowStore) -> None:
    """Fail any write to `store` that names a row twice (the discard slot aside): a GPU scatter
    keeps either value of a doubled target, so staged steps must never hold an aborted request's
    rows for a slot that has a new owner; on the CPU the later value happens to win."""
    copy = store._copy

    def checked(parts, index, picks=None, wait=True):
        discard = (store.data.shape[0] - 1) * CHUNK_ROWS
        kept = [i for i in index if i < discard]
        assert len(kept) == len(set(kept)), "a store write names a row twice"
        return copy(parts, index, picks, wait)

    monkeypatch.setattr(store, "_copy", checked)


@pytest.mark.parametrize("max_steps,finish_steps", [(1, 0), (16, 4)])
def test_random_traffic_gives_toploc_proofs_and_returns_every_slot(
    monkeypatch: pytest.MonkeyPatch, max_steps: int, finish_steps: int, proof_path: str,
) -> None:
    """Requests arrive, commit runs of rows, finish at their own steps (some cut inside their last
    run) or are aborted: every posted fingerprint equals toploc's proofs of the request's returned
    rows, and once all are gone every row slot is back in the store. Finished requests are
    released as their proofs come (none waited for), at the latest `finish_steps` + 1 steps
    later."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    pipeline = pipeline_for(proof_path, max_steps=max_steps, finish_steps=finish_steps)
    _refuse_double_targets(monkeypatch, pipeline.store)
    rng = random.Random(max_steps)
    gen = torch.Generator().manual_seed(max_steps)
    live: list[dict] = []
    held: list[dict] = []
    finished = 0
    for _ in range(300):
        while len(live) < 24 and rng.random() < 0.5:
            live.append({"builder": FingerprintBuilder(TOPK), "target": rng.randint(1, 120), "rows": []})
        counts = [rng.choice((1, 1, 3, 4)) for _ in live]
        if live:
            block = torch.randn(sum(counts), HIDDEN, generator=gen).to(torch.bfloat16)
            pipeline.add_builder_rows([r["builder"] for r in live], pipeline.keep_rows(block), TOPK, counts)
            for r, piece in zip(live, block.split(counts)):
                r["rows"].append(piece)
        else:  # a step without fingerprinted rows still counts towards the job's deadline
            pipeline.add_builder_rows([], torch.zeros(0, HIDDEN), TOPK)
        ending = [r for r in live if sum(len(p) for p in r["rows"]) >= r["target"] or rng.random() < 0.02]
        items = []
        for r in ending:
            r["abort"] = rng.random() < 0.2
            r["returned"] = min(r["target"], sum(len(p) for p in r["rows"]))
            r["req"] = SimpleNamespace(finished_reason=FINISH_ABORT() if r["abort"] else None,
                                       output_ids_through_stop=[0] * r["returned"], rid="r")
            items.append((r["builder"], r["req"]))
        adapter.finish_builders(pipeline, items)
        for r in ending:
            if r["abort"]:
                assert not (peek(r["req"]) and peek(r["req"]).pending_payload)
            else:
                r["held_steps"] = 0
                held.append(r)
        pipeline.launcher.proof_thread().submit(lambda: None).result(timeout=30)  # started jobs have run
        released = {id(req) for req in pipeline.release_finished()}
        for r in held:
            if id(r["req"]) in released:
                assert posted_proofs(r["req"]) == toploc_proofs(torch.cat(r["rows"])[: r["returned"]])
                finished += 1
            else:
                assert not (peek(r["req"]) and peek(r["req"]).pending_payload)
                r["held_steps"] += 1
                assert r["held_steps"] <= finish_steps + 1, "a finished request waited past its job's deadline"
        held = [r for r in held if id(r["req"]) not in released]
        live = [r for r in live if r not in ending]
    released = {id(req) for req in pipeline.release_finished(wait=True)}
    assert released == {id(r["req"]) for r in held}
    for r in held:
        assert posted_proofs(r["req"]) == toploc_proofs(torch.cat(r["rows"])[: r["returned"]])
    for r in live:
        r["builder"].release()
    assert finished > 100
    store = pipeline.store
    for future in list(store._lent):
        future.result(timeout=30)
    store.reclaim()
    store.flush()  # slots freed while rows were staged come back once those rows are written
    assert len(store._free) == store.capacity and not pipeline.pending.queue
