"""The one-layer EAGLE-1/2 drafter, in plain torch, computing what sglang's draft model does.

sglang 0.5.17 ``LlamaForCausalLMEagle`` / ``Qwen2ForCausalLMEagle`` (models/llama_eagle.py,
models/qwen2_eagle.py) run, for every input position ``t``::

    x   = fc(cat(embed(token), h_t))          # embedding FIRST, target row second; fc has a bias
    r   = x                                    # layer 0 has no input_layernorm (identity)
    a   = o_proj(attn(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))   # causal
    r   = a + r                                # fused add inside post_attention_layernorm
    out = mlp(post_attention_layernorm(r)) + r # the model returns hidden_states + residual

There is no final norm: ``out`` is both the draft's predicted next target row (fed to the
next draft step) and what the LM head is applied to. ``token`` is the token sampled from
``h_t`` (the one at position ``t + 1``), ``positions`` are the rows' sequence positions.
Llama: q/k/v/o biases only with ``attention_bias`` (or ``bias``); Qwen2: q/k/v biases, none
on o; the MLP is ``down(silu(gate(y)) * up(y))`` without biases in both.

Parameter names are sglang's checkpoint names (``fc.weight``, ``layers.0.self_attn.q_proj.weight``,
...), so ``state_dict()`` is the checkpoint. The target's embedding and LM head are frozen,
non-persistent buffers (never saved, never optimised).

:class:`DraftModel` is what this drafter shares with the EAGLE3 one (``eagle3_model.py``): packed
inputs, rotary tables, and a draft step split into ``first_feature`` / ``layer_input`` / the
layer's attention and ``finish``, so that ``unroll.py`` unrolls both kinds the same way.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from sglang_rl.drafter.config import DrafterConfig, DrafterConfigError
from sglang_rl.drafter.target_weights import TargetHead

__all__ = ["DraftDecoderLayer", "DraftModel", "EagleDrafter", "RMSNorm", "apply_rotary", "rotary_inv_freq",
           "segment_bounds"]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, like sglang's native RMSNorm."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * self.weight).to(out_dtype or x.dtype)


def rotary_inv_freq(config: DrafterConfig) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` for default, linear and llama3 rope."""
    dim = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] == "linear":
        return inv
    factor = float(scaling.get("factor", 1.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    orig = float(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    wave_len = 2 * math.pi / inv
    smooth = (orig / wave_len - low) / (high - low) if low != high else torch.zeros_like(inv)
    scaled = torch.where(wave_len > orig / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv)
    return torch.where(wave_len < orig / high, inv, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Neox-style rotation of the first ``rotary_dim`` dims of ``x [N, heads, head_dim]``."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def segment_bounds(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the packed sequences; one sequence when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu} does not partition {total} positions")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


class DraftAttention(nn.Module):
    """Causal GQA self-attention with rotary positions; packed sequences never see each other."""

    def __init__(self, config: DrafterConfig, in_features: int | None = None) -> None:
        """``in_features``: width of the q/k/v input (default ``hidden_size``; EAGLE3: ``2H``)."""
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        w = h if in_features is None else in_features
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.rotary_dim = config.rotary_dim
        self.q_proj = nn.Linear(w, self.n_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(w, self.n_kv * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(w, self.n_kv * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=config.o_bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated ``q [heads, N, d]`` and ``k, v [kv_heads, N, d]`` of ``x [N, H]``."""
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.n_heads, self.head_dim), cos, sin, self.rotary_dim)
        k = apply_rotary(self.k_proj(x).view(n, self.n_kv, self.head_dim), cos, sin, self.rotary_dim)
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim)
        return tuple(t.transpose(0, 1) for t in (q, k, v))

    def out(self, heads: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of the attention output ``[heads, N, d]``."""
        n = heads.shape[1]
        return self.o_proj(heads.transpose(0, 1).reshape(n, self.n_heads * self.head_dim))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[tuple[int, int]]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        gqa = self.n_heads != self.n_kv
        parts = [
            F.scaled_dot_product_attention(
                q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], is_causal=True, enable_gqa=gqa
            )[0]
            for a, b in bounds
        ]
        return self.out(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


class DraftMLP(nn.Module):
    """``down(silu(gate(y)) * up(y))`` without biases."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class DraftDecoderLayer(nn.Module):
    """A Llama/Qwen2 decoder layer without ``input_layernorm`` (EAGLE's layer 0)."""

    def __init__(self, config: DrafterConfig, in_features: int | None = None) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, in_features)
        self.mlp = DraftMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[tuple[int, int]]
    ) -> torch.Tensor:
        return self.finish(x, self.self_attn(x, cos, sin, bounds))

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input ``x`` and the attention output ``attn``."""
        # sglang's fused add+norm: the sum is formed in float32, normalised unrounded, and
        # rounded to the compute dtype only for the residual stream
        total = attn.to(torch.float32) + x.to(torch.float32)
        residual = total.to(x.dtype)
        return self.mlp(self.post_attention_layernorm(total, x.dtype)) + residual


class DraftModel(nn.Module):
    """What the EAGLE-1/2 and EAGLE3 drafters share: packed inputs, rotary tables and one draft
    step ``layer_input -> attention -> finish`` (``unroll.py`` drives the same three pieces).

    A subclass sets ``config``, ``fc``, ``layers`` (one layer), ``embed_tokens``, ``_inv_freq``
    and ``feature_width`` (width of a target row it reads), and defines :meth:`first_feature`
    and :meth:`layer_input`."""

    config: DrafterConfig
    feature_width: int

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the trainable parameters (inputs are cast to it)."""
        return self.fc.weight.dtype

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos, sin [N, rotary_dim // 2]`` at ``positions``."""
        pos = positions.to(torch.float32)
        scaling = self.config.rope_scaling
        if scaling is not None and scaling["rope_type"] == "linear":
            pos = pos / float(scaling.get("factor", 1.0))
        freqs = pos[:, None] * self._inv_freq.to(pos.device)[None, :]
        return freqs.cos(), freqs.sin()

    def first_feature(self, rows: torch.Tensor) -> torch.Tensor:
        """The step-1 feature ``[N, H]`` of target rows ``[N, feature_width]`` (compute dtype)."""
        raise NotImplementedError

    def layer_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention input, residual)`` of a step fed token embeddings and a feature ``[N, H]``."""
        raise NotImplementedError

    def step(self, ids: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
             bounds: list[tuple[int, int]]) -> torch.Tensor:
        """One draft step ``[N, H]`` from tokens ``[N]`` and features ``[N, H]`` (teacher-forced
        attention within each of ``bounds``); a chained draft step feeds the previous output."""
        embeds = F.embedding(ids, self.embed_tokens).to(self.compute_dtype)
        cos, sin = self.rotary(positions)
        x, residual = self.layer_input(embeds, feature.to(self.compute_dtype))
        layer = self.layers[0]
        return layer.finish(residual, layer.self_attn(x, cos, sin, bounds))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft step 1 ``[N, H]`` (EAGLE-1/2: the predicted next rows).

        ``input_ids [N]`` (or ``[1, N]``), ``hidden_states [N, feature_width]`` (or ``[1, N, .]``)
        are packed sequences separated by ``cu_seqlens [S + 1]``; ``position_ids`` default to
        ``0..len-1`` within each sequence.
        """
        ids = input_ids.reshape(-1)
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        n = ids.shape[0]
        if rows.shape != (n, self.feature_width):
            raise ValueError(f"hidden_states {tuple(rows.shape)} do not match {n} ids x {self.feature_width}")
        bounds = segment_bounds(cu_seqlens, n)
        if position_ids is None:
            position_ids = torch.cat([torch.arange(b - a) for a, b in bounds]) if bounds else ids.new_zeros(0)
        pos = position_ids.reshape(-1)
        if pos.shape[0] != n:
            raise ValueError(f"position_ids has {pos.shape[0]} entries for {n} ids")
        return self.step(ids, self.first_feature(rows.to(self.compute_dtype)), pos, bounds)

    def forward_batch(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """:meth:`forward` on a dict from ``build_eagle_batch``."""
        return self(batch["input_ids"], batch["hidden_states"], batch.get("position_ids"), batch.get("cu_seqlens"))


class EagleDrafter(DraftModel):
    """EAGLE-1/2 drafter: ``(token_{t+1}, h_t) -> predicted h_{t+1}`` over packed sequences."""

    def __init__(self, config: DrafterConfig, head: TargetHead) -> None:
        super().__init__()
        if config.is_eagle3:
            raise DrafterConfigError("this is an EAGLE3 drafter config: use Eagle3Drafter (eagle3_model.py)")
        if config.raw.get("rope_is_neox_style", True) is False:
            raise DrafterConfigError("only neox-style rope is supported")
        v, h = config.vocab_size, config.hidden_size
        if tuple(head.embed.shape) != (v, h) or tuple(head.lm_head.shape) != (v, h):
            raise DrafterConfigError(
                f"target embed {tuple(head.embed.shape)} / lm_head {tuple(head.lm_head.shape)} "
                f"do not match vocab {v} x hidden {h}"
            )
        self.config = config
        self.feature_width = h
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([DraftDecoderLayer(config)])
        self.register_buffer("embed_tokens", head.embed.detach(), persistent=False)
        self.register_buffer("lm_head", None if head.tied else head.lm_head.detach(), persistent=False)
        # a plain attribute, not a buffer: ``.to(bfloat16)`` must not round the frequencies
        self._inv_freq = rotary_inv_freq(config)

    @property
    def head_weight(self) -> torch.Tensor:
        """The frozen LM head ``[V, H]`` (the embedding when the target ties them)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def first_feature(self, rows: torch.Tensor) -> torch.Tensor:
        """The target row itself: EAGLE-1/2 feeds ``h_t`` (step 1) or its own prediction."""
        return rows

    def layer_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x = fc(cat(embed, feature))`` is both the attention input and the residual."""
        x = self.fc(torch.cat((embeds, feature), dim=-1))
        return x, x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ lm_head.T`` in the head's dtype."""
        head = self.head_weight
        return F.linear(hidden.to(head.dtype), head)
