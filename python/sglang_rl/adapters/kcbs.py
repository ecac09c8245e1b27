"""Scheduler side of k-CBS: beams are k long-lived decode requests per search, forked in place
between steps, so every step is one batched decode (CUDA graphs included) for the live beams of
all k-CBS requests, next to ordinary requests.

Life of a search:
1. The k-CBS request itself is prefilled once (prefill-only, top-k log-probs of its last
   position); its output is held back. Its top-k give step 1 (`kcbs_step`, the engine-agnostic
   core).
2. Beam slot j becomes a request `prompt + [token_j]` (ignore_eos, no stop rules, at most T - 1
   new tokens). The radix cache serves the prompt's KV by index, so the k beams cost one extend
   of one token each; they are admitted into a batch together or not at all.
3. In every forward that holds the beams, `sample_around` reads the beams' log-softmax rows at
   temperature 1 before sglang samples, runs the step, and then, on the forward stream:
   - writes each slot's chosen token as that slot's next token (the overlap scheduler feeds it
     to the next decode through its future map);
   - forks in place: slot j's `req_to_token` row over the beam positions [L, p] becomes its
     parent slot's row (index sharing, no KV copy).
4. The slots a search's beams allocated past the prompt (one per beam per step) are owned by the
   search: before sglang frees the first beam, `release_kv_cache_around` deals them back into the
   rows, each exactly once, so sglang's own free path releases every slot exactly once; the beams
   never insert into the radix cache.
5. After step T (or when every candidate has finished) the beams are told to finish and the held
   request is released with the best candidate as its output and every candidate attached.

The same code runs on every TP rank: the selection is a function of the logits, which every rank
holds, so all ranks fork alike.
"""

from __future__ import annotations

import math
from array import array
from http import HTTPStatus
from typing import Any, Callable, Optional

import torch

from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN, Req
from sglang.srt.managers.schedule_policy import AddReqResult
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_rl.adapters import transport
from sglang_rl.adapters.request_state import kcbs_beam_of, kcbs_search_of, state_of
from sglang_rl.kcbs import kcbs_step

CANDIDATES_FIELD = "kcbs_candidates"

_scheduler: Any = None


def scheduler_init_after(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: beam requests are queued through the scheduler of this process."""
    global _scheduler
    _scheduler = scheduler


class Beam:
    __slots__ = ("tokens", "score", "raw", "finished", "reason")

    def __init__(self, tokens: list[int], score: float, raw: float, finished: bool, reason: str) -> None:
        self.tokens, self.score, self.raw, self.finished, self.reason = tokens, score, raw, finished, reason


class KcbsSearch:
    """The state of one k-CBS request from its prompt prefill to its release."""

    def __init__(self, parent: Any, k: int, steps: int, keep_all: bool) -> None:
        self.parent = parent
        self.k = k
        self.steps = steps
        self.keep_all = keep_all
        self.step = 0
        self.beams: list[Beam] = [Beam([], 0.0, 0.0, False, "length")]
        # for each new beam of the last step, the index of the beam it extends
        self.parents: list[int] = []
        # slot j -> the request that runs beam j
        self.beam_reqs: list[Any] = []
        # per beam forward: the KV slot each beam request allocated for its newest position
        self.owned: list[torch.Tensor] = []
        self.admitting: Any = None  # the PrefillAdder that is admitting this search's beams
        self.started = False
        self.done = False
        self._eos: Optional[set[int]] = None

    @property
    def prompt_len(self) -> int:
        return len(self.parent.origin_input_ids)

    def eos_ids(self) -> set[int]:
        """The tokens that end a beam (computed once per search)."""
        if self._eos is None:
            p = self.parent
            ids = set(p.eos_token_ids or ())
            ids |= set(p.sampling_params.stop_token_ids or ())
            tok = getattr(p, "tokenizer", None)
            if tok is not None and getattr(tok, "eos_token_id", None) is not None:
                ids.add(tok.eos_token_id)
            self._eos = ids
        return self._eos

    def over(self) -> bool:
        """T steps done, or every candidate has finished."""
        return self.step >= self.steps or all(b.finished for b in self.beams)


# Searches between their prompt prefill and their end, by parent rid (for aborts).
_active: dict[Any, KcbsSearch] = {}


CHILD_RID_MARK = "::kcbs::"


def is_child_rid(rid: Any) -> bool:
    """Beam requests carry a marker in their rid (set before Req.__init__ hooks run)."""
    return isinstance(rid, str) and CHILD_RID_MARK in rid


def parent_state(options: dict) -> Optional[tuple[int, int, bool]]:
    if "kcbs_k" not in options:
        return None
    return int(options["kcbs_k"]), int(options["kcbs_steps"]), bool(options.get("kcbs_keep_all"))


def _top_logprobs(req: Any) -> Optional[tuple[list[float], list[int]]]:
    """The top-k (vals, ids) of the position after the request's last token (None if missing)."""
    vals = req.logprob.output_top_logprobs_val if req.return_logprob else None
    idxs = req.logprob.output_top_logprobs_idx if req.return_logprob else None
    if not vals or not idxs or not vals[-1]:
        return None
    return list(vals[-1]), list(idxs[-1])


Top = Optional[tuple[list[float], list[int]]]
_NO_TOKEN = 2**62  # column padding of `_advance_all`: sorts after every real token id


def _advance_all(ready: list[tuple[KcbsSearch, list[Top]]]) -> None:
    """One k-CBS step over the beams of every search that is ready, in one `kcbs_step` call.

    The step gets each live beam's top-k (log-prob, token id) pairs, as a compact `[beams, width]`
    matrix whose columns are sorted by token id, so that `kcbs_step`'s tie rule (lower token id
    first) holds exactly as over the full vocabulary; columns are mapped back to token ids
    afterwards. Missing columns are -inf. Sets each search's new beams and their parents."""
    if not ready:
        return
    width = max(s.k for s, _ in ready)
    ids_rows: list[list[int]] = []
    val_rows: list[list[float]] = []
    beam_request, score, raw, finished, last = [], [], [], [], []
    for r, (search, tops) in enumerate(ready):
        for b, beam in enumerate(search.beams):
            top = tops[b] if b < len(tops) and not beam.finished else None
            ids = list(top[1][:width]) if top is not None else []
            vals = list(top[0][:width]) if top is not None else []
            pad = width - len(ids)
            ids_rows.append(ids + [_NO_TOKEN] * pad)
            val_rows.append(vals + [-math.inf] * pad)
            beam_request.append(r)
            score.append(beam.score)
            raw.append(beam.raw)
            finished.append(beam.finished)
        last.append(search.keep_all and search.step + 1 >= search.steps)
    # one sort of every row by token id (padding sorts last)
    token_of, order = torch.tensor(ids_rows, dtype=torch.long).sort(dim=1)
    values = torch.tensor(val_rows, dtype=torch.float64).gather(1, order)
    token_of[token_of == _NO_TOKEN] = -1
    sel = kcbs_step(
        values,
        torch.tensor(beam_request, dtype=torch.long),
        torch.tensor(score, dtype=torch.float64),
        torch.tensor(raw, dtype=torch.float64),
        torch.tensor(finished),
        torch.tensor([s.k for s, _ in ready]),
        torch.tensor(last),
    )
    firsts = [0]
    for search, _ in ready:
        firsts.append(firsts[-1] + len(search.beams))
    columns = sel.token.clamp(min=0)
    tokens = token_of[sel.parent_beam, columns].tolist()
    parents, scores, raws, carried = (sel.parent_beam.tolist(), sel.score.tolist(), sel.raw.tolist(),
                                      sel.finished.tolist())
    n_sel = len(sel)
    for r, (search, _) in enumerate(ready):
        eos = search.eos_ids()
        new, origin = [], []
        for i in range(*sel.rows(r).indices(n_sel)):
            local = parents[i] - firsts[r]
            base = search.beams[local]
            origin.append(local)
            if carried[i]:
                new.append(Beam(base.tokens, scores[i], raws[i], True, base.reason))
            else:
                stop = tokens[i] in eos
                new.append(Beam(base.tokens + [tokens[i]], scores[i], raws[i], stop,
                                "stop" if stop else "length"))
        search.beams = new
        search.parents = origin
        search.step += 1


def _spawn_beams(search: KcbsSearch, released: list) -> None:
    """Queue one request per beam slot: prompt + the beam's first token, decoding up to T - 1
    tokens whose choice `sample_around` makes. A finished candidate's slot runs as well (its
    rows are ignored) so that the group stays whole."""
    p = search.parent
    sched = _scheduler
    search.beam_reqs = []
    for b, beam in enumerate(search.beams):
        ids = array("q", list(p.origin_input_ids) + beam.tokens[-1:])
        sp = SamplingParams(max_new_tokens=search.steps - 1, temperature=1.0, ignore_eos=True)
        sp.normalize(None)
        req = Req(f"{p.rid}{CHILD_RID_MARK}{b}", "", ids, sp, return_logprob=False, stream=False,
                  eos_token_ids=None, vocab_size=p.vocab_size)
        req.skip_radix_cache_insert = True  # its rows are the search's; only the prompt is cached
        state_of(req).kcbs_beam = (search, b)
        search.beam_reqs.append(req)
    local = getattr(getattr(sched, "disaggregation_mode", None), "name", "NULL") == "NULL"
    for req in search.beam_reqs:
        sched.init_req_max_new_tokens(req)
        sched._add_request_to_queue(req)
        queue = sched.waiting_queue
        if local and (not queue or queue[-1] is not req):
            # refused by the scheduler (queue limit, priority rules): the search cannot go on
            _abort(search, "k-CBS: the scheduler refused a beam request (waiting queue full?)", released,
                   status_code=HTTPStatus.SERVICE_UNAVAILABLE)
            return


def _finalize(search: KcbsSearch) -> None:
    """Attach the candidates to the held request, its output being the best candidate."""
    search.done = True
    _active.pop(search.parent.rid, None)
    p = search.parent
    beams = search.beams if search.keep_all else search.beams[: search.k]
    tok = getattr(p, "tokenizer", None)
    candidates = [
        {
            "token_ids": list(b.tokens),
            "text": tok.decode(b.tokens, skip_special_tokens=True) if tok is not None else "",
            "logprob": b.score,
            "raw_logprob": b.raw,
            "finish_reason": b.reason,
        }
        for b in beams
    ]
    best = beams[0]
    p.output_ids = array("q", best.tokens)
    p.finished_len = len(best.tokens)
    p.finished_reason = (
        FINISH_MATCHED_TOKEN(matched=best.tokens[-1]) if best.reason == "stop"
        else FINISH_LENGTH(length=len(best.tokens))
    )
    transport.post(p, **{CANDIDATES_FIELD: candidates})
    _stop_beams(search, FINISH_LENGTH(length=max(search.step - 1, 0)))


def _stop_beams(search: KcbsSearch, reason: Any) -> None:
    """Queued beams are dropped (they hold no KV); running ones finish at their next result
    (sglang frees them; their outputs are dropped by `filter_outputs`)."""
    sched = _scheduler
    live = {id(r): r for r in search.beam_reqs if not r.finished()}
    if not live or sched is None:
        return
    queue = sched.waiting_queue
    dropped = [r for r in queue if id(r) in live]
    if dropped:
        queue[:] = [r for r in queue if id(r) not in live]
        for r in dropped:
            live.pop(id(r))
            if getattr(sched, "enable_hicache_storage", False):
                sched.tree_cache.release_aborted_request(r.rid)
    for r in live.values():
        r.to_finish = reason


def _stream(p: Any, released: Optional[list]) -> None:
    """Hand a released request to the current output list, or stream it now."""
    if released is not None:
        released.append(p)
    elif _scheduler is not None and not p.finished_output:
        _scheduler.output_streamer.stream_output([p], p.return_logprob)


def _abort(search: KcbsSearch, message: str, released: Optional[list], status_code: Any = None,
           err_type: Any = None) -> None:
    """End a search without candidates: its beams stop and the held request is released with an
    abort finish reason, into `released` or, outside an output step, streamed at once."""
    if search.done:
        return
    search.done = True
    _active.pop(search.parent.rid, None)
    _stop_beams(search, FINISH_ABORT(message))
    p = search.parent
    p.output_ids = array("q")
    p.finished_len = 0
    p.finished_reason = FINISH_ABORT(message, status_code, err_type)
    _stream(p, released)


def _after_step(search: KcbsSearch, released: Optional[list]) -> None:
    if search.over():
        _finalize(search)
        _stream(search.parent, released)


def _is_abort(req: Any) -> bool:
    return isinstance(req.finished_reason, FINISH_ABORT)


def filter_outputs(reqs: list) -> list:
    """Hide beam requests from the outputs, start the searches whose prompt prefill finished in
    this batch (step 1 from its top-k, then the beams), and add the requests they release.

    With the overlap scheduler a prefill-only request that finished in one batch shows up again,
    finished, in the next batch's outputs; `search.started` makes it count once."""
    released: list = []
    out = []
    ready: list[tuple[KcbsSearch, list[Top]]] = []
    for req in reqs:
        if kcbs_beam_of(req) is not None:
            continue
        search = kcbs_search_of(req)
        if search is not None and not search.done:
            if req.finished() and not search.started:
                search.started = True
                if _is_abort(req):
                    search.done = True  # sglang aborted it before any beam
                    out.append(req)
                    continue
                top = _top_logprobs(req)
                if top is None:
                    search.done = True
                    req.finished_reason = FINISH_ABORT(
                        f"k-CBS: no top log-probs for request {req.rid}", HTTPStatus.INTERNAL_SERVER_ERROR)
                    out.append(req)
                    continue
                _active[req.rid] = search
                ready.append((search, [top]))
            continue
        out.append(req)
    _advance_all(ready)
    for search, _ in ready:
        if search.over():
            _after_step(search, released)
        else:
            _spawn_beams(search, released)
    return out + released


# ------------------------------------------------------------------------------------------
# the beams inside a forward


_batch: Any = None  # the ScheduleBatch whose forward is running (read by `sample_around`)


def worker_forward_around(original: Callable, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    """AROUND TpModelWorker.forward_batch_generation: let `sample_around` see the batch's
    requests (also when sampling is deferred, as with grammars under the overlap scheduler)."""
    global _batch
    if not _active or batch is None:
        return original(worker, batch, *args, **kwargs)
    _batch = batch
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        _batch = None
    deferred = getattr(result, "delay_sample_func", None)
    if deferred is not None:
        def sample_later() -> Any:
            global _batch
            _batch = batch
            try:
                return deferred()
            finally:
                _batch = None
        result.delay_sample_func = sample_later
    return result


def _beam_groups(batch: Any) -> list[tuple[KcbsSearch, list[int]]]:
    """The searches with beams in this batch, each with the batch row of every beam slot. A
    search whose beams are not all here at one position ends (503): its step cannot be taken."""
    found: dict[int, tuple[KcbsSearch, dict[int, int]]] = {}
    for i, req in enumerate(batch.reqs):
        tag = kcbs_beam_of(req)
        if tag is None or tag[0].done or req.finished():
            continue
        found.setdefault(id(tag[0]), (tag[0], {}))[1][tag[1]] = i
    groups = []
    for search, rows in found.values():
        whole = len(rows) == len(search.beam_reqs)
        if not whole or len({r.kv_committed_len for r in search.beam_reqs}) != 1:
            _abort(search, "k-CBS: the scheduler did not run all beams of this request together",
                   None, HTTPStatus.SERVICE_UNAVAILABLE)
            continue
        groups.append((search, [rows[j] for j in range(len(rows))]))
    return groups


def sample_around(original: Callable, runner: Any, logits_output: Any, forward_batch: Any,
                  *args: Any, **kwargs: Any) -> Any:
    """AROUND ModelRunner.sample: take one k-CBS step for every search whose beams are in this
    batch, then make the sampled tokens of the beam rows the chosen ones and fork the rows."""
    groups = _beam_groups(_batch) if _batch is not None else []
    if not groups:
        return original(runner, logits_output, forward_batch, *args, **kwargs)
    logits = logits_output.next_token_logits
    rows = torch.tensor([i for _, rs in groups for i in rs], device=logits.device)
    width = max(search.k for search, _ in groups)
    # read before sglang samples: sampling may scale the logits in place
    top = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1).topk(width, dim=-1)
    next_ids = original(runner, logits_output, forward_batch, *args, **kwargs)
    vals, ids = top.values.tolist(), top.indices.tolist()
    ready, at = [], 0
    for search, rs in groups:
        ready.append((search, [(vals[at + j], ids[at + j]) for j in range(len(rs))]))
        at += len(rs)
    _advance_all(ready)
    chosen = []
    for search, rs in groups:
        for j in range(len(rs)):
            beam = search.beams[j] if j < len(search.beams) else None
            chosen.append(beam.tokens[-1] if beam is not None and beam.tokens else 0)
    next_ids[rows.to(next_ids.device)] = torch.tensor(chosen, dtype=next_ids.dtype).to(next_ids.device)
    _fork(groups)
    for search, _ in groups:
        _after_step(search, None)
    return next_ids


def _fork(groups: list[tuple[KcbsSearch, list[int]]]) -> None:
    """Record each beam's newest KV slot as the search's, then point each slot's beam positions
    [L, p] at its parent's (searches that just ended keep their rows: no forward follows)."""
    table = _scheduler.req_to_token_pool.req_to_token
    width = table.shape[1]
    flat = table.view(-1)
    newest, src, dst, spans = [], [], [], []
    for search, _ in groups:
        pool = [r.req_pool_idx for r in search.beam_reqs]
        p = search.beam_reqs[0].kv_committed_len - 1
        spans.append(len(pool))
        newest.extend(row * width + p for row in pool)
        if search.over():
            continue
        start = search.prompt_len
        for j, parent in enumerate(search.parents):
            if parent != j:
                src.extend(range(pool[parent] * width + start, pool[parent] * width + p + 1))
                dst.extend(range(pool[j] * width + start, pool[j] * width + p + 1))
    slots = flat[torch.tensor(newest, device=table.device)]
    at = 0
    for (search, _), n in zip(groups, spans):
        search.owned.append(slots[at:at + n])
        at += n
    if dst:
        flat[torch.tensor(dst, device=table.device)] = flat[torch.tensor(src, device=table.device)]


def release_kv_cache_around(original: Callable, req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND mem_cache.common.release_kv_cache: before sglang frees the first beam of a search,
    deal the slots the beams allocated past the prompt back into their rows, each once, so that
    sglang's per-request free releases every slot exactly once. A beam released while its search
    runs (preempted by a retraction) ends the search."""
    tag = kcbs_beam_of(req)
    if tag is None:
        return original(req, tree_cache, *args, **kwargs)
    search = tag[0]
    running = not req.finished()
    if not search.done:
        _abort(search, "k-CBS: a beam request was preempted", None, HTTPStatus.SERVICE_UNAVAILABLE)
    _return_slots(search)
    result = original(req, tree_cache, *args, **kwargs)
    if running:
        req.to_finish = FINISH_ABORT("k-CBS: search ended")  # a retracted beam must not run again
    return result


def _return_slots(search: KcbsSearch) -> None:
    """Deal the recorded slots back into the beams' rows (once: `owned` is emptied, and a search
    that has released a beam is done, so it records no more)."""
    if not search.owned:
        return
    table = _scheduler.req_to_token_pool.req_to_token
    width = table.shape[1]
    steps = len(search.owned)
    start = search.prompt_len
    dst = [r.req_pool_idx * width + start + i for r in search.beam_reqs for i in range(steps)]
    table.view(-1)[torch.tensor(dst, device=table.device)] = torch.stack(search.owned).t().reshape(-1)
    search.owned = []


def add_one_req_around(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND PrefillAdder.add_one_req: the beams of a search enter a batch together. At the
    first beam, check that the whole group fits this batch (request slots, tokens); if not, stop
    adding here, and the group waits for the next batch."""
    tag = kcbs_beam_of(req)
    if tag is None:
        return original(adder, req, *args, **kwargs)
    search = tag[0]
    if search.admitting is not adder:
        if not _group_fits(adder, req, len(search.beam_reqs)):
            return AddReqResult.OTHER
        search.admitting = adder
    return original(adder, req, *args, **kwargs)


def _group_fits(adder: Any, req: Any, k: int) -> bool:
    queued = len(adder.can_run_list)
    limit = getattr(adder, "prefill_max_requests", None)
    if limit is not None and queued + k > limit:
        return False
    sched = _scheduler
    if sched is not None:
        running = len(adder.running_batch.reqs) if adder.running_batch is not None else 0
        if queued + k > sched.get_num_allocatable_reqs(running):
            return False
    extend = max(len(req.full_untruncated_fill_ids) - len(req.prefix_indices), 1)
    need = k * (extend + req.sampling_params.max_new_tokens + adder.page_size)
    if need >= adder.rem_total_tokens or k * extend > adder.rem_input_tokens:
        return False
    return adder.rem_chunk_tokens is None or k * extend <= adder.rem_chunk_tokens


def _queued_beams(scheduler: Any) -> list:
    return [r for r in scheduler.waiting_queue if kcbs_beam_of(r) is not None] if _active else []


def _abort_orphans(scheduler: Any, queued: list, message: str, status_code: Any = None) -> None:
    """End the searches whose queued beam requests sglang removed from the waiting queue."""
    if not queued:
        return
    still = {id(r) for r in scheduler.waiting_queue}
    for r in queued:
        if id(r) not in still:
            search = kcbs_beam_of(r)[0]
            _abort(search, message, None, status_code)


def abort_request_around(original: Callable, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler.abort_request (POST /abort_request, client disconnects, abort_all): the
    k-CBS request has left sglang's queues after its prompt prefill, so sglang alone would only
    drop or cut its current beams; end its search here, by the same rid-prefix rule."""
    queued = _queued_beams(scheduler)
    result = original(scheduler, recv_req, *args, **kwargs)
    if _active:
        rid = recv_req.rid if isinstance(recv_req.rid, str) else ""
        for search in [s for s in _active.values()
                       if recv_req.abort_all or s.parent.rid.startswith(rid)]:
            _abort(search, recv_req.abort_message or "Aborted by AbortReq.", None)
        _abort_orphans(scheduler, queued, "k-CBS beam request aborted")
    return result


def _watch_queue(original: Callable, scheduler: Any, args: tuple, kwargs: dict, message: str) -> Any:
    """Run a scheduler method that may drop queued requests; end the searches of beams it drops."""
    queued = _queued_beams(scheduler)
    result = original(scheduler, *args, **kwargs)
    _abort_orphans(scheduler, queued, message, HTTPStatus.SERVICE_UNAVAILABLE)
    return result


def waiting_timeout_around(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler._abort_on_waiting_timeout: a beam request dropped from the waiting queue
    for waiting too long ends its search (only with SGLANG_REQ_WAITING_TIMEOUT set)."""
    if not _active or envs.SGLANG_REQ_WAITING_TIMEOUT.get() <= 0:
        return original(scheduler, *args, **kwargs)
    return _watch_queue(original, scheduler, args, kwargs,
                        "k-CBS beam request aborted: waiting timeout reached")


def add_request_to_queue_around(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler._add_request_to_queue: with priority scheduling and a queue limit, a new
    request can evict a queued one, possibly a beam request, which then ends its search."""
    if not (_active and getattr(scheduler, "enable_priority_scheduling", False)
            and getattr(scheduler, "max_queued_requests", None) is not None):
        return original(scheduler, *args, **kwargs)
    return _watch_queue(original, scheduler, args, kwargs,
                        "k-CBS beam request aborted: evicted from a full queue")
