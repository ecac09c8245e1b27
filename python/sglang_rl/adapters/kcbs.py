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
from typing import Any, Optional

import torch

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN, Req

from sglang_rl.adapters import transport
from sglang_rl.kcbs import kcbs_step

PARENT_ATTR = "_sglang_rl_kcbs"
CHILD_ATTR = "_sglang_rl_kcbs_child"
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
        self.pending: dict[int, Optional[tuple[list[float], list[int]]]] = {}
        self.done = False

    def eos_ids(self) -> set[int]:
        p = self.parent
        ids = set(p.eos_token_ids or ())
        ids |= set(p.sampling_params.stop_token_ids or ())
        tok = getattr(p, "tokenizer", None)
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(tok.eos_token_id)
        return ids


CHILD_RID_MARK = "::kcbs::"


def is_child_rid(rid: Any) -> bool:
    """Beam requests carry a marker in their rid (set before Req.__init__ hooks run)."""
    return isinstance(rid, str) and CHILD_RID_MARK in rid


def parent_state(options: dict) -> Optional[tuple[int, int, bool]]:
    if "kcbs_k" not in options:
        return None
    return int(options["kcbs_k"]), int(options["kcbs_steps"]), bool(options.get("kcbs_keep_all"))


def _top_logprobs(req: Any) -> tuple[list[float], list[int]]:
    vals = req.logprob.output_top_logprobs_val
    idxs = req.logprob.output_top_logprobs_idx
    if not vals:
        raise RuntimeError(f"k-CBS: no top log-probs for request {req.rid}")
    return list(vals[-1]), list(idxs[-1])


def _advance(search: KcbsSearch, tops: list[Optional[tuple[list[float], list[int]]]]) -> None:
    """One k-CBS step over the current beams given each live beam's top-k (vals, ids)."""
    vocab = search.parent.vocab_size or (max(i for t in tops if t for i in t[1]) + 1)
    n = len(search.beams)
    dense = torch.full((n, vocab), -math.inf, dtype=torch.float64)
    for b, top in enumerate(tops):
        if top is not None:
            dense[b, torch.tensor(top[1])] = torch.tensor(top[0], dtype=torch.float64)
    last = search.step + 1 >= search.steps
    sel = kcbs_step(
        dense,
        torch.zeros(n, dtype=torch.long),
        torch.tensor([b.score for b in search.beams], dtype=torch.float64),
        torch.tensor([b.raw for b in search.beams], dtype=torch.float64),
        torch.tensor([b.finished for b in search.beams]),
        torch.tensor([search.k]),
        torch.tensor([search.keep_all and last]),
    )
    eos = search.eos_ids()
    new = []
    for parent, token, score, raw, carried in zip(
        sel.parent_beam.tolist(), sel.token.tolist(), sel.score.tolist(), sel.raw.tolist(), sel.finished.tolist()
    ):
        base = search.beams[parent]
        if carried:
            new.append(Beam(base.tokens, score, raw, True, base.reason))
        else:
            stop = token in eos
            new.append(Beam(base.tokens + [token], score, raw, stop, "stop" if stop else "length"))
    search.beams = new
    search.step += 1


def _spawn_children(search: KcbsSearch) -> None:
    p = search.parent
    sched = _scheduler
    search.pending = {}
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
        setattr(child, CHILD_ATTR, (search, b))
        search.pending[b] = None
        sched.init_req_max_new_tokens(child)
        sched._add_request_to_queue(child)


def _finalize(search: KcbsSearch) -> None:
    """Release the held request: best candidate as its output, all candidates attached."""
    search.done = True
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


def _all_finished(search: KcbsSearch) -> bool:
    return all(b.finished for b in search.beams)


def _next(search: KcbsSearch, released: list) -> None:
    if search.step >= search.steps or _all_finished(search):
        _finalize(search)
        released.append(search.parent)
    else:
        _spawn_children(search)


def filter_outputs(reqs: list) -> list:
    """Drive the searches whose requests finished in this batch; return the outputs to stream
    (children removed, held requests removed, completed requests added)."""
    released: list = []
    out = []
    touched: list[KcbsSearch] = []
    for req in reqs:
        child = getattr(req, CHILD_ATTR, None)
        if child is not None:
            if req.finished():
                search, b = child
                search.pending[b] = _top_logprobs(req)
                touched.append(search)
            continue
        search = getattr(req, PARENT_ATTR, None)
        if search is not None and not search.done:
            if req.finished() and search.step == 0 and not search.pending:
                top = _top_logprobs(req)
                _advance(search, [top])
                _next(search, released)
            continue
        out.append(req)
    for search in dict.fromkeys(touched):
        if search.done or any(v is None for v in search.pending.values()):
            continue
        tops = [search.pending.get(b) for b in range(len(search.beams))]
        _advance(search, tops)
        _next(search, released)
    return out + released
