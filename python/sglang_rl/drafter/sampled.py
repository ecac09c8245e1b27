"""Sampled acceptance: what a draft token is worth when the target samples at a temperature.

Under speculative sampling at temperature ``T`` a draft token drawn from the draft's
distribution ``q_T`` is accepted with probability ``sum_x min(p_T(x), q_T(x)) = 1 - TV(p_T, q_T)``
(``p_T``: the target's sampling distribution, softmax of its logits over ``T``). Greedy
verification accepts iff ``argmax q == argmax p``; the greedy objective (soft cross-entropy at
``T = 1``) trains for that. The ``sampled`` objective adds ``tv_weight * (1 - sum min(p_T, q_T))``
per pair, the TV loss, so the drafter is trained for the acceptance RL sampling sees.

sglang 0.5.17's EAGLE verify at ``T > 0`` is "target only": its drafts are the draft's top
tokens (not samples of ``q``) and a chain token ``x`` is accepted with probability ``p_T(x)``.
:func:`acceptance_metrics` reports that number too (``target_only``: ``p_T(argmax q)``), beside
the sampled-draft acceptance (``sampled``) and greedy agreement (``greedy``).

The TV gradient with respect to the draft logits ``z`` is ``q_j 1[q_j < p_j] - q_j sum_{x: q_x < p_x} q_x``
(times ``-1/T`` for the loss): it raises the draft's mass only where it is below the target's.
"""

from __future__ import annotations

import torch

__all__ = ["OBJECTIVES", "acceptance_metrics", "check_objective", "overlap", "tempered_log_probs", "tv_rows"]

OBJECTIVES = ("greedy", "sampled")


def check_objective(objective: str, temperature: float) -> None:
    """Raise ValueError for an unknown objective or a temperature that is not > 0."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def tempered_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / T)`` in float32 over the last dimension."""
    return (logits.float() / temperature).log_softmax(dim=-1)


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` per row: the acceptance probability of a draft sampled from ``q``."""
    return torch.minimum(p, q).sum(dim=-1)


def tv_rows(pred_logits: torch.Tensor, target_probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-row TV loss ``1 - sum min(p, softmax(pred_logits / T))`` ``[M]``.

    ``target_probs [M, K]`` is ``p_T`` on the same ``K`` ids as ``pred_logits`` (it may sum to
    less than 1 when ``p`` has mass outside them; that mass is never accepted)."""
    q = tempered_log_probs(pred_logits, temperature).exp()
    return 1.0 - overlap(target_probs.float(), q)


@torch.no_grad()
def acceptance_metrics(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float,
                       draft_ids: torch.Tensor | None = None) -> dict[str, float]:
    """Mean per-row acceptance of a draft against the target at ``temperature``.

    ``target_logits [M, V]``; ``draft_logits [M, V]``, or ``[M, N]`` over the target ids
    ``draft_ids [N]`` (an EAGLE3 draft vocabulary: the draft puts no mass elsewhere).
    ``sampled``: ``sum min(p_T, q_T)``; ``target_only``: ``p_T(argmax q)`` (sglang's verify);
    ``greedy``: the share of rows where ``argmax q == argmax p``."""
    p = tempered_log_probs(target_logits, temperature).exp()
    q = tempered_log_probs(draft_logits, temperature).exp()
    top = draft_logits.argmax(dim=-1)
    if draft_ids is not None:
        p_on = p[:, draft_ids]
        top = draft_ids[top]
    else:
        p_on = p
    rows = torch.arange(p.shape[0], device=p.device)
    return {
        "sampled": float(overlap(p_on, q).mean()),
        "target_only": float(p[rows, top].mean()),
        "greedy": float((top == target_logits.argmax(dim=-1)).float().mean()),
    }
