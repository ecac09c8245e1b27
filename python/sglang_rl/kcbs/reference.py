"""Plain, unbatched k-CBS reference on a Hugging Face causal LM (a full forward per beam per step).

It follows the paper's reference: every step re-runs prompt + beam through the model, takes the
beam's k most likely next tokens and renormalises their log-probs inside that set. It is slow on
purpose and serves as the oracle for the batched `kcbs_step`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Candidate:
    """One k-CBS result: generated tokens (EOS included when it stopped) and its log-probs."""

    token_ids: list[int]
    logprob: float
    raw_logprob: float
    finish_reason: str | None = None


def next_token_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Float32 log-softmax (temperature 1) of the next token after `token_ids`."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        ids = torch.tensor([token_ids], device=device)
        logits = model(ids, logits_to_keep=1, use_cache=False).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def top_k_tokens(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token, log-prob) pairs, by log-prob descending then token id ascending."""
    order = torch.sort(logprobs, descending=True, stable=True).indices[:k]
    return [(int(t), float(logprobs[t])) for t in order]


def kcbs_reference(
    model: torch.nn.Module,
    prompt_ids: list[int],
    k: int,
    steps: int,
    final_prune: bool,
    eos_token_ids: set[int],
) -> list[Candidate]:
    """Run k-CBS for at most `steps` tokens and return the candidates, best first.

    Ties are broken by score descending, then parent beam position, then token rank. With
    final_prune=False the last step keeps all (<= k^2) candidates instead of the k best.
    """
    beams = [Candidate([], 0.0, 0.0)]
    for step in range(steps):
        if all(beam.finish_reason is not None for beam in beams):
            break
        last = step == steps - 1
        pool: list[tuple[float, int, int, Candidate]] = []
        for parent, beam in enumerate(beams):
            if beam.finish_reason is not None:
                pool.append((beam.logprob, parent, 0, beam))
                continue
            top = top_k_tokens(next_token_logprobs(model, prompt_ids + beam.token_ids), k)
            log_mass = float(torch.logsumexp(torch.tensor([lp for _, lp in top], dtype=torch.float64), 0))
            for rank, (token, lp) in enumerate(top):
                reason = "stop" if token in eos_token_ids else ("length" if last else None)
                child = Candidate(
                    beam.token_ids + [token], beam.logprob + (lp - log_mass), beam.raw_logprob + lp, reason
                )
                pool.append((child.logprob, parent, rank, child))
        pool.sort(key=lambda item: (-item[0], item[1], item[2]))
        keep = len(pool) if last and not final_prune else k
        beams = [item[3] for item in pool[:keep]]
    return beams
