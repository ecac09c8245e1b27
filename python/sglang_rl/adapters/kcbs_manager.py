"""The k-CBS searches of one scheduler process, and a search bound to its sglang request.

`KcbsManager` is created by the scheduler's `__init__` hook and kept on the scheduler (see
`adapters/kcbs.py`, whose hooks drive it); a search joins it when the scheduler queues its
request. It queues a search's beam requests, ends a search with its candidates or with an abort,
and stops its beams. The search itself (beams, steps, selection) is `sglang_rl.kcbs`.
"""

from __future__ import annotations

from array import array
from http import HTTPStatus
from typing import Any, Optional

import torch

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN, Req
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_rl.adapters import transport
from sglang_rl.adapters.request_state import kcbs_beam_of, kcbs_search_of, state_of
from sglang_rl.kcbs.search import BeamSearch, candidate_fields

CANDIDATES_FIELD = "kcbs_candidates"
CHILD_RID_MARK = "::kcbs::"


class KcbsSearch(BeamSearch):
    """A search bound to sglang, from its request's prompt prefill to its release: the k-CBS
    request it answers (held back until the end), the requests that run its beams, the KV slots
    they allocated, and the manager of the scheduler that queued the request."""

    def __init__(self, parent: Any, k: int, steps: int, keep_all: bool) -> None:
        super().__init__(k, steps, keep_all)
        self.parent = parent
        self.manager: Optional[KcbsManager] = None  # set when a scheduler queues the request
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
        """The tokens that end a beam (computed once per search, once the scheduler has given
        the request its tokenizer)."""
        if self._eos is None:
            p = self.parent
            ids = set(p.eos_token_ids or ())
            ids |= set(p.sampling_params.stop_token_ids or ())
            tok = getattr(p, "tokenizer", None)
            if tok is not None and getattr(tok, "eos_token_id", None) is not None:
                ids.add(tok.eos_token_id)
            self._eos = ids
        return self._eos


class KcbsManager:
    """The k-CBS searches of one scheduler: those between their prompt prefill and their end, by
    parent rid (for aborts), and the batch whose forward is running (for the sample hook)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.active: dict[Any, KcbsSearch] = {}
        self.batch: Any = None

    @property
    def table(self) -> torch.Tensor:
        """sglang's req_to_token table, where beam rows are forked."""
        return self.scheduler.req_to_token_pool.req_to_token

    def adopt(self, req: Any) -> None:
        """A request this scheduler queues: if it is a k-CBS request, its search runs here."""
        search = kcbs_search_of(req)
        if search is not None:
            search.manager = self

    def start(self, search: KcbsSearch) -> None:
        """The search's prompt prefill is done: it runs until it ends or is aborted."""
        self.active[search.parent.rid] = search

    def spawn_beams(self, search: KcbsSearch, released: list) -> None:
        """Queue one request per beam slot: prompt + the beam's first token, decoding up to T - 1
        tokens whose choice the sample hook makes. A finished candidate's slot runs as well (its
        rows are ignored) so that the group stays whole."""
        p = search.parent
        sched = self.scheduler
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
                self.abort(search, "k-CBS: the scheduler refused a beam request (waiting queue full?)", released,
                           status_code=HTTPStatus.SERVICE_UNAVAILABLE)
                return

    def after_step(self, search: KcbsSearch, released: Optional[list]) -> None:
        """A search whose last step is done releases its request with the candidates."""
        if search.over():
            self.finish(search)
            self.stream(search.parent, released)

    def finish(self, search: KcbsSearch) -> None:
        """Attach the candidates to the held request, its output being the best candidate."""
        search.done = True
        self.active.pop(search.parent.rid, None)
        p = search.parent
        beams = search.results()
        tok = getattr(p, "tokenizer", None)
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        best = beams[0]
        p.output_ids = array("q", best.tokens)
        p.finished_len = len(best.tokens)
        p.finished_reason = (
            FINISH_MATCHED_TOKEN(matched=best.tokens[-1]) if best.reason == "stop"
            else FINISH_LENGTH(length=len(best.tokens))
        )
        transport.post(p, **{CANDIDATES_FIELD: candidate_fields(beams, decode)})
        self.stop_beams(search, FINISH_LENGTH(length=max(search.step - 1, 0)))

    def abort(self, search: KcbsSearch, message: str, released: Optional[list], status_code: Any = None,
              err_type: Any = None) -> None:
        """End a search without candidates: its beams stop and the held request is released with
        an abort finish reason, into `released` or, outside an output step, streamed at once."""
        if search.done:
            return
        search.done = True
        self.active.pop(search.parent.rid, None)
        self.stop_beams(search, FINISH_ABORT(message))
        p = search.parent
        p.output_ids = array("q")
        p.finished_len = 0
        p.finished_reason = FINISH_ABORT(message, status_code, err_type)
        self.stream(p, released)

    def stop_beams(self, search: KcbsSearch, reason: Any) -> None:
        """Queued beams are dropped (they hold no KV); running ones finish at their next result
        (sglang frees them; their outputs are hidden by the output hook)."""
        sched = self.scheduler
        live = {id(r): r for r in search.beam_reqs if not r.finished()}
        if not live:
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

    def stream(self, p: Any, released: Optional[list]) -> None:
        """Hand a released request to the current output list, or stream it now."""
        if released is not None:
            released.append(p)
        elif not p.finished_output:
            self.scheduler.output_streamer.stream_output([p], p.return_logprob)

    def queued_beams(self) -> list:
        """The beam requests in the waiting queue (none without a running search)."""
        return [r for r in self.scheduler.waiting_queue if kcbs_beam_of(r) is not None] if self.active else []

    def abort_orphans(self, queued: list, message: str, status_code: Any = None) -> None:
        """End the searches whose queued beam requests (`queued`, taken before) sglang removed
        from the waiting queue."""
        if not queued:
            return
        still = {id(r) for r in self.scheduler.waiting_queue}
        for r in queued:
            if id(r) not in still:
                self.abort(kcbs_beam_of(r)[0], message, None, status_code)
