"""One k-CBS step for many searches at once, from each live beam's top-k (log-prob, token) pairs.

An engine hands over only the k most likely tokens of each beam (what it computes anyway), not
the full vocabulary; `advance` lays them out so that `kcbs_step` picks exactly what it would pick
over the full rows.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from sglang_rl.kcbs.search import Beam, BeamSearch
from sglang_rl.kcbs.step import kcbs_step

Top = Optional[tuple[list[float], list[int]]]
"""One beam's top-k as (log-probs, token ids), in any order; None for a beam without one."""

_NO_TOKEN = 2**62  # column padding: sorts after every real token id


def advance(ready: list[tuple[BeamSearch, list[Top]]]) -> None:
    """One k-CBS step over the beams of every search in `ready`, in one `kcbs_step` call.

    The step gets each live beam's top-k pairs as a compact `[beams, width]` matrix whose columns
    are sorted by token id, so that `kcbs_step`'s tie rule (lower token id first) holds exactly as
    over the full vocabulary; columns are mapped back to token ids afterwards. Missing columns are
    -inf. Sets each search's new beams and their parents, and counts the step."""
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
