"""EAGLE-1/2 drafter loss: feature regression plus soft cross-entropy through the frozen head.

For every pair with ``loss_mask > 0`` (weight ``w``), with ``p`` the predicted next row and
``f`` the true next row::

    value = SmoothL1(p, f).mean(over H)
    prob  = -sum_v softmax(lm_head(f))_v * log_softmax(lm_head(p))_v
    loss  = value_weight * sum(w * value) / sum(w) + prob_weight * sum(w * prob) / sum(w)

Default weights: ``value_weight = 1.0``, ``prob_weight = 0.1``. This is the EAGLE paper's
setting, the one verl-SpeCo uses for EAGLE-1/2. The paper's reason: the cross-entropy
(in nats, starting near ``ln V``, about 10.8 for a 49k vocabulary) is numerically about an
order of magnitude larger than the SmoothL1 on rows, so 0.1 puts both on a similar scale
and regression keeps its share. That matters here because the predicted row is the next
draft step's input: every draft token after the first depends on the rows being right, not
only on the first token. FastRL's 0.5/0.5 weighs the token term 10x more relative to the
regression; pass it through :class:`EagleLossConfig` to use it.

Masked pairs (``loss_mask == 0``) are dropped before anything is computed, so they add
nothing to the loss or its gradient; they still act as attention context in the forward.

Reduced vocabulary for the soft term (the full ``M x V`` head product and its backward pass
dominate CPU cost):

* ``soft_topk = N``: per row, the N tokens with the largest *target* logits. Both
  distributions are renormalised over those N tokens (softmax of the N logits). The
  prediction's logits are computed only for each row's own N ids (gathered head rows),
  not the full vocabulary. Rows whose target is peaked lose almost nothing; what the
  prediction puts outside the target's top-N is ignored.
* ``vocab_subset = ids``: one fixed id set (for example the tokens seen in the rollouts).
  Both distributions are renormalised over it. The loss is exact when the target puts
  (nearly) all its mass inside the set.

The regression term always uses the full row. Full-vocabulary soft loss on many rows is
computed in checkpointed row chunks (:data:`FULL_VOCAB_CHUNK`).

``objective = "sampled"`` adds ``tv_weight * sum(w * tv) / sum(w)`` with
``tv = 1 - sum_x min(p_T(x), q_T(x))``, ``p_T`` / ``q_T`` the target's / the prediction's softmax at
``temperature`` over the same vocabulary as the soft term (``sampled.py``: the draft's expected
acceptance under speculative sampling). ``"greedy"`` (the default) is the loss above unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sglang_rl.drafter.sampled import check_objective, tempered_log_probs, tv_rows

__all__ = [
    "FULL_VOCAB_CHUNK",
    "TOPK_GATHER_ELEMENTS",
    "EagleLossConfig",
    "LossOutput",
    "SoftTargets",
    "eagle_loss",
    "soft_targets",
]

# Full-vocabulary soft loss over more rows than this is computed in row chunks whose
# ``[rows, V]`` logits are recomputed in the backward pass (activation checkpointing), so
# memory stays at one chunk's logits instead of ``M x V`` (about 0.8 GB per 4096 rows of a
# 49k vocabulary) at the cost of one more head product.
FULL_VOCAB_CHUNK = 1024
# The top-N soft loss gathers ``[rows, N, H]`` head rows; above this many elements it works
# in checkpointed row chunks the same way.
TOPK_GATHER_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class EagleLossConfig:
    """Weights and vocabulary options of :func:`eagle_loss` (see the module docstring)."""

    value_weight: float = 1.0
    prob_weight: float = 0.1
    soft_topk: int | None = None
    vocab_subset: Sequence[int] | torch.Tensor | None = None
    smooth_l1_beta: float = 1.0
    objective: str = "greedy"
    temperature: float = 1.0
    tv_weight: float = 1.0

    @property
    def tv_temperature(self) -> float | None:
        """The TV term's temperature; None under the greedy objective (no TV term)."""
        return self.temperature if self.objective == "sampled" else None

    def __post_init__(self) -> None:
        check_objective(self.objective, self.temperature)
        if self.tv_weight < 0:
            raise ValueError("tv_weight must be non-negative")
        if self.soft_topk is not None and self.vocab_subset is not None:
            raise ValueError("soft_topk and vocab_subset are alternatives; set at most one")
        if self.soft_topk is not None and self.soft_topk < 1:
            raise ValueError(f"soft_topk must be >= 1, got {self.soft_topk}")
        if self.value_weight < 0 or self.prob_weight < 0:
            raise ValueError("loss weights must be non-negative")


@dataclass(frozen=True)
class SoftTargets:
    """Target-side quantities of the masked rows; fixed for a batch, so they can be cached.

    ``top1 [M]``: argmax of ``lm_head(f)`` over the full vocabulary.
    ``token_ids [M, N]`` / ``probs [M, N]``: the top-N mode's ids and renormalised probs.
    ``subset [S]`` / ``probs [M, S]``: the fixed-subset mode.
    Full vocabulary: ``probs`` is None, recomputed per call (``M x V`` would be large).
    """

    top1: torch.Tensor
    probs: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    subset: torch.Tensor | None = None


@dataclass(frozen=True)
class LossOutput:
    """The differentiable ``loss`` and its parts as floats, for logging."""

    loss: torch.Tensor
    value_loss: float
    prob_loss: float
    num_tokens: float
    pred_top1: torch.Tensor | None
    tv_loss: float = 0.0


def _subset_tensor(ids: Sequence[int] | torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    subset = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1).unique()
    if subset.numel() == 0 or int(subset.min()) < 0 or int(subset.max()) >= vocab:
        raise ValueError(f"vocab_subset must be non-empty ids in [0, {vocab})")
    return subset


@torch.no_grad()
def soft_targets(target_rows: torch.Tensor, head: torch.Tensor, config: EagleLossConfig) -> SoftTargets:
    """Compute :class:`SoftTargets` for already-masked target rows ``[M, H]``."""
    rows = target_rows.to(head.dtype)
    logits = F.linear(rows, head)
    top1 = logits.argmax(dim=-1)
    if config.soft_topk is not None:
        k = min(config.soft_topk, head.shape[0])
        values, ids = logits.topk(k, dim=-1)
        return SoftTargets(top1=top1, probs=values.float().softmax(dim=-1), token_ids=ids)
    if config.vocab_subset is not None:
        subset = _subset_tensor(config.vocab_subset, head.shape[0], head.device)
        return SoftTargets(top1=top1, probs=logits[:, subset].float().softmax(dim=-1), subset=subset)
    return SoftTargets(top1=top1)


def _tv(logits: torch.Tensor, target_logp: torch.Tensor, temperature: float | None) -> torch.Tensor:
    """Per-row TV term at ``temperature`` (zeros without one); ``target_logp`` at T = 1."""
    if temperature is None:
        return logits.new_zeros(logits.shape[0])
    return tv_rows(logits, tempered_log_probs(target_logp, temperature).exp(), temperature)


def _prob_loss(
    pred: torch.Tensor, target: torch.Tensor, head: torch.Tensor, soft: SoftTargets, temperature: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row soft cross-entropy ``[M]``, per-row TV term ``[M]`` (zeros without a
    ``temperature``) and, in full-vocab mode, the prediction's argmax."""
    pred = pred.to(head.dtype)
    if soft.token_ids is not None:
        n = soft.token_ids.shape[1]
        chunk = max(1, TOPK_GATHER_ELEMENTS // (n * head.shape[1]))
        if pred.shape[0] <= chunk or not pred.requires_grad:
            return (*_topk_rows(pred, head, soft.token_ids, soft.probs, temperature), None)
        parts = [
            checkpoint(_topk_rows, pred[a : a + chunk], head, soft.token_ids[a : a + chunk],
                       soft.probs[a : a + chunk], temperature, use_reentrant=False)
            for a in range(0, pred.shape[0], chunk)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), None
    if soft.subset is not None:
        logits = F.linear(pred, head[soft.subset]).float()
        ce = -(soft.probs * logits.log_softmax(dim=-1)).sum(dim=-1)
        return ce, _tv(logits, soft.probs.log(), temperature), None
    target = target.to(head.dtype)
    if pred.shape[0] <= FULL_VOCAB_CHUNK or not pred.requires_grad:
        return _full_vocab_rows(pred, target, head, temperature)
    parts = [checkpoint(_full_vocab_rows, pred[a:a + FULL_VOCAB_CHUNK], target[a:a + FULL_VOCAB_CHUNK], head,
                        temperature, use_reentrant=False) for a in range(0, pred.shape[0], FULL_VOCAB_CHUNK)]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def _topk_rows(pred: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
               temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row soft cross-entropy and TV term over each row's own ids ``[m, N]`` (gathered head rows)."""
    logits = torch.bmm(head[ids], pred.unsqueeze(-1)).squeeze(-1).float()
    return -(probs * logits.log_softmax(dim=-1)).sum(dim=-1), _tv(logits, probs.log(), temperature)


def _full_vocab_rows(pred: torch.Tensor, target: torch.Tensor, head: torch.Tensor,
                     temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row soft cross-entropy and TV term over the whole vocabulary, and the prediction's argmax."""
    logits = F.linear(pred, head).float()
    with torch.no_grad():
        target_logits = F.linear(target, head).float()
        probs = target_logits.softmax(dim=-1)
    ce = -(probs * logits.log_softmax(dim=-1)).sum(dim=-1)
    return ce, _tv(logits, target_logits, temperature), logits.detach().argmax(dim=-1)


def eagle_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    loss_mask: torch.Tensor,
    head: torch.Tensor,
    config: EagleLossConfig = EagleLossConfig(),
    soft: SoftTargets | None = None,
) -> LossOutput:
    """The EAGLE loss over pairs ``pred/target [N, H]`` weighted by ``loss_mask [N]``.

    ``head [V, H]`` is the frozen LM head; ``soft`` (from :func:`soft_targets` on the masked
    target rows, in row order) skips recomputing the target side.
    """
    pred = pred.reshape(-1, pred.shape[-1])
    target = target.reshape(-1, target.shape[-1])
    weights = loss_mask.reshape(-1).to(torch.float32)
    if not (pred.shape == target.shape and weights.shape[0] == pred.shape[0]):
        shapes = f"pred {tuple(pred.shape)}, target {tuple(target.shape)}, mask {tuple(weights.shape)}"
        raise ValueError(f"{shapes} disagree")
    keep = torch.nonzero(weights > 0).flatten()
    total = float(weights[keep].sum())
    if keep.numel() == 0:
        zero = pred.sum() * 0.0
        return LossOutput(loss=zero, value_loss=0.0, prob_loss=0.0, num_tokens=0.0, pred_top1=None)
    w = weights[keep]
    p = pred[keep]
    f = target[keep].to(pred.dtype)
    value = F.smooth_l1_loss(p.float(), f.float(), reduction="none", beta=config.smooth_l1_beta).mean(dim=-1)
    value_loss = (w * value).sum() / total
    if soft is None:
        soft = soft_targets(f, head, config)
    if soft.top1.shape[0] != keep.numel():
        raise ValueError(f"soft targets cover {soft.top1.shape[0]} rows, the mask keeps {keep.numel()}")
    pred_top1 = None
    tv_loss = prob_loss = value_loss.new_zeros(())
    temperature = config.tv_temperature
    if config.prob_weight > 0 or temperature is not None:
        prob, tv, pred_top1 = _prob_loss(p, f, head, soft, temperature)
        prob_loss = (w * prob).sum() / total
        tv_loss = (w * tv).sum() / total
    loss = config.value_weight * value_loss + config.prob_weight * prob_loss
    if temperature is not None:
        loss = loss + config.tv_weight * tv_loss
    return LossOutput(
        loss=loss,
        value_loss=float(value_loss.detach()),
        prob_loss=float(prob_loss.detach()),
        num_tokens=total,
        pred_top1=pred_top1,
        tv_loss=float(tv_loss.detach()),
    )
