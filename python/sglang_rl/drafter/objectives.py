"""What a :class:`~sglang_rl.drafter.trainer.DrafterTrainer` step minimises, per drafter kind.

The trainer (optimizer, batching, unrolling, metrics) is the same for every drafter; an
objective supplies the two parts that differ, chosen from the model by :func:`objective_for`:

* ``targets``: the target side of a prepared batch, computed once per batch: the tensor the
  loss compares against, the per-pair loss weights, and :class:`SoftTargets` whose ``top1``
  holds, for each pair with positive weight, the token id ``top1_agreement`` compares with;
* ``step_loss``: the loss of one (possibly unrolled) step's output and its ``top1_agreement``.

EAGLE-1/2 (:class:`EagleObjective`): ``target`` is the next target row, the loss is
``eagle_loss`` (regression plus soft cross-entropy through the frozen head), ``top1`` the
target head's argmax of the true row. EAGLE3 (:class:`Eagle3Objective`): ``target`` is the
draft-id label of each pair, the weights also drop pairs without a label, the loss is the
cross-entropy of ``eagle3_loss``, ``top1`` the label's target id.

The ``sampled`` objective (``EagleLossConfig.objective``, ``sampled.py``) adds the TV term at the
config's temperature to both. EAGLE-1/2 reads ``p_T`` from the target head over the true next
row it already has; EAGLE3 rows are the target's aux rows, which do not give ``p_T``: its sampled
objective needs rows laid out ``[aux | final]`` (the target's final row after the aux rows; the
drafter reads the aux part) and the target's LM head.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from sglang_rl.drafter.eagle3_loss import eagle3_labels, eagle3_loss
from sglang_rl.drafter.eagle3_model import Eagle3Drafter
from sglang_rl.drafter.loss import EagleLossConfig, LossOutput, SoftTargets, eagle_loss, soft_targets
from sglang_rl.drafter.model import DraftModel, EagleDrafter
from sglang_rl.drafter.prepared_batch import PreparedBatch


__all__ = ["Eagle3Objective", "EagleObjective", "objective_for"]

Targets = tuple[torch.Tensor, torch.Tensor, SoftTargets]


def _agreement(pred_top1: torch.Tensor | None, top1: torch.Tensor) -> float:
    return float((pred_top1 == top1).float().mean()) if pred_top1 is not None else float("nan")


class EagleObjective:
    """EAGLE-1/2: ``eagle_loss`` against the next target row (``loss.py``)."""

    def __init__(self, model: EagleDrafter, loss: EagleLossConfig, full_vocab_metrics: bool = True) -> None:
        self.model = model
        self.loss_config = loss
        self.full_vocab_metrics = full_vocab_metrics

    def targets(self, batch: Mapping[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
                cu_seqlens: torch.Tensor) -> Targets:
        """``(next rows [N, H], loss_mask, soft targets of the masked rows)``."""
        target = batch["target"].reshape(ids.shape[0], -1).to(ids.device, self.model.compute_dtype)
        keep = torch.nonzero(mask > 0).flatten()
        return target, mask, soft_targets(target[keep], self.model.head_weight, self.loss_config)

    def step_loss(self, pred: torch.Tensor, batch: PreparedBatch, mask: torch.Tensor,
                  soft: SoftTargets) -> tuple[LossOutput, float]:
        out = eagle_loss(pred, batch.target, mask, self.model.head_weight, self.loss_config, soft)
        pred_top1 = out.pred_top1
        if pred_top1 is None and out.num_tokens > 0 and (self.full_vocab_metrics or self.loss_config.prob_weight == 0):
            with torch.no_grad():
                keep = torch.nonzero(mask > 0).flatten()
                pred_top1 = self.model.logits(pred.detach()[keep]).argmax(dim=-1)
        return out, _agreement(pred_top1, soft.top1)


class Eagle3Objective:
    """EAGLE3: cross-entropy against the next sampled token, in the draft vocabulary
    (``eagle3_loss.py``). The EAGLE-1/2 loss options (weights, soft vocabulary) do not apply;
    ``objective``, ``temperature`` and ``tv_weight`` do (the sampled one needs ``target_head``)."""

    def __init__(self, model: Eagle3Drafter, loss: EagleLossConfig = EagleLossConfig(),
                 target_head: torch.Tensor | None = None) -> None:
        self.model = model
        self.loss_config = loss
        self.temperature = loss.tv_temperature
        if self.temperature is not None and target_head is None:
            raise ValueError("the sampled objective for EAGLE3 needs the target's LM head (target_head)")
        self.target_head = target_head

    def targets(self, batch: Mapping[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
                cu_seqlens: torch.Tensor) -> Targets:
        """``(draft-id labels [N], label-aware weights [N], label target ids of weighted pairs and,
        under the sampled objective, their ``p_T`` on the draft vocabulary)``."""
        labels, draft, weights = eagle3_labels(self.model, ids, mask, cu_seqlens)
        keep = weights > 0
        if self.temperature is None:
            return draft, weights, SoftTargets(top1=labels[keep])
        return draft, weights, SoftTargets(top1=labels[keep], probs=self._target_probs(batch, ids.shape[0], keep))

    @torch.no_grad()
    def _target_probs(self, batch: Mapping[str, torch.Tensor], n: int, keep: torch.Tensor) -> torch.Tensor:
        """``p_T`` ``[M, N_draft]`` of the weighted pairs from the final part of their next rows."""
        width, hidden = self.model.feature_width, self.model.config.hidden_size
        rows = batch["target"].reshape(n, -1)
        if rows.shape[1] != width + hidden:
            raise ValueError(f"the sampled objective for EAGLE3 needs rows [aux | final] of width {width + hidden}, "
                             f"got {rows.shape[1]}")
        head = self.target_head.to(keep.device)
        final = rows[keep.to(rows.device)][:, width:].to(keep.device, head.dtype)
        p = (F.linear(final, head).float() / self.temperature).softmax(dim=-1)
        hot = self.model.to_target_ids(torch.arange(self.model.draft_vocab_size, device=self.model.d2t.device))
        return p[:, hot.to(p.device)]

    def step_loss(self, pred: torch.Tensor, batch: PreparedBatch, mask: torch.Tensor,
                  soft: SoftTargets) -> tuple[LossOutput, float]:
        out = eagle3_loss(self.model, pred, batch.target, mask, soft.probs, self.temperature or 1.0,
                          self.loss_config.tv_weight)
        return out, _agreement(out.pred_top1, soft.top1)


def objective_for(model: DraftModel, loss: EagleLossConfig = EagleLossConfig(), full_vocab_metrics: bool = True,
                  target_head: torch.Tensor | None = None) -> EagleObjective | Eagle3Objective:
    """The objective that trains ``model``: EAGLE3 for an :class:`Eagle3Drafter`, else EAGLE-1/2
    (``target_head``: the target's LM head, needed by EAGLE3's sampled objective only)."""
    if isinstance(model, Eagle3Drafter):
        return Eagle3Objective(model, loss, target_head)
    return EagleObjective(model, loss, full_vocab_metrics)
