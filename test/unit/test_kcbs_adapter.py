"""The scheduler-side k-CBS driver (`sglang_rl.adapters.kcbs`, with the scheduler's
`KcbsManager`) on stand-in requests and a real `req_to_token` table: beams forked in place hold
their own tokens' KV and free every slot once, beams are admitted together, partial groups,
preempted or aborted beams and aborts of the parent end the search, and the k-CBS request
validation messages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
from sglang.srt.managers.schedule_policy import AddReqResult

from sglang_rl.adapters import kcbs, kcbs_manager
from sglang_rl.adapters.request_state import kcbs_beam_of, kcbs_search_of, state_of
from sglang_rl.request_options import RequestOptionError, validate_kcbs

VOCAB = 16


class FakeReq:
    def __init__(self, rid, text, ids, sp, return_logprob=True, top_logprobs_num=0, stream=False,
                 eos_token_ids=None, vocab_size=VOCAB):
        self.rid = rid
        self.origin_input_ids = list(ids)
        self.sampling_params = sp
        self.return_logprob = return_logprob
        self.eos_token_ids = eos_token_ids or {15}
        self.vocab_size = vocab_size
        self.tokenizer = None
        self.logprob = SimpleNamespace(output_top_logprobs_val=[], output_top_logprobs_idx=[])
        self.finished_reason = None
        self.finished_output = False
        self.output_ids = []
        self.finished_len = None
        self.to_finish = None
        self.req_pool_idx, self.kv_committed_len = None, 0

    def finished(self):
        return self.finished_reason is not None

    def finish_with(self, vals, ids):
        self.logprob.output_top_logprobs_val.append(list(vals))
        self.logprob.output_top_logprobs_idx.append(list(ids))
        self.finished_reason = FINISH_LENGTH(length=0)


class FakeScheduler:
    def __init__(self):
        self.waiting_queue = []
        self.streamed = []
        self.enable_hicache_storage = False
        self.output_streamer = SimpleNamespace(stream_output=lambda reqs, lp: self.streamed.extend(reqs))
        self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace())

    def init_req_max_new_tokens(self, req):
        pass

    def _add_request_to_queue(self, req):
        self.waiting_queue.append(req)

    def abort_request(self, recv_req):  # sglang's rule for queued requests: rid prefix
        self.waiting_queue = [r for r in self.waiting_queue if not r.rid.startswith(recv_req.rid)]


@pytest.fixture
def sched(monkeypatch):
    s = FakeScheduler()
    monkeypatch.setattr(kcbs_manager, "Req", FakeReq)
    kcbs.scheduler_init_after(None, s)  # the scheduler's KcbsManager, also on its model runner
    return s


def _parent(sched, k=2, steps=3, rid="p1"):
    """A k-CBS request, queued by `sched` (its search joins the scheduler's manager there)."""
    sp = SimpleNamespace(max_new_tokens=0, stop_token_ids=None, custom_params={})
    req = FakeReq(rid, "", [1, 2, 3], sp)
    state_of(req).kcbs_search = kcbs.KcbsSearch(req, k, steps, False)
    kcbs.add_request_to_queue_around(lambda scheduler, r: None, sched, req)
    return req


def _start(sched, parent):
    parent.finish_with([-0.1, -2.5], [4, 5])
    assert kcbs.filter_outputs([parent]) == []  # held back
    return kcbs_search_of(parent)


def _children(sched):
    return [r for r in sched.waiting_queue if kcbs_beam_of(r) is not None]


L = 3  # prompt length of `_parent`


def _running(beams, first_row=1):
    """Admit the beams as sglang would: a request slot each, the prompt from the cache (slots
    0..L-1, protected), one new slot at position L for the beam's first token."""
    table = torch.full((16, 64), -1, dtype=torch.int32)
    table[:, :L] = torch.arange(L, dtype=torch.int32)
    holds = {}  # KV slot -> the token whose KV it holds
    for j, r in enumerate(beams):
        r.req_pool_idx = first_row + j
        r.kv_committed_len = L + 1
        slot = 100 + j
        table[r.req_pool_idx, L] = slot
        holds[slot] = r.origin_input_ids[-1]
    return table, holds


def _sample(sched, batch, logits):
    """One forward of `batch` through the worker and sample hooks (sglang itself samples zeros)."""
    def sglang_sample(runner, out, fb):
        return torch.zeros(len(batch.reqs), dtype=torch.long)

    out = SimpleNamespace(next_token_logits=logits)
    return kcbs.worker_forward_around(
        lambda worker, b: kcbs.sample_around(sglang_sample, worker.model_runner, out, None), sched.tp_worker, batch)


@pytest.mark.parametrize("seed", range(4))
def test_forked_rows_hold_each_beams_tokens_and_every_slot_is_freed_once(sched, seed):
    """Beams forked in place: after every step, each live beam's row points at KV slots holding
    exactly its own tokens, the token it chose is its next input, and when the search ends the
    beams' rows free every slot their requests allocated exactly once (no leak, no double free),
    next to an ordinary request in the same batch whose row is never touched."""
    gen = torch.Generator().manual_seed(seed)
    k, steps = 3, 6
    parent = _parent(sched, k=k, steps=steps)
    parent.finish_with([-0.1, -1.0, -2.5], [4, 5, 6])
    assert kcbs.filter_outputs([parent]) == []
    search = kcbs_search_of(parent)
    beams = _children(sched)
    assert [r.origin_input_ids for r in beams] == [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6]]
    assert all(r.sampling_params.max_new_tokens == steps - 1 and r.sampling_params.ignore_eos
               and r.skip_radix_cache_insert for r in beams)
    sched.waiting_queue.clear()
    table, holds = _running(beams)
    other = FakeReq("plain", "", [7, 7], SimpleNamespace())
    other.req_pool_idx, other.kv_committed_len = 9, 2
    table[9, :2] = torch.tensor([50, 51], dtype=torch.int32)
    sched.req_to_token_pool = SimpleNamespace(req_to_token=table)
    batch = SimpleNamespace(reqs=[beams[0], other, beams[1], beams[2]])
    allocated = {100 + j for j in range(k)}
    next_slot = 200
    while not search.done:
        logits = torch.randn(len(batch.reqs), VOCAB, generator=gen) * 3
        next_ids = _sample(sched, batch, logits)
        assert next_ids[1] == 0  # the ordinary request keeps its own sample
        p = beams[0].kv_committed_len - 1
        for j, r in enumerate(beams):
            beam = search.beams[j]
            if search.done or beam.finished:
                continue
            row = table[r.req_pool_idx, L:p + 1].tolist()
            assert [holds[s] for s in row] == beam.tokens[:-1]
            assert next_ids[batch.reqs.index(r)] == beam.tokens[-1]
        if search.done:
            break
        for j, r in enumerate(beams):  # the next decode: one new slot per beam for its input token
            table[r.req_pool_idx, r.kv_committed_len] = next_slot
            holds[next_slot] = int(next_ids[batch.reqs.index(r)])
            allocated.add(next_slot)
            next_slot += 1
            r.kv_committed_len += 1
    assert search.step == steps or all(b.finished for b in search.beams)
    assert all(isinstance(r.to_finish, FINISH_LENGTH) for r in beams)
    assert sched.streamed == [parent] and len(state_of(parent).pending_payload[kcbs_manager.CANDIDATES_FIELD]) == k
    freed = []

    def release(req, tree_cache):
        freed.extend(table[req.req_pool_idx, L:req.kv_committed_len].tolist())

    for r in beams:
        r.finished_reason, r.to_finish = r.to_finish, None
        kcbs.release_kv_cache_around(release, r, None)
    assert sorted(freed) == sorted(allocated)
    assert table[9, :2].tolist() == [50, 51]


def test_beams_not_all_in_one_batch_end_the_search(sched):
    parent = _parent(sched, k=2, steps=4)
    search = _start(sched, parent)
    a, b = _children(sched)
    sched.waiting_queue.remove(a)
    table, _ = _running([a])
    sched.req_to_token_pool = SimpleNamespace(req_to_token=table)
    next_ids = _sample(sched, SimpleNamespace(reqs=[a]), torch.zeros(1, VOCAB))
    assert next_ids.tolist() == [0]  # sampled as sglang would; nothing forked
    assert search.done and parent.finished_reason.status_code == 503
    assert isinstance(a.to_finish, FINISH_ABORT) and b not in sched.waiting_queue


def test_a_preempted_beam_ends_its_search(sched):
    """A beam released before it finished (sglang retracted it) ends the search; the other beam
    stops, and the retracted one is marked so that it does not run again."""
    parent = _parent(sched, k=2, steps=5)
    search = _start(sched, parent)
    a, b = _children(sched)
    sched.waiting_queue.clear()
    table, _ = _running([a, b])
    sched.req_to_token_pool = SimpleNamespace(req_to_token=table)
    kcbs.release_kv_cache_around(lambda req, tc: None, a, None)
    assert search.done and sched.streamed == [parent] and parent.finished_reason.status_code == 503
    assert isinstance(a.to_finish, FINISH_ABORT) and isinstance(b.to_finish, FINISH_ABORT)


def test_a_beam_finished_by_an_abort_ends_the_search(sched):
    parent = _parent(sched, k=2, steps=5)
    search = _start(sched, parent)
    a, b = _children(sched)
    sched.waiting_queue.clear()
    table, _ = _running([a, b])
    sched.req_to_token_pool = SimpleNamespace(req_to_token=table)
    a.finished_reason = FINISH_ABORT("running timeout", 503)
    kcbs.release_kv_cache_around(lambda req, tc: None, a, None)
    assert search.done and isinstance(parent.finished_reason, FINISH_ABORT)
    assert list(parent.output_ids) == [] and not state_of(parent).pending_payload
    assert isinstance(b.to_finish, FINISH_ABORT) and not kcbs.manager_of(sched).active


class FakeAdder:
    def __init__(self, slots_left, tokens_left):
        self.can_run_list, self.running_batch, self.page_size = [], SimpleNamespace(reqs=[]), 1
        self.prefill_max_requests, self.rem_chunk_tokens = None, None
        self.rem_total_tokens, self.rem_input_tokens = tokens_left, tokens_left
        self.slots_left = slots_left

    def add_one_req(self, req):
        self.can_run_list.append(req)
        return "added"


@pytest.mark.parametrize("slots, tokens, admitted", [(4, 1000, 3), (2, 1000, 0), (4, 10, 0)])
def test_beams_are_admitted_together_or_not_at_all(sched, slots, tokens, admitted):
    parent = _parent(sched, k=3, steps=4)
    parent.finish_with([-0.1, -1.0, -2.5], [4, 5, 6])
    kcbs.filter_outputs([parent])
    adder = FakeAdder(slots, tokens)
    sched.get_num_allocatable_reqs = lambda running: adder.slots_left
    results = []
    for r in _children(sched):
        r.full_untruncated_fill_ids, r.prefix_indices = r.origin_input_ids, [0] * L
        res = kcbs.add_one_req_around(FakeAdder.add_one_req, adder, r)
        results.append(res)
        if res != "added":
            break
    assert len(adder.can_run_list) == admitted
    assert admitted == 3 or results == [AddReqResult.OTHER]


def test_abort_request_of_the_parent_ends_the_search(sched):
    parent = _parent(sched, k=2, steps=5, rid="abc")
    other = _parent(sched, k=2, steps=5, rid="xyz")
    search = _start(sched, parent)
    other_search = _start(sched, other)
    a, b = [c for c in _children(sched) if c.rid.startswith("abc")]
    sched.waiting_queue.remove(a)  # in a batch: marked to finish, freed by sglang when it does
    kcbs.abort_request_around(FakeScheduler.abort_request, sched,
                              SimpleNamespace(rid="abc", abort_all=False, abort_message=None))
    assert sched.streamed == [parent] and isinstance(parent.finished_reason, FINISH_ABORT)
    assert search.done and b not in sched.waiting_queue and isinstance(a.to_finish, FINISH_ABORT)
    a.finished_reason = a.to_finish
    assert kcbs.filter_outputs([a]) == []  # its output is dropped
    assert not other_search.done and len([c for c in sched.waiting_queue if c.rid.startswith("xyz")]) == 2
    kcbs.abort_request_around(FakeScheduler.abort_request, sched,
                              SimpleNamespace(rid="", abort_all=True, abort_message=None))
    assert other_search.done and sched.streamed == [parent, other] and not kcbs.manager_of(sched).active


def test_a_parent_aborted_before_its_prefill_returns_as_is(sched):
    parent = _parent(sched)
    parent.finished_reason = FINISH_ABORT("Aborted")
    assert kcbs.filter_outputs([parent]) == [parent] and not sched.waiting_queue


def test_validation_messages():
    with pytest.raises(RequestOptionError, match="kcbs_steps: set it, or set max_tokens / max_new_tokens"):
        validate_kcbs({"kcbs_enabled": True, "kcbs_beam_width": 2}, {}, False, None)
    with pytest.raises(RequestOptionError, match="kcbs_beam_width: set it, or set top_k"):
        validate_kcbs({"kcbs_enabled": True}, {"max_new_tokens": 4}, False, None)
    with pytest.raises(RequestOptionError, match="max_tokens / max_new_tokens .the default of kcbs_steps. must be"):
        validate_kcbs({"kcbs_enabled": True, "kcbs_beam_width": 2}, {"max_new_tokens": "4"}, False, None)
    with pytest.raises(RequestOptionError, match="streaming"):
        validate_kcbs({"kcbs_enabled": True, "kcbs_beam_width": 2}, {"max_new_tokens": 4}, True, None)
    with pytest.raises(RequestOptionError, match="--page-size 1"):
        validate_kcbs({"kcbs_enabled": True, "kcbs_beam_width": 2}, {"max_new_tokens": 4}, False,
                      SimpleNamespace(speculative_algorithm=None, page_size=16))
    entry = validate_kcbs({"kcbs_enabled": True}, {"max_new_tokens": 4, "top_k": 3}, False, None)
    assert entry == {"kcbs_k": 3, "kcbs_steps": 4, "kcbs_keep_all": False}


def test_generate_stream_is_refused_at_construction():
    from sglang_rl.adapters.api import RLGenerateReqInput

    with pytest.raises(RequestOptionError, match="streaming"):
        RLGenerateReqInput(text="hi", stream=True, kcbs_enabled=True)
    with pytest.raises(RequestOptionError, match="streaming"):
        RLGenerateReqInput(text="hi", stream=True, sampling_params={"kcbs_enabled": True})
    RLGenerateReqInput(text="hi", stream=True)
    RLGenerateReqInput(text="hi", kcbs_enabled=True)


def test_a_beam_dropped_by_a_waiting_timeout_ends_its_search(sched, monkeypatch):
    """AROUND _abort_on_waiting_timeout: sglang drops a queued beam request for waiting too long;
    its search ends with 503, the other search keeps its beams."""
    monkeypatch.setattr(kcbs.envs.SGLANG_REQ_WAITING_TIMEOUT, "get", lambda: 5.0)
    parent, other = _parent(sched, rid="late"), _parent(sched, rid="fine")
    search, other_search = _start(sched, parent), _start(sched, other)
    late_beam = next(c for c in _children(sched) if c.rid.startswith("late"))

    def drop_one(scheduler):
        scheduler.waiting_queue.remove(late_beam)

    kcbs.waiting_timeout_around(drop_one, sched)
    assert search.done and parent.finished_reason.status_code == 503
    assert "waiting timeout" in parent.finished_reason.message and sched.streamed == [parent]
    assert not other_search.done and len([c for c in _children(sched) if c.rid.startswith("fine")]) == 2
    assert not [c for c in _children(sched) if c.rid.startswith("late")]


def test_a_beam_evicted_from_a_full_queue_ends_its_search(sched):
    """AROUND _add_request_to_queue: with priority scheduling and a queue limit, adding a request
    can evict a queued beam request; its search ends."""
    sched.enable_priority_scheduling, sched.max_queued_requests = True, 2
    parent = _parent(sched, rid="evicted")
    search = _start(sched, parent)
    victim = _children(sched)[0]

    def add_evicting(scheduler, req):
        scheduler.waiting_queue.remove(victim)
        scheduler.waiting_queue.append(req)

    kcbs.add_request_to_queue_around(add_evicting, sched, FakeReq("new", "", [9], SimpleNamespace()))
    assert search.done and "evicted" in parent.finished_reason.message
    assert parent.finished_reason.status_code == 503
