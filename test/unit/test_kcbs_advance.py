"""`sglang_rl.kcbs.advance`: one k-CBS step for several searches from their beams' top-k pairs
(what an engine computes anyway) picks what the dense per-search `kcbs_step` picks."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_rl.kcbs import Beam, BeamSearch, advance, kcbs_step

VOCAB = 16


class EosSearch(BeamSearch):
    """A search whose beams end at token 15."""

    def eos_ids(self) -> set[int]:
        return {15}


def _dense_step(search_list, dense_rows):
    """What one search's step gives from full-vocabulary log-probs."""
    out = []
    for search, rows in zip(search_list, dense_rows):
        n = len(search.beams)
        sel = kcbs_step(
            rows, torch.zeros(n, dtype=torch.long),
            torch.tensor([b.score for b in search.beams], dtype=torch.float64),
            torch.tensor([b.raw for b in search.beams], dtype=torch.float64),
            torch.tensor([b.finished for b in search.beams]),
            torch.tensor([search.k]), torch.tensor([search.keep_all and search.step + 1 >= search.steps]),
        )
        out.append([(p, t, round(sc, 9), round(r, 9), f) for p, t, sc, r, f in zip(
            sel.parent_beam.tolist(), sel.token.tolist(), sel.score.tolist(), sel.raw.tolist(),
            sel.finished.tolist())])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batched_compact_step_equals_dense_step_per_search(seed):
    """`advance` feeds kcbs_step only sglang's top-k pairs, for several searches at once, in
    whatever order sglang lists tied tokens; it must pick what the dense per-search step picks
    (ties: lower token id first)."""
    rng = random.Random(seed)
    searches, dense, tops_all = [], [], []
    for r in range(4):
        k = rng.choice([1, 2, 3, 4])
        search = EosSearch(k, 3, keep_all=rng.random() < 0.5)
        search.step = rng.choice([0, 2])
        n = rng.randint(1, k)
        search.beams = [Beam([rng.randrange(VOCAB)], -rng.random(), -2 * rng.random(),
                             rng.random() < 0.3, "length") for _ in range(n)]
        # few distinct values: many ties, also across the k-th boundary
        rows = torch.log_softmax(torch.tensor([[float(rng.randint(0, 3)) for _ in range(VOCAB)]
                                               for _ in range(n)], dtype=torch.float64), dim=-1)
        tops = []
        for b in range(n):
            order = sorted(range(VOCAB), key=lambda t: (-rows[b, t].item(), t))
            kth = rows[b, order[k - 1]].item()
            chosen = [t for t in order if rows[b, t].item() > kth]
            chosen += [t for t in order if rows[b, t].item() == kth][: k - len(chosen)]
            rng.shuffle(chosen)  # sglang's own order among its top-k is not the tie rule
            tops.append(([rows[b, t].item() for t in chosen], chosen))
        searches.append(search)
        dense.append(rows)
        tops_all.append(tops)
    expected = _dense_step(searches, dense)
    before = [list(s.beams) for s in searches]
    advance(list(zip(searches, tops_all)))
    for search, old, exp in zip(searches, before, expected):
        got = [(b.tokens, round(b.score, 9), round(b.raw, 9), b.finished) for b in search.beams]
        want = [(old[p].tokens if f else old[p].tokens + [t], sc, r, f or (t in search.eos_ids()))
                for p, t, sc, r, f in exp]
        assert got == want
