"""Outputs of finishing fingerprinted requests are held until their last proofs are built
(adapters/scheduler.py: stream_output_before; adapters/toploc.py: next_batch_after, idle_before), with
sglang's streamer and requests stood in by plain objects carrying a real pipeline, and real
builders, proofs and toploc underneath.

The scheduler step that sees requests finish must not wait for proofs; a held request must not
leave with another batch's outputs before its fingerprint is posted (with the overlap schedule a
finished request shows up again in the next batch); once its proofs are done it goes out with
the next batch, which then carries log-probs if the held request asked for them, or as soon as
the loop schedules again and finds it proven; and a loop with nothing to launch waits for what
is still held and streams it.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from sglang_rl.adapters import scheduler
from sglang_rl.adapters.request_state import peek, state_of
from sglang_rl.adapters import toploc as adapter
from sglang_rl.fingerprint.builder import FingerprintBuilder
from sglang_rl.fingerprint.pipeline import FingerprintPipeline
from sglang_rl.fingerprint.settings import PipelineSettings
from test_fingerprint_builder import HIDDEN, TOPK, posted_proofs, toploc_proofs


def _fed(pipeline: FingerprintPipeline, name: str, n: int, gen: torch.Generator,
         **kw) -> tuple[SimpleNamespace, torch.Tensor]:
    """A request whose builder saw n rows, one per step; `finished` says whether it is done."""
    rows = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16)
    builder = FingerprintBuilder(TOPK)
    for i in range(n):
        pipeline.add_builder_rows([builder], rows[i : i + 1], TOPK)
    req = SimpleNamespace(rid=name, finished_reason=None, output_ids_through_stop=[0] * n,
                          return_logprob=kw.get("logprob", False), is_retracted=False, done=kw.get("finished", True))
    req.finished = lambda r=req: r.done
    state_of(req).fingerprint = builder
    return req, rows


@pytest.fixture
def pipeline(monkeypatch: pytest.MonkeyPatch) -> FingerprintPipeline:
    """A CPU server's pipeline (jobs gather up to 100 chunks and 100 steps)."""
    args = SimpleNamespace(toploc_verification=True, return_hidden_states_mode=None, drafter_cotrain=False)
    monkeypatch.setattr(scheduler, "get_server_args", lambda: args)
    return adapter.new_pipeline(None, PipelineSettings(max_chunks=100, max_steps=100))


def _owned(pipeline: FingerprintPipeline, **fields) -> SimpleNamespace:
    """A stand-in for a part of sglang's scheduler (its output streamer, or the scheduler itself)
    that carries the scheduler's pipeline, as `toploc.scheduler_init_after` leaves it."""
    owner = SimpleNamespace(**fields)
    setattr(owner, adapter.ATTR, pipeline)
    return owner


def _streamed(result, reqs: list, flag: bool = False) -> tuple[list, bool]:
    """What stream_output would be called with after the BEFORE hook's result."""
    if result is None:
        return reqs, flag
    (_, out, out_flag, *_), _ = result
    return out, out_flag


def test_held_until_proven_never_streamed_early_then_released_with_log_probs(pipeline: FingerprintPipeline) -> None:
    gen = torch.Generator().manual_seed(3)
    a, rows_a = _fed(pipeline, "a", 45, gen, logprob=True)
    b, rows_b = _fed(pipeline, "b", 7, gen)
    c, _ = _fed(pipeline, "c", 5, gen, finished=False)
    streamer = _owned(pipeline)

    gate = threading.Event()
    busy = pipeline.launcher.proof_thread().submit(gate.wait, 30)
    try:
        out, flag = _streamed(scheduler.stream_output_before(streamer, [a, b, c], False), [a, b, c])
        assert out == [c] and flag is False  # the finishing step returned without any proof
        assert pipeline.holds_requests() and not (peek(a) and peek(a).pending_payload)
        # the overlap schedule's next batch still lists the finished requests: not streamed there
        out, _ = _streamed(scheduler.stream_output_before(streamer, [a, b, c], False), [a, b, c])
        assert out == [c]
    finally:
        gate.set()
    busy.result(timeout=30)
    pipeline.launcher.proof_thread().submit(lambda: None).result(timeout=30)  # the finishing job ran
    out, flag = _streamed(scheduler.stream_output_before(streamer, [c], False), [c])
    assert out == [c, a, b] and flag is True  # a asked for log-probs
    assert posted_proofs(a) == toploc_proofs(rows_a) and posted_proofs(b) == toploc_proofs(rows_b)
    assert not pipeline.holds_requests()
    # a and b appear once more (overlap): they are done, so they pass through untouched
    out, _ = _streamed(scheduler.stream_output_before(streamer, [a, b, c], False), [a, b, c])
    assert out == [a, b, c]


def _plan(batch: object) -> SimpleNamespace:
    return SimpleNamespace(batch_to_run=batch)


def _recording_scheduler(pipeline: FingerprintPipeline, sent: list) -> SimpleNamespace:
    """A scheduler whose output streamer records what it is asked to stream."""
    return _owned(pipeline, output_streamer=SimpleNamespace(stream_output=lambda reqs, flag: sent.append((reqs, flag))))


@contextlib.contextmanager
def _proofs_gated(pipeline: FingerprintPipeline):
    """The proof thread is kept busy inside the block: jobs started there cannot finish yet."""
    gate = threading.Event()
    busy = pipeline.launcher.proof_thread().submit(gate.wait, 30)
    try:
        yield
    finally:
        gate.set()
        busy.result(timeout=30)


def test_held_outputs_go_out_once_proven_without_waiting_for_the_next_batch(pipeline: FingerprintPipeline) -> None:
    """The loop's next schedule streams what is proven: with a batch to launch it only looks
    (a proof still running stays held); with none it waits for the proofs and streams them."""
    gen = torch.Generator().manual_seed(4)
    d, rows_d = _fed(pipeline, "d", 70, gen)
    sent: list[tuple[list, bool]] = []
    fake = _recording_scheduler(pipeline, sent)
    with _proofs_gated(pipeline):
        out, _ = _streamed(scheduler.stream_output_before(_owned(pipeline), [d], False), [d])
        assert out == []
        plan = _plan(object())
        assert adapter.next_batch_after(plan, fake) is plan
        assert sent == [] and pipeline.holds_requests()  # a batch to launch: no wait for the proof
    adapter.next_batch_after(_plan(None), fake)  # nothing to launch: wait, then stream
    assert sent == [([d], False)] and posted_proofs(d) == toploc_proofs(rows_d)
    adapter.next_batch_after(_plan(None), fake)  # nothing held: nothing sent
    assert len(sent) == 1

    e, rows_e = _fed(pipeline, "e", 40, gen, logprob=True)
    scheduler.stream_output_before(_owned(pipeline), [e], False)
    pipeline.launcher.proof_thread().submit(lambda: None).result(timeout=30)  # its job ran
    adapter.next_batch_after(_plan(object()), fake)  # proven: out before the next batch's outputs
    assert sent[1] == ([e], True) and posted_proofs(e) == toploc_proofs(rows_e)


def test_an_idle_loop_streams_what_is_held(pipeline: FingerprintPipeline) -> None:
    """Loops that idle without scheduling (disaggregation, multiplexing) release held outputs
    from the idle hook, after waiting for their proofs."""
    gen = torch.Generator().manual_seed(5)
    f, rows_f = _fed(pipeline, "f", 33, gen)
    sent: list[tuple[list, bool]] = []
    fake = _recording_scheduler(pipeline, sent)
    with _proofs_gated(pipeline):
        out, _ = _streamed(scheduler.stream_output_before(_owned(pipeline), [f], False), [f])
        assert out == [] and pipeline.holds_requests()
    adapter.idle_before(fake)
    assert sent == [([f], False)] and posted_proofs(f) == toploc_proofs(rows_f)
    adapter.idle_before(fake)  # nothing held: nothing sent
    assert len(sent) == 1


def test_a_gpu_schedule_holds_a_finished_output_four_steps_at_most_and_none_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a GPU server's finish_steps (4) the last chunk of a finished request waits in the
    shared job: decode steps count even when no request left has rows to fingerprint, the job
    starts at the fourth (prefill steps count too) and the output then goes out; with nothing to
    launch it starts at once."""
    pipeline = adapter.new_pipeline(None, PipelineSettings(max_chunks=100, max_steps=100, finish_steps=4))
    args = SimpleNamespace(toploc_verification=True, return_hidden_states_mode=None, drafter_cotrain=False,
                           toploc_verification_topk=TOPK)
    monkeypatch.setattr(scheduler, "get_server_args", lambda: args)
    processor = SimpleNamespace(server_args=args, is_generation=True, output_streamer=_owned(pipeline))
    no_rows = SimpleNamespace(reqs=[], return_hidden_states=True)
    result = SimpleNamespace(copy_done=None, speculative_num_draft_tokens=None, accept_lens=None,
                             extend_input_len_per_req=[],
                             logits_output=SimpleNamespace(hidden_states=torch.zeros(0, HIDDEN)))
    gen = torch.Generator().manual_seed(6)
    a, rows_a = _fed(pipeline, "a", 45, gen)
    sent: list[tuple[list, bool]] = []
    fake = _recording_scheduler(pipeline, sent)
    out, _ = _streamed(scheduler.stream_output_before(_owned(pipeline), [a], False), [a])
    assert out == [] and pipeline.holds_requests()
    job = pipeline.pending.future
    assert job is not None and len(pipeline.pending.queue) == 2  # a's full chunk and its last 13 rows
    for step in range(4):
        assert pipeline.pending.future is job
        adapter.next_batch_after(_plan(object()), fake)
        assert sent == []
        if step % 2:  # a prefill of requests without fingerprints (verifications, say) counts too
            scheduler.prefill_result_around(lambda *_: None, processor, no_rows, result)
        else:
            scheduler.decode_result_around(lambda *_: None, processor, no_rows, result)
    assert pipeline.pending.future is None  # started at the fourth step
    job.result(timeout=30)
    adapter.next_batch_after(_plan(object()), fake)
    assert sent == [([a], False)] and posted_proofs(a) == toploc_proofs(rows_a)

    b, rows_b = _fed(pipeline, "b", 20, gen)
    scheduler.stream_output_before(_owned(pipeline), [b], False)
    assert pipeline.holds_requests() and pipeline.pending.future is not None
    adapter.next_batch_after(_plan(None), fake)  # nothing to launch: its job starts now
    assert sent[1] == ([b], False) and posted_proofs(b) == toploc_proofs(rows_b)
    assert not pipeline.holds_requests()
