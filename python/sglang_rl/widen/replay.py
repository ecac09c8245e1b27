"""Acceptance of a (target, drafter) pair on held-out text, replaying greedy chain speculation.

Under greedy verification, chain step ``j`` only counts when drafts ``1..j-1`` were accepted, i.e.
equal to the target's tokens, so the draft it proposes is the drafter's step-``j`` output on the
true tokens: what :func:`~sglang_rl.drafter.unroll.unrolled_predictions` computes at every position
at once. :func:`draft_tokens` takes those drafts; :func:`replay_histogram` then walks the answer as
sglang's EAGLE worker does (``steps`` drafts per verify step, the accepted prefix plus the target's
own token committed) and counts accepted drafts per verify step: the histogram sglang reports as
``spec_correct_drafts_histogram``, read by :mod:`sglang_rl.drafter.acceptance`.

Target features come from a plain transformers forward: post-norm final rows for EAGLE-1/2,
concatenated outputs of the aux layers for EAGLE3 (sglang captures the input of layer ``id + 1``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_rl.drafter.acceptance import merge_histograms, position_accept_rates, tokens_per_step
from sglang_rl.drafter.model import DraftModel
from sglang_rl.drafter.unroll import unrolled_predictions

__all__ = ["acceptance", "draft_tokens", "replay_histogram", "target_features"]


@torch.no_grad()
def target_features(model, ids: torch.Tensor, aux_layer_ids: Sequence[int] | None = None) -> torch.Tensor:
    """``[L, H]`` post-norm rows of a transformers Llama over ``ids [L]`` (the rows an EAGLE-1/2
    draft reads), or with ``aux_layer_ids`` the ``[L, n * H]`` outputs of those layers (EAGLE3)."""
    out = model.model(ids.reshape(1, -1), output_hidden_states=aux_layer_ids is not None)
    if aux_layer_ids is None:
        return out.last_hidden_state[0]
    return torch.cat([out.hidden_states[i + 1][0] for i in aux_layer_ids], dim=-1)


@torch.no_grad()
def draft_tokens(drafter: DraftModel, ids: torch.Tensor, features: torch.Tensor, steps: int,
                 start: int = 0) -> torch.Tensor:
    """``[steps, T]`` target ids the drafter proposes at step ``j`` from position ``t`` (input token
    ``ids[t + 1]``, feature ``features[t]``), for ``T = len(ids) - 1``; positions before ``start``
    are not read (-1)."""
    ids = ids.reshape(-1)
    n = ids.numel() - 1
    drafter.eval()
    preds = unrolled_predictions(drafter, ids[1:], features[:n].to(drafter.compute_dtype), torch.arange(n),
                                 torch.tensor([0, n]), steps)
    out = torch.full((steps, n), -1, dtype=torch.long)
    for j, pred in enumerate(preds):
        top = drafter.logits(pred[start:]).argmax(-1)
        out[j, start:] = drafter.to_target_ids(top) if hasattr(drafter, "to_target_ids") else top
    return out


def replay_histogram(drafts: torch.Tensor, ids: torch.Tensor, prompt_len: int) -> list[int]:
    """Accepted drafts per verify step over the answer ``ids[prompt_len:]`` (entry ``k``: steps that
    accepted ``k``). The first answer token comes from the prefill; each verify step then drafts
    ``steps`` tokens after the last committed one and commits the accepted prefix and one more.
    Steps whose chain would run past the answer's end are not counted."""
    steps, n = drafts.shape
    ids = ids.reshape(-1)
    hist = [0] * (steps + 1)
    m = prompt_len  # x_0 .. x_m committed
    while m + steps <= n:
        a = 0
        while a < steps and int(drafts[a, m + a - 1]) == int(ids[m + a + 1]):
            a += 1
        hist[a] += 1
        m += a + 1
    return hist


def acceptance(histograms: Sequence[Sequence[int]], steps: int) -> dict:
    """Tokens per verify step and accept rate per draft position of summed histograms."""
    total = merge_histograms(histograms)
    return {"histogram": total, "tokens_per_step": tokens_per_step(total),
            "accept_rates": position_accept_rates(total, steps)}
