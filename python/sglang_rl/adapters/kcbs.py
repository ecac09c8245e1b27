"""Scheduler side of k-CBS: the hooks through which sglang runs the searches. Beams are k
long-lived decode requests per search, forked in place between steps, so every step is one batched
decode (CUDA graphs included) for the live beams of all k-CBS requests, next to ordinary requests.

Life of a search:
1. The k-CBS request itself is prefilled once (prefill-only, top-k log-probs of its last
   position); its output is held back. Its top-k give step 1 (`sglang_rl.kcbs.advance`).
2. Beam slot j becomes a request `prompt + [token_j]` (ignore_eos, no stop rules, at most T - 1
   new tokens). The radix cache serves the prompt's KV by index, so the k beams cost one extend
   of one token each; they are admitted into a batch together or not at all.
3. In every forward that holds the beams, `sample_around` reads the beams' log-softmax rows at
   temperature 1 before sglang samples, runs the step, and then, on the forward stream:
   - writes each slot's chosen token as that slot's next token (the overlap scheduler feeds it
     to the next decode through its future map);
   - forks in place: slot j's `req_to_token` row over the beam positions [L, p] becomes its
     parent slot's row (index sharing, no KV copy; `sglang_rl.kcbs.rows`).
4. The slots a search's beams allocated past the prompt (one per beam per step) are owned by the
   search: before sglang frees the first beam, `release_kv_cache_around` deals them back into the
   rows, each exactly once, so sglang's own free path releases every slot exactly once; the beams
   never insert into the radix cache.
5. After step T (or when every candidate has finished) the beams are told to finish and the held
   request is released with the best candidate as its output and every candidate attached.

The state lives on the scheduler: its `KcbsManager` (`adapters/kcbs_manager.py`). A search joins
it when the scheduler queues its request; hooks given a beam request reach it through the beam's
search, and the forward hooks through the model runner, which the manager is also kept on.

The same code runs on every TP rank: the selection is a function of the logits, which every rank
holds, so all ranks fork alike.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Callable, Optional

import torch

from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.schedule_policy import AddReqResult

from sglang_rl.adapters.kcbs_manager import CHILD_RID_MARK, KcbsManager, KcbsSearch
from sglang_rl.adapters.request_state import kcbs_beam_of, kcbs_search_of
from sglang_rl.kcbs.advance import Top, advance
from sglang_rl.kcbs.rows import BeamRows, fork_rows, return_slots

ATTR = "_sglang_rl_kcbs"


def manager_of(owner: Any) -> Optional[KcbsManager]:
    """The k-CBS manager kept on a scheduler or on its model runner (None on any other object)."""
    return getattr(owner, ATTR, None)


def scheduler_init_after(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: the scheduler owns this process's k-CBS searches; its model
    runner, which the forward hooks are given instead of the scheduler, keeps the same manager."""
    manager = KcbsManager(scheduler)
    setattr(scheduler, ATTR, manager)
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    if runner is not None:
        setattr(runner, ATTR, manager)


def is_child_rid(rid: Any) -> bool:
    """Beam requests carry a marker in their rid (set before Req.__init__ hooks run)."""
    return isinstance(rid, str) and CHILD_RID_MARK in rid


def parent_state(options: dict) -> Optional[tuple[int, int, bool]]:
    """(k, T, keep_all) of a request that asked for k-CBS, else None."""
    if "kcbs_k" not in options:
        return None
    return int(options["kcbs_k"]), int(options["kcbs_steps"]), bool(options.get("kcbs_keep_all"))


def _top_logprobs(req: Any) -> Top:
    """The top-k (vals, ids) of the position after the request's last token (None if missing)."""
    vals = req.logprob.output_top_logprobs_val if req.return_logprob else None
    idxs = req.logprob.output_top_logprobs_idx if req.return_logprob else None
    if not vals or not idxs or not vals[-1]:
        return None
    return list(vals[-1]), list(idxs[-1])


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
                search.manager.start(search)
                ready.append((search, [top]))
            continue
        out.append(req)
    advance(ready)
    for search, _ in ready:
        if search.over():
            search.manager.after_step(search, released)
        else:
            search.manager.spawn_beams(search, released)
    return out + released


# ------------------------------------------------------------------------------------------
# the beams inside a forward


def worker_forward_around(original: Callable, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    """AROUND TpModelWorker.forward_batch_generation: let `sample_around` see the batch's
    requests (also when sampling is deferred, as with grammars under the overlap scheduler)."""
    manager = manager_of(worker.model_runner)
    if manager is None or not manager.active or batch is None:
        return original(worker, batch, *args, **kwargs)
    manager.batch = batch
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        manager.batch = None
    deferred = getattr(result, "delay_sample_func", None)
    if deferred is not None:
        def sample_later() -> Any:
            manager.batch = batch
            try:
                return deferred()
            finally:
                manager.batch = None
        result.delay_sample_func = sample_later
    return result


def _beam_groups(manager: KcbsManager, batch: Any) -> list[tuple[KcbsSearch, list[int]]]:
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
            manager.abort(search, "k-CBS: the scheduler did not run all beams of this request together",
                          None, HTTPStatus.SERVICE_UNAVAILABLE)
            continue
        groups.append((search, [rows[j] for j in range(len(rows))]))
    return groups


def sample_around(original: Callable, runner: Any, logits_output: Any, forward_batch: Any,
                  *args: Any, **kwargs: Any) -> Any:
    """AROUND ModelRunner.sample: take one k-CBS step for every search whose beams are in this
    batch, then make the sampled tokens of the beam rows the chosen ones and fork the rows."""
    manager = manager_of(runner)
    batch = manager.batch if manager is not None else None
    groups = _beam_groups(manager, batch) if batch is not None else []
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
    advance(ready)
    chosen = []
    for search, rs in groups:
        for j in range(len(rs)):
            beam = search.beams[j] if j < len(search.beams) else None
            chosen.append(beam.tokens[-1] if beam is not None and beam.tokens else 0)
    next_ids[rows.to(next_ids.device)] = torch.tensor(chosen, dtype=next_ids.dtype).to(next_ids.device)
    _fork(manager, groups)
    for search, _ in groups:
        manager.after_step(search, None)
    return next_ids


def _fork(manager: KcbsManager, groups: list[tuple[KcbsSearch, list[int]]]) -> None:
    """Record each beam's newest KV slot as the search's, then point each slot's beam positions
    [L, p] at its parent's (searches that just ended keep their rows: no forward follows)."""
    plans = [BeamRows([r.req_pool_idx for r in search.beam_reqs], search.prompt_len,
                      search.beam_reqs[0].kv_committed_len - 1, None if search.over() else search.parents)
             for search, _ in groups]
    for (search, _), slots in zip(groups, fork_rows(manager.table, plans)):
        search.owned.append(slots)


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
        search.manager.abort(search, "k-CBS: a beam request was preempted", None, HTTPStatus.SERVICE_UNAVAILABLE)
    if search.owned:
        # once: `owned` is emptied, and a search that has released a beam is done, so it records no more
        return_slots(search.manager.table, [r.req_pool_idx for r in search.beam_reqs], search.prompt_len,
                     search.owned)
        search.owned = []
    result = original(req, tree_cache, *args, **kwargs)
    if running:
        req.to_finish = FINISH_ABORT("k-CBS: search ended")  # a retracted beam must not run again
    return result


# ------------------------------------------------------------------------------------------
# admission and the scheduler's queue


def add_one_req_around(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND PrefillAdder.add_one_req: the beams of a search enter a batch together. At the
    first beam, check that the whole group fits this batch (request slots, tokens); if not, stop
    adding here, and the group waits for the next batch."""
    tag = kcbs_beam_of(req)
    if tag is None:
        return original(adder, req, *args, **kwargs)
    search = tag[0]
    if search.admitting is not adder:
        if not _group_fits(search.manager.scheduler, adder, req, len(search.beam_reqs)):
            return AddReqResult.OTHER
        search.admitting = adder
    return original(adder, req, *args, **kwargs)


def _group_fits(scheduler: Any, adder: Any, req: Any, k: int) -> bool:
    queued = len(adder.can_run_list)
    limit = getattr(adder, "prefill_max_requests", None)
    if limit is not None and queued + k > limit:
        return False
    running = len(adder.running_batch.reqs) if adder.running_batch is not None else 0
    if queued + k > scheduler.get_num_allocatable_reqs(running):
        return False
    extend = max(len(req.full_untruncated_fill_ids) - len(req.prefix_indices), 1)
    need = k * (extend + req.sampling_params.max_new_tokens + adder.page_size)
    if need >= adder.rem_total_tokens or k * extend > adder.rem_input_tokens:
        return False
    return adder.rem_chunk_tokens is None or k * extend <= adder.rem_chunk_tokens


def abort_request_around(original: Callable, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler.abort_request (POST /abort_request, client disconnects, abort_all): the
    k-CBS request has left sglang's queues after its prompt prefill, so sglang alone would only
    drop or cut its current beams; end its search here, by the same rid-prefix rule."""
    manager = manager_of(scheduler)
    if manager is None:
        return original(scheduler, recv_req, *args, **kwargs)
    queued = manager.queued_beams()
    result = original(scheduler, recv_req, *args, **kwargs)
    if manager.active:
        rid = recv_req.rid if isinstance(recv_req.rid, str) else ""
        for search in [s for s in manager.active.values()
                       if recv_req.abort_all or s.parent.rid.startswith(rid)]:
            manager.abort(search, recv_req.abort_message or "Aborted by AbortReq.", None)
        manager.abort_orphans(queued, "k-CBS beam request aborted")
    return result


def _watch_queue(original: Callable, manager: KcbsManager, args: tuple, kwargs: dict, message: str) -> Any:
    """Run a scheduler method that may drop queued requests; end the searches of beams it drops."""
    queued = manager.queued_beams()
    result = original(manager.scheduler, *args, **kwargs)
    manager.abort_orphans(queued, message, HTTPStatus.SERVICE_UNAVAILABLE)
    return result


def waiting_timeout_around(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler._abort_on_waiting_timeout: a beam request dropped from the waiting queue
    for waiting too long ends its search (only with SGLANG_REQ_WAITING_TIMEOUT set)."""
    manager = manager_of(scheduler)
    if manager is None or not manager.active or envs.SGLANG_REQ_WAITING_TIMEOUT.get() <= 0:
        return original(scheduler, *args, **kwargs)
    return _watch_queue(original, manager, args, kwargs, "k-CBS beam request aborted: waiting timeout reached")


def add_request_to_queue_around(original: Callable, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler._add_request_to_queue: a k-CBS request joins this scheduler's searches.
    With priority scheduling and a queue limit, a new request can evict a queued one, possibly a
    beam request, which then ends its search."""
    manager = manager_of(scheduler)
    if manager is None:
        return original(scheduler, req, *args, **kwargs)
    manager.adopt(req)
    if not (manager.active and getattr(scheduler, "enable_priority_scheduling", False)
            and getattr(scheduler, "max_queued_requests", None) is not None):
        return original(scheduler, req, *args, **kwargs)
    return _watch_queue(original, manager, (req, *args), kwargs,
                        "k-CBS beam request aborted: evicted from a full queue")
