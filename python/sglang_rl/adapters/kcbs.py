"""Scheduler side of k-CBS: beams as prefill-only child requests that share KV through the radix
cache, one batched extend per step for the live beams of all k-CBS requests.

The k-CBS request itself is prefilled once (prefill-only, top-k log-probs of its last position)
and its output is held back. Each step turns the surviving candidates into child requests
`prompt + beam tokens` (prefill-only, top-k log-probs): the radix cache serves each child its
parent's KV by index with reference counts, so only the newest token of each beam is computed,
and all children of a step are queued together. When all children of a request's step have
finished, `kcbs_step` (the engine-agnostic core) selects the next beams. Children never reach the
tokenizer; when the search ends the held request is released with the best candidate as its
ordinary output and every candidate in `kcbs_candidates`. The same code runs on every TP rank,
so all ranks schedule the same children.
"""

from __future__ import annotations

import copy
import math
from array import array
from http import HTTPStatus
from typing import Any, Callable, Optional

import torch

from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN, Req

from sglang_rl.adapters import transport
from sglang_rl.kcbs import kcbs_step

PARENT_ATTR = "_sglang_rl_kcbs"
CHILD_ATTR = "_sglang_rl_kcbs_child"
CONSUMED_ATTR = "_sglang_rl_kcbs_consumed"
CANDIDATES_FIELD = "kcbs_candidates"

_scheduler: Any = None


def scheduler_init_after(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: children are queued through the scheduler of this process."""
    global _scheduler
    _scheduler = scheduler


class Beam:
    __slots__ = ("tokens", "score", "raw", "finished", "reason")

    def __init__(self, tokens: list[int], score: float, raw: float, finished: bool, reason: str) -> None:
        self.tokens, self.score, self.raw, self.finished, self.reason = tokens, score, raw, finished, reason


class KcbsSearch:
    """The state of one k-CBS request between scheduler steps."""

    def __init__(self, parent: Any, k: int, steps: int, keep_all: bool) -> None:
        self.parent = parent
        self.k = k
        self.steps = steps
        self.keep_all = keep_all
        self.step = 0
        self.beams: list[Beam] = [Beam([], 0.0, 0.0, False, "length")]
        # beam index -> (vals, ids) of its child of the current step, None while it runs
        self.pending: dict[int, Optional[tuple[list[float], list[int]]]] = {}
        # beam index -> the child request of the current step
        self.children: dict[int, Any] = {}
        self.started = False
        self.done = False
        self.aborted = False
        self._eos: Optional[set[int]] = None

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


# Searches between their first step and their end, by parent rid (for aborts).
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

    The step gets only what sglang returned: each live beam's top-k (log-prob, token id) pairs,
    as a compact `[beams, width]` matrix whose columns are sorted by token id, so that
    `kcbs_step`'s tie rule (lower token id first) holds exactly as over the full vocabulary;
    columns are mapped back to token ids afterwards. Missing columns are -inf."""
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
        new = []
        for i in range(*sel.rows(r).indices(n_sel)):
            base = search.beams[parents[i] - firsts[r]]
            if carried[i]:
                new.append(Beam(base.tokens, scores[i], raws[i], True, base.reason))
            else:
                stop = tokens[i] in eos
                new.append(Beam(base.tokens + [tokens[i]], scores[i], raws[i], stop,
                                "stop" if stop else "length"))
        search.beams = new
        search.step += 1


def _spawn_children(search: KcbsSearch, released: list) -> None:
    p = search.parent
    sched = _scheduler
    search.pending = {}
    search.children = {}
    for b, beam in enumerate(search.beams):
        if beam.finished:
            continue
        ids = array("q", list(p.origin_input_ids) + beam.tokens)
        sp = copy.copy(p.sampling_params)
        sp.max_new_tokens = 0
        sp.custom_params = None
        child = Req(
            f"{p.rid}{CHILD_RID_MARK}{search.step}::{b}", "", ids, sp,
            return_logprob=True, top_logprobs_num=search.k, stream=False,
            eos_token_ids=p.eos_token_ids, vocab_size=p.vocab_size,
        )
        child.tokenizer = getattr(p, "tokenizer", None)
        child.logprob_start_len = len(ids)
        setattr(child, CHILD_ATTR, (search, search.step, b))
        search.pending[b] = None
        search.children[b] = child
        sched.init_req_max_new_tokens(child)
        sched._add_request_to_queue(child)
        queue = sched.waiting_queue
        local = getattr(getattr(sched, "disaggregation_mode", None), "name", "NULL") == "NULL"
        if local and (not queue or queue[-1] is not child):
            # refused by the scheduler (queue limit, priority rules): the search cannot go on
            _abort(search, "k-CBS: the scheduler refused a beam request (waiting queue full?)", released,
                   status_code=HTTPStatus.SERVICE_UNAVAILABLE)
            return


def _finalize(search: KcbsSearch) -> None:
    """Release the held request: best candidate as its output, all candidates attached."""
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


def _abort(search: KcbsSearch, message: str, released: Optional[list], status_code: Any = None,
           err_type: Any = None) -> None:
    """End a search without candidates: its queued beam requests are dropped (they hold no KV),
    the ones already in a batch are marked to finish (sglang frees their KV as for any finished
    request; their outputs are dropped by `filter_outputs`), and the held request is released with
    an abort finish reason, into `released` or, outside an output step, streamed at once."""
    if search.done:
        return
    search.done = True
    search.aborted = True
    _active.pop(search.parent.rid, None)
    sched = _scheduler
    live = {id(c): c for c in search.children.values() if not c.finished()}
    if live and sched is not None:
        queue = sched.waiting_queue
        dropped = [r for r in queue if id(r) in live]
        if dropped:
            queue[:] = [r for r in queue if id(r) not in live]
            for r in dropped:
                live.pop(id(r))
                if getattr(sched, "enable_hicache_storage", False):
                    sched.tree_cache.release_aborted_request(r.rid)
        for c in live.values():
            c.to_finish = FINISH_ABORT(message)
    p = search.parent
    p.output_ids = array("q")
    p.finished_len = 0
    p.finished_reason = FINISH_ABORT(message, status_code, err_type)
    if released is not None:
        released.append(p)
    elif sched is not None and not p.finished_output:
        sched.output_streamer.stream_output([p], p.return_logprob)


def _all_finished(search: KcbsSearch) -> bool:
    return all(b.finished for b in search.beams)


def _next(search: KcbsSearch, released: list) -> None:
    if search.step >= search.steps or _all_finished(search):
        _finalize(search)
        released.append(search.parent)
    else:
        _spawn_children(search, released)


def _is_abort(req: Any) -> bool:
    return isinstance(req.finished_reason, FINISH_ABORT)


def _child_aborted(search: KcbsSearch, req: Any, released: list) -> None:
    reason = req.finished_reason
    _abort(search, f"k-CBS beam request aborted: {reason.message}", released,
           getattr(reason, "status_code", None), getattr(reason, "err_type", None))


def filter_outputs(reqs: list) -> list:
    """Drive the searches whose requests finished in this batch; return the outputs to stream
    (children removed, held requests removed, completed or aborted requests added).

    A child is read once, when it finishes, and only if it is the child of its search's current
    step: with the overlap scheduler a request that finished in a prefill batch was already merged
    into the next (decode) batch and shows up, finished, in that batch's outputs too, one step
    later; reading it again there would feed last step's log-probs into this step."""
    released: list = []
    out = []
    touched: list[KcbsSearch] = []
    ready: list[tuple[KcbsSearch, list[Top]]] = []
    for req in reqs:
        child = getattr(req, CHILD_ATTR, None)
        if child is not None:
            search, step, b = child
            if not req.finished() or getattr(req, CONSUMED_ATTR, False):
                continue
            setattr(req, CONSUMED_ATTR, True)
            if search.done or step != search.step or search.children.get(b) is not req:
                continue  # a beam of an aborted search, dropped
            if _is_abort(req):
                _child_aborted(search, req, released)
                continue
            top = _top_logprobs(req)
            if top is None:
                _abort(search, f"k-CBS: no top log-probs for beam request {req.rid}", released,
                       HTTPStatus.INTERNAL_SERVER_ERROR)
                continue
            search.pending[b] = top
            touched.append(search)
            continue
        search = getattr(req, PARENT_ATTR, None)
        if search is not None and not search.done:
            if req.finished() and not search.started:
                search.started = True
                if _is_abort(req):
                    search.done = search.aborted = True  # sglang aborted it before any beam
                    out.append(req)
                    continue
                top = _top_logprobs(req)
                if top is None:
                    search.done = search.aborted = True
                    req.finished_reason = FINISH_ABORT(
                        f"k-CBS: no top log-probs for request {req.rid}", HTTPStatus.INTERNAL_SERVER_ERROR)
                    out.append(req)
                    continue
                _active[req.rid] = search
                ready.append((search, [top]))
            continue
        out.append(req)
    for search in dict.fromkeys(touched):
        if search.done or any(v is None for v in search.pending.values()):
            continue
        ready.append((search, [search.pending.get(b) for b in range(len(search.beams))]))
    _advance_all(ready)
    for search, _ in ready:
        _next(search, released)
    return out + released


def _queued_beams(scheduler: Any) -> list:
    return [r for r in scheduler.waiting_queue if hasattr(r, CHILD_ATTR)] if _active else []


def _abort_orphans(scheduler: Any, queued: list, message: str, status_code: Any = None) -> None:
    """End the searches whose queued beam requests sglang removed from the waiting queue."""
    if not queued:
        return
    still = {id(r) for r in scheduler.waiting_queue}
    for r in queued:
        if id(r) not in still:
            search = getattr(r, CHILD_ATTR)[0]
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
