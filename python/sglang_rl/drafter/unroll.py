"""Training-time test: unroll the drafter over its own predicted rows, as chained drafting does.

Teacher-forced training (step 1) feeds the drafter the target's true row ``h_t`` at every
position. At serving time only the first draft token comes from such an input: draft step ``j``
(1-based) of a chain that starts after the committed position ``m - 1`` feeds the drafter's own
output row of step ``j - 1`` (see ``chain.py``), and its errors compound along the chain.

Step ``j`` here reproduces, at every position ``t`` at once, the ``j``-th draft step of the
chain whose committed prefix ends at ``m = t - j + 2``:

* input: token ``x_{t+1}`` and the row predicted by step ``j - 1`` at position ``t - 1``;
  tokens stay the true ones, because a draft step only counts when every token before it was
  accepted, i.e. equal to the true one;
* attention: the teacher-forced keys of positions ``<= t - j + 1`` (the draft's KV cache after
  the extend) and, for every step ``k = 2..j``, the step-``k`` key at position ``t - j + k``
  (the chain's own earlier positions); nothing crosses a packed sequence's boundary;
* target: the true next row ``h_{t+1}``; positions whose chain would start before the
  sequence's first pair (``t - start < j - 1``) take no loss.

The fed rows are not detached: the loss of step ``j`` is then exactly the loss of what
serving computes at chain step ``j``, so step ``j - 1`` also learns to emit rows that are good
inputs, not only rows close to ``h``.

The same unroll serves both drafter kinds through :class:`DraftModel`'s pieces: the step-1
feature (EAGLE-1/2: the row ``h_t``; EAGLE3: ``fc(aux_t)``), the feature fed to step ``j``
(the previous step's output ``g``, shifted one position later; first positions keep step 1's
feature) and the layer input built from it. EAGLE3's target at position ``t`` is the token
``x_{t+2}`` at every step (``eagle3_loss.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_rl.drafter.model import DraftModel, segment_bounds

__all__ = ["chain_attention_mask", "unroll_valid", "unrolled_predictions"]


def chain_attention_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``[L, (step + 1) * L]`` mask of step ``step`` (0-based) over the keys of steps
    ``0..step`` laid side by side; True = attend (see the module docstring)."""
    t = torch.arange(length, device=device)
    blocks = [t[None, :] <= (t[:, None] - step)]
    for k in range(1, step + 1):
        blocks.append(t[None, :] == (t[:, None] - step + k))
    return torch.cat(blocks, dim=1)


def unroll_valid(cu_seqlens: torch.Tensor, total: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Float ``[N]``: 1 where step ``step`` (0-based) has a whole chain inside its sequence."""
    out = torch.zeros(total, dtype=torch.float32)
    for a, b in segment_bounds(cu_seqlens, total):
        out[a + step:b] = 1.0
    return out.to(device)


def _shift_rows(pred: torch.Tensor, rows: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """``pred`` moved one position later within each sequence; first positions keep ``rows``."""
    parts = []
    for a, b in bounds:
        parts.append(rows[a:a + 1])
        parts.append(pred[a:b - 1])
    return torch.cat(parts)


def unrolled_predictions(
    model: DraftModel,
    input_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    steps: int,
) -> list[torch.Tensor]:
    """Outputs ``[N, H]`` of steps ``1..steps``; step 1 is ``model(...)`` itself.

    EAGLE-1/2 outputs are predicted rows, EAGLE3 ones the pre-norm ``g`` its logits read."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if len(model.layers) != 1:
        raise ValueError("unrolled training supports one-layer drafters")
    ids = input_ids.reshape(-1)
    n = ids.shape[0]
    bounds = segment_bounds(cu_seqlens, n)
    dtype = model.compute_dtype
    first = model.first_feature(hidden_states.reshape(n, -1).to(dtype))
    embeds = F.embedding(ids, model.embed_tokens).to(dtype)
    cos, sin = model.rotary(position_ids.reshape(-1))
    layer = model.layers[0]
    attn = layer.self_attn
    gqa = attn.n_heads != attn.n_kv
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    preds: list[torch.Tensor] = []
    for step in range(steps):
        feature = first if step == 0 else _shift_rows(preds[-1], first, bounds)
        x, residual = model.layer_input(embeds, feature.to(dtype))
        q, k, v = attn.qkv(x, cos, sin)
        keys.append((k, v))
        parts = []
        for a, b in bounds:
            if step == 0:
                parts.append(F.scaled_dot_product_attention(
                    q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], is_causal=True, enable_gqa=gqa)[0])
                continue
            kk = torch.cat([ks[:, a:b] for ks, _ in keys], dim=1)
            vv = torch.cat([vs[:, a:b] for _, vs in keys], dim=1)
            mask = chain_attention_mask(b - a, step, q.device)
            parts.append(F.scaled_dot_product_attention(
                q[None, :, a:b], kk[None], vv[None], attn_mask=mask, enable_gqa=gqa)[0])
        heads = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        preds.append(layer.finish(residual, attn.out(heads)))
    return preds
