"""Checked swaps: a co-trained drafter replaces the served one only if it predicts the target at
least as well on rollouts that neither has trained on.

Each round holds back its newest ``samples`` fresh rollouts from training. After the round the
trained drafter and the served one (a copy of its trainable weights) are scored on them with the
target's current embedding and head: teacher-forced top-1 agreement with the target, chained over
the trained draft steps (the sum over k of the product of steps 1..k's agreements, the expected
number of accepted drafts of a chain as long as ``unroll_steps``). A round that scores lower is
held: the server keeps the drafter it serves, and training goes on from the new weights. Held-back
rollouts with no pair to score (a prompt without a response) cannot judge: the round is loaded.
"""

from __future__ import annotations

from typing import Any

import torch


def chain_score(metrics: dict) -> float:
    """Expected accepted drafts from per-step agreements (``top1_agreement``, then
    ``top1_agreement_step2``, ...) as :meth:`DrafterTrainer.evaluate` reports them."""
    agreements = [metrics["top1_agreement"]]
    step = 2
    while f"top1_agreement_step{step}" in metrics:
        agreements.append(metrics[f"top1_agreement_step{step}"])
        step += 1
    score, reach = 0.0, 1.0
    for a in agreements:
        reach *= a
        score += reach
    return score


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        if n in weights:
            p.copy_(weights[n])


class SwapCheck:
    """The served drafter's weights and the rule that decides whether a round replaces them."""

    def __init__(self, model: torch.nn.Module, samples: int) -> None:
        self.samples = samples
        self.served = _trainable(model)  # the drafter the server loaded at start

    def hold_back(self, fresh: list) -> tuple[list, list]:
        """``(train on, held back)``: the newest ``samples`` of the round's fresh rollouts are held."""
        return fresh[:-self.samples], fresh[-self.samples:]

    def decide(self, trainer: Any, held: list) -> dict:
        """Score the trained and the served drafter on ``held``; keep the trained one as the
        served one if it scores at least as well. The model ends with the trained weights."""
        trained_weights = _trainable(trainer.model)
        evaluated = trainer.evaluate(held)
        if not evaluated["num_loss_pairs"]:  # nothing to judge by (e.g. held-back prompts without a response)
            self.served = trained_weights
            return {"samples": len(held), "served": None, "trained": None, "swapped": True}
        trained = chain_score(evaluated)
        _load(trainer.model, self.served)
        served = chain_score(trainer.evaluate(held))
        _load(trainer.model, trained_weights)
        swapped = trained >= served
        if swapped:
            self.served = trained_weights
        return {"samples": len(held), "served": served, "trained": trained, "swapped": swapped}
