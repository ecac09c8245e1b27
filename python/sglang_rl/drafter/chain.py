"""Greedy chain drafting as sglang 0.5.17's EAGLE worker does it with ``topk = 1``.

How sglang feeds the draft model (speculative/eagle_worker_v2.py, eagle_worker_common.py).
Notation: the committed tokens are ``x_0 .. x_m``; ``h_t`` is the target's row for ``x_t``
(the row from which ``x_{t+1}`` was sampled); ``g`` are the draft's output rows.

1. Draft extend. It runs after a prefill, or after a verify step where it covers the
   accepted tokens. For every committed position ``t < m`` the draft gets token ``x_{t+1}``
   (the input ids shifted left by one, with the token the target just sampled at the end),
   row ``h_t``, and position ``t``. Its KV cache therefore holds these teacher-forced
   positions. The output row at the last position, ``g_{m-1}``, gives the first draft token
   ``d_1 = argmax lm_head(g_{m-1})``.
2. Draft decode, ``num_steps - 1`` forwards. Step ``i`` (0-based) runs one position,
   ``m + i`` (``positions = seq_lens``, advanced by one per step), with token ``d_{i+1}`` and
   row ``g_{m-1+i}``: the draft's own previous output. It attends to every cached position
   before it. It gives ``g_{m+i}`` and ``d_{i+2} = argmax lm_head(g_{m+i})``. No forward runs
   after the last token.
3. Verify: the target checks ``x_m, d_1 .. d_k`` and accepts the longest matching prefix.

:func:`greedy_draft_chain` computes the same ``d_1 .. d_k``. It runs full causal forwards
over the committed pairs plus the chain so far instead of keeping a KV cache; in a causal
model that gives the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_rl.drafter.model import EagleDrafter

__all__ = ["DraftChain", "greedy_draft_chain"]


@dataclass(frozen=True)
class DraftChain:
    """``tokens [k]``: the draft tokens ``d_1 .. d_k``; ``rows [k, H]``: the rows
    ``g_{m-1} .. g_{m+k-2}`` whose argmax gave each token."""

    tokens: torch.Tensor
    rows: torch.Tensor


@torch.no_grad()
def greedy_draft_chain(
    model: EagleDrafter, input_ids: torch.Tensor, hidden_states: torch.Tensor, num_steps: int
) -> DraftChain:
    """Propose ``num_steps`` draft tokens after the committed ``input_ids = x_0 .. x_m``.

    ``hidden_states`` are the target's rows ``h_0 .. h_{m-1}`` (one fewer than the tokens:
    the last token's row does not exist until the target has run it). Positions start at 0
    for ``x_0``, as in a request that has no earlier context.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    m = ids.numel() - 1
    if m < 1:
        raise ValueError("need at least two committed tokens (one target row)")
    if rows.shape[0] != m:
        raise ValueError(f"{ids.numel()} tokens need {m} target rows, got {rows.shape[0]}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    was_training = model.training
    model.eval()
    device, dtype = model.fc.weight.device, model.compute_dtype
    seq_ids = ids[1:].to(device)
    seq_rows = rows.to(device, dtype)
    tokens, out_rows = [], []
    for step in range(num_steps):
        positions = torch.arange(seq_ids.numel(), device=device)
        last = model(seq_ids, seq_rows, positions)[-1]
        token = model.logits(last).argmax(dim=-1)
        tokens.append(token)
        out_rows.append(last)
        if step + 1 < num_steps:
            seq_ids = torch.cat((seq_ids, token.reshape(1)))
            seq_rows = torch.cat((seq_rows, last.reshape(1, -1)))
    model.train(was_training)
    return DraftChain(tokens=torch.stack(tokens).cpu(), rows=torch.stack(out_rows).cpu())
