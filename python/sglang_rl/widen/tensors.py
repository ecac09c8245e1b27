"""Widen one tensor: place a small weight's entries at their wide rows and columns, scaled.

Scales are applied in float64 to the small tensor's values and rounded once to the output dtype,
so a power-of-two scale gives exactly the small value times it, in every dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_rl.widen.shape import HeadMap, HiddenLayout

__all__ = ["DecoderLayerMap", "place", "widen_embedding", "widen_norm"]

Rows = Sequence[tuple[torch.Tensor, float]]


def place(small: torch.Tensor, shape: tuple[int, ...], rows: Rows, cols: torch.Tensor | None,
          dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of ``shape`` holding ``scale * small`` at ``[rows, cols]`` for every
    ``(rows, scale)``; ``cols`` None for a vector."""
    out = torch.zeros(shape, dtype=dtype)
    src = small.to(torch.float64)
    for idx, scale in rows:
        val = (src * scale).to(dtype)
        if cols is None:
            out[idx] = val
        else:
            out[idx[:, None], cols[None, :]] = val
    return out


def widen_norm(weight: torch.Tensor, layout: HiddenLayout, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm weight: the real dims times the layout's norm scale, zero elsewhere (copies included:
    nothing reads them)."""
    return place(weight, (layout.wide,), [(layout.real(), layout.norm_scale)], None, dtype)


def widen_embedding(weight: torch.Tensor, layout: HiddenLayout, dtype: torch.dtype) -> torch.Tensor:
    """``[V, h]`` -> ``[V, H]``: each row's real dims and its copies (a tied LM head reads the
    real dims only, through the final norm's zero weight on the copies)."""
    vocab = weight.shape[0]
    out = torch.zeros((vocab, layout.wide), dtype=dtype)
    src = weight.to(torch.float64)
    for idx, scale in layout.rows():
        out[:, idx] = (src * scale).to(dtype)
    return out


class DecoderLayerMap:
    """Widens the tensors of one Llama decoder layer (attention + MLP + norms).

    ``out_layout`` says where the layer writes (o_proj / down_proj rows); attention and MLP read the
    real dims of their (normed) input, or ``in_cols`` for a wider input (EAGLE3 reads ``2H``)."""

    def __init__(self, heads: HeadMap, out_layout: HiddenLayout, dtype: torch.dtype,
                 in_cols: torch.Tensor | None = None, in_width: int | None = None) -> None:
        self.heads, self.layout, self.dtype = heads, out_layout, dtype
        self.in_cols = out_layout.real() if in_cols is None else in_cols
        self.in_width = out_layout.wide if in_width is None else in_width

    def __call__(self, name: str, small: torch.Tensor) -> torch.Tensor:
        """The wide tensor of the layer tensor ``name`` (``self_attn.q_proj.weight``, ...)."""
        wide, kind = self.heads.wide, name.rsplit(".", 2)[-2]
        q = wide.num_attention_heads * wide.head_dim
        kv = wide.num_key_value_heads * wide.head_dim
        if kind == "q_proj":
            return place(small, (q, self.in_width), [(self.heads.q_rows(), self.heads.q_scale)], self.in_cols,
                         self.dtype)
        if kind in ("k_proj", "v_proj"):
            return place(small, (kv, self.in_width), [(self.heads.kv_rows(), 1.0)], self.in_cols, self.dtype)
        if kind == "o_proj":
            return place(small, (self.layout.wide, q), self.layout.rows(), self.heads.q_rows(), self.dtype)
        if kind in ("gate_proj", "up_proj"):
            rows = [(torch.arange(small.shape[0]), 1.0)]
            return place(small, (wide.intermediate_size, self.layout.wide), rows, self.layout.real(), self.dtype)
        if kind == "down_proj":
            return place(small, (self.layout.wide, wide.intermediate_size), self.layout.rows(),
                         torch.arange(small.shape[1]), self.dtype)
        if name.endswith("norm.weight"):
            return widen_norm(small, self.layout, self.dtype)
        raise KeyError(f"no widening rule for layer tensor {name!r}")

    def empty_layer(self, names: Sequence[str], norm: torch.Tensor) -> dict[str, torch.Tensor]:
        """A layer that passes the stream through: zero projections, ``norm`` as its norms' weight."""
        wide = self.heads.wide
        q = wide.num_attention_heads * wide.head_dim
        kv = wide.num_key_value_heads * wide.head_dim
        shapes = {"q_proj": (q, self.in_width), "k_proj": (kv, self.in_width), "v_proj": (kv, self.in_width),
                  "o_proj": (self.layout.wide, q), "gate_proj": (wide.intermediate_size, self.layout.wide),
                  "up_proj": (wide.intermediate_size, self.layout.wide),
                  "down_proj": (self.layout.wide, wide.intermediate_size)}
        out = {}
        for name in names:
            kind = name.rsplit(".", 2)[-2]
            out[name] = widen_norm(norm, self.layout, self.dtype) if name.endswith("norm.weight") else \
                torch.zeros(shapes[kind], dtype=self.dtype)
        return out
