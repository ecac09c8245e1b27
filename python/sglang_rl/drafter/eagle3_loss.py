"""EAGLE3 drafter loss: cross-entropy of the draft logits against the next sampled token.

EAGLE3 has no row regression: its drafter predicts tokens, over its own draft vocabulary. The
training pairs are the EAGLE-1/2 ones (``build_eagle_batch``): pair ``i`` feeds the token
``x_{t+1}`` and the aux row ``aux_t``; its label is the token the target sampled from row
``t + 1``, i.e. the next pair's input id ``x_{t+2}``. So:

* the last pair of each packed segment (``cu_seqlens``) has no label and takes no loss;
* a pair's weight is ``loss_mask[i] * loss_mask[i + 1]`` (both tokens are response tokens
  with rows);
* the label, a target id, becomes a draft id through the drafter's ``t2d``/``d2t`` mapping; a
  label outside the draft vocabulary takes no loss (the drafter cannot propose it).

``loss = sum(w * CE(logits, label)) / sum(w)``; the prediction's argmax, mapped back to target
ids, gives ``top1_agreement``. Full-vocabulary logits over many rows are computed in
checkpointed row chunks (:data:`~sglang_rl.drafter.loss.FULL_VOCAB_CHUNK`), as in ``loss.py``.

With ``target_probs`` (the ``sampled`` objective: the target's ``p_T`` of the labelled token's
position, on the draft vocabulary's target ids) the loss adds ``tv_weight * (1 - sum min(p_T, q_T))``
(``sampled.py``); the draft puts no mass outside its vocabulary, so ``p_T``'s mass there is never
accepted and ``p_T`` is not renormalised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sglang_rl.drafter.eagle3_model import Eagle3Drafter
from sglang_rl.drafter.loss import FULL_VOCAB_CHUNK, LossOutput
from sglang_rl.drafter.model import segment_bounds
from sglang_rl.drafter.sampled import tv_rows

__all__ = ["eagle3_labels", "eagle3_loss"]


@torch.no_grad()
def eagle3_labels(model: Eagle3Drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target-id labels [N], draft-id labels [N], weights [N] float32)`` of packed pairs.

    Pairs without a label (last of a segment, or out of the draft vocabulary) have weight 0,
    target label -1 and draft label 0 (any valid index; it is never read)."""
    ids = input_ids.reshape(-1).to(torch.long)
    mask = loss_mask.reshape(-1).to(torch.float32)
    n = ids.shape[0]
    labels = torch.full_like(ids, -1)
    weights = torch.zeros(n, dtype=torch.float32, device=mask.device)
    for a, b in segment_bounds(cu_seqlens, n):
        labels[a:b - 1] = ids[a + 1:b]
        weights[a:b - 1] = mask[a:b - 1] * mask[a + 1:b]
    has = labels >= 0
    draft = torch.full_like(ids, -1)
    draft[has] = model.to_draft_ids(labels[has].to(model.d2t.device)).to(ids.device)
    weights = weights * (draft >= 0).to(weights)
    labels = torch.where(draft >= 0, labels, torch.full_like(labels, -1))
    return labels, draft.clamp(min=0), weights


def _ce_rows(model: Eagle3Drafter, g: torch.Tensor, draft: torch.Tensor, target_probs: torch.Tensor | None = None,
             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy ``[m]``, TV term ``[m]`` (zeros without ``target_probs``) and the argmax draft id."""
    logits = model.logits(g).float()
    tv = logits.new_zeros(logits.shape[0]) if target_probs is None else tv_rows(logits, target_probs, temperature)
    return F.cross_entropy(logits, draft, reduction="none"), tv, logits.detach().argmax(dim=-1)


def eagle3_loss(model: Eagle3Drafter, g: torch.Tensor, draft_labels: torch.Tensor,
                weights: torch.Tensor, target_probs: torch.Tensor | None = None, temperature: float = 1.0,
                tv_weight: float = 1.0) -> LossOutput:
    """Masked mean cross-entropy of ``model.logits(g)`` (``g [N, H]``) against ``draft_labels [N]``.

    ``prob_loss`` is the cross-entropy, ``value_loss`` 0.0 (there is no regression term);
    ``pred_top1`` holds the argmax as *target* ids of the rows with positive weight.
    ``target_probs [M, N_draft]``: ``p_T`` of the rows with positive weight (adds the TV term)."""
    g = g.reshape(-1, g.shape[-1])
    w_all = weights.reshape(-1).to(torch.float32)
    if not w_all.shape[0] == g.shape[0] == draft_labels.reshape(-1).shape[0]:
        raise ValueError(f"g {tuple(g.shape)}, labels {tuple(draft_labels.shape)}, weights {tuple(w_all.shape)} disagree")
    keep = torch.nonzero(w_all > 0).flatten()
    if keep.numel() == 0:
        return LossOutput(loss=g.sum() * 0.0, value_loss=0.0, prob_loss=0.0, num_tokens=0.0, pred_top1=None)
    w, rows, draft = w_all[keep], g[keep], draft_labels.reshape(-1)[keep].to(g.device)
    if target_probs is not None and target_probs.shape[0] != keep.numel():
        raise ValueError(f"target_probs cover {target_probs.shape[0]} rows, the weights keep {keep.numel()}")
    if rows.shape[0] <= FULL_VOCAB_CHUNK or not rows.requires_grad:
        ce, tv, top = _ce_rows(model, rows, draft, target_probs, temperature)
    else:
        c = FULL_VOCAB_CHUNK
        parts = [checkpoint(_ce_rows, model, rows[a:a + c], draft[a:a + c],
                            None if target_probs is None else target_probs[a:a + c], temperature,
                            use_reentrant=False) for a in range(0, rows.shape[0], c)]
        ce, tv, top = (torch.cat([p[i] for p in parts]) for i in range(3))
    total = float(w.sum())
    ce_loss = (w * ce).sum() / total
    tv_loss = (w * tv).sum() / total
    loss = ce_loss if target_probs is None else ce_loss + tv_weight * tv_loss
    return LossOutput(loss=loss, value_loss=0.0, prob_loss=float(ce_loss.detach()), num_tokens=total,
                      pred_top1=model.to_target_ids(top), tv_loss=float(tv_loss.detach()))
