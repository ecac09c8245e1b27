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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sglang_rl.drafter.eagle3_model import Eagle3Drafter
from sglang_rl.drafter.loss import FULL_VOCAB_CHUNK, LossOutput
from sglang_rl.drafter.model import segment_bounds

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


def _ce_rows(model: Eagle3Drafter, g: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy ``[m]`` and the argmax draft id ``[m]``."""
    logits = model.logits(g).float()
    return F.cross_entropy(logits, draft, reduction="none"), logits.detach().argmax(dim=-1)


def eagle3_loss(model: Eagle3Drafter, g: torch.Tensor, draft_labels: torch.Tensor,
                weights: torch.Tensor) -> LossOutput:
    """Masked mean cross-entropy of ``model.logits(g)`` (``g [N, H]``) against ``draft_labels [N]``.

    ``prob_loss`` is the cross-entropy, ``value_loss`` 0.0 (there is no regression term);
    ``pred_top1`` holds the argmax as *target* ids of the rows with positive weight."""
    g = g.reshape(-1, g.shape[-1])
    w_all = weights.reshape(-1).to(torch.float32)
    if not w_all.shape[0] == g.shape[0] == draft_labels.reshape(-1).shape[0]:
        raise ValueError(f"g {tuple(g.shape)}, labels {tuple(draft_labels.shape)}, weights {tuple(w_all.shape)} disagree")
    keep = torch.nonzero(w_all > 0).flatten()
    if keep.numel() == 0:
        return LossOutput(loss=g.sum() * 0.0, value_loss=0.0, prob_loss=0.0, num_tokens=0.0, pred_top1=None)
    w, rows, draft = w_all[keep], g[keep], draft_labels.reshape(-1)[keep].to(g.device)
    if rows.shape[0] <= FULL_VOCAB_CHUNK or not rows.requires_grad:
        ce, top = _ce_rows(model, rows, draft)
    else:
        parts = [checkpoint(_ce_rows, model, rows[a:a + FULL_VOCAB_CHUNK], draft[a:a + FULL_VOCAB_CHUNK],
                            use_reentrant=False) for a in range(0, rows.shape[0], FULL_VOCAB_CHUNK)]
        ce, top = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    total = float(w.sum())
    loss = (w * ce).sum() / total
    return LossOutput(loss=loss, value_loss=0.0, prob_loss=float(loss.detach()), num_tokens=total,
                      pred_top1=model.to_target_ids(top))
