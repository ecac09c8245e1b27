"""Shapes of a Llama decoder and where a small model's dimensions go inside a wider one.

* :class:`Shape`: the sizes that set a Llama model's cost (hidden, heads, KV heads, head dim, MLP,
  layers), read from a ``config.json`` or named (``llama-8b``).
* :class:`HiddenLayout`: where the small model's ``h`` hidden dims sit in the wide ``H``. The real
  dims come first. ``zeros`` pads the rest with zeros: every RMSNorm then divides by a mean that is
  ``h/H`` of the small one, so norm weights are scaled by ``sqrt(h/H)`` and ``rms_norm_eps`` by
  ``h/H``. ``copies`` fills whole blocks of ``h`` dims with scaled copies ``c_b * x`` of the
  residual stream (norm weight 0 on them, so nothing reads them) until the copies carry
  ``H/h - 1`` times the real dims' squared mass: each norm's mean is then the small one's exactly,
  and norm weights and ``rms_norm_eps`` stay as they are. Copies with ``c_b`` a power of two are
  exact in bf16; only the last block, which takes the remainder, is rounded.
* :class:`HeadMap`: small query head ``r`` of KV group ``g`` goes to wide head ``g * G + r``
  (``G`` wide heads per group); KV head ``g`` stays ``g``. Inside a head of ``D = k * d`` dims,
  rotate-half pair ``i`` (dims ``i, i + d/2``) goes to pair ``k * i`` (dims ``k*i, k*i + D/2``),
  whose inverse frequency ``theta^(-2ki/D) = theta^(-2i/d)`` is the same for every ``theta``;
  queries are multiplied by ``sqrt(D/d)`` so the softmax scale ``D^-1/2`` acts as ``d^-1/2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping

import torch

__all__ = ["LAYOUTS", "NAMED_SHAPES", "HeadMap", "HiddenLayout", "Shape", "WidenError"]

LAYOUTS = ("copies", "zeros")


class WidenError(ValueError):
    """A wide shape that cannot hold the small model, or a model this construction does not cover."""


@dataclass(frozen=True)
class Shape:
    """The sizes of a Llama decoder that set its cost."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "Shape":
        """The shape of a Llama ``config.json`` dict."""
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
        )

    def replace(self, **sizes: int | None) -> "Shape":
        """This shape with the given sizes changed (None keeps a size)."""
        return Shape(**{**self.__dict__, **{k: v for k, v in sizes.items() if v is not None}})

    def num_parameters(self, vocab_size: int, tied: bool = True) -> int:
        """Parameters of a model of this shape (embeddings counted once when tied)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_hidden_layers * layer + vocab_size * h * (1 if tied else 2) + h

    def check_holds(self, small: "Shape") -> None:
        """WidenError unless every size of ``small`` fits in this shape as the construction needs."""
        problems = []
        for name in ("hidden_size", "num_key_value_heads", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) < getattr(small, name):
                problems.append(f"{name} {getattr(self, name)} < the small model's {getattr(small, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"{self.num_attention_heads} heads do not split into {self.num_key_value_heads} KV groups")
        elif (self.num_attention_heads // self.num_key_value_heads
              < small.num_attention_heads // small.num_key_value_heads):
            problems.append(f"{self.num_attention_heads // self.num_key_value_heads} heads per KV group < the small "
                            f"model's {small.num_attention_heads // small.num_key_value_heads}")
        if self.head_dim % small.head_dim or (small.head_dim % 2):
            problems.append(f"head_dim {self.head_dim} is not a multiple of the small model's {small.head_dim}")
        if problems:
            raise WidenError("the wide shape cannot hold the small model: " + "; ".join(problems))


# Llama-3.1-8B's decoder shape (its vocabulary is not part of it: the small model's stays)
NAMED_SHAPES: dict[str, Shape] = {
    "llama-8b": Shape(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      intermediate_size=14336, num_hidden_layers=32),
}


def _copy_scales(small: int, wide: int) -> list[float]:
    """Scales of the copy blocks whose squares add up to ``wide/small - 1``: powers of two (exact)
    greedily, the last block the square root of what is left; [] when no block fits."""
    blocks = (wide - small) // small
    need = Fraction(wide, small) - 1
    scales: list[float] = []
    for b in range(blocks):
        if need == 0:
            break
        if b == blocks - 1:
            scales.append(math.sqrt(need))
            break
        k = 0
        while Fraction(4) ** (k + 1) <= need:
            k += 1
        while Fraction(4) ** k > need:
            k -= 1
        scales.append(2.0 ** k)
        need -= Fraction(4) ** k
    return scales


@dataclass(frozen=True)
class HiddenLayout:
    """Where the small hidden dims sit in the wide ones (see the module docstring)."""

    small: int
    wide: int
    copies: tuple[float, ...] = ()

    @classmethod
    def make(cls, small: int, wide: int, layout: str) -> "HiddenLayout":
        """``zeros`` or ``copies`` (``copies`` falls back to ``zeros`` when no block of ``small``
        dims fits beside the real ones)."""
        if layout not in LAYOUTS:
            raise WidenError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        return cls(small, wide, tuple(_copy_scales(small, wide)) if layout == "copies" else ())

    @property
    def name(self) -> str:
        return "copies" if self.copies else "zeros"

    @property
    def mass_ratio(self) -> float:
        """``h * (1 + sum c^2) / H``: the wide norm's mean over the small one's."""
        return self.small * (1.0 + sum(c * c for c in self.copies)) / self.wide

    @property
    def norm_scale(self) -> float:
        """Factor on the real dims' RMSNorm weights (1 when the copies carry the mass)."""
        return 1.0 if self.exact_mass else math.sqrt(self.mass_ratio)

    @property
    def eps_scale(self) -> float:
        """Factor on ``rms_norm_eps``."""
        return 1.0 if self.exact_mass else self.mass_ratio

    @property
    def exact_mass(self) -> bool:
        """Whether the copies make the wide norms' mean equal the small one's."""
        return bool(self.copies) and abs(self.mass_ratio - 1.0) < 1e-12

    def real(self) -> torch.Tensor:
        """Wide indices of the real dims (where an input is read)."""
        return torch.arange(self.small)

    def rows(self) -> list[tuple[torch.Tensor, float]]:
        """``(wide indices, scale)`` of every place an output written to the stream goes."""
        return [(torch.arange(self.small) + b * self.small, s) for b, s in enumerate((1.0, *self.copies))]

    def to_json(self) -> dict:
        return {"layout": self.name, "copies": list(self.copies)}


@dataclass(frozen=True)
class HeadMap:
    """Query/KV rows of the small heads inside the wide ones, and the query scale."""

    small: Shape
    wide: Shape

    @property
    def dim_factor(self) -> int:
        return self.wide.head_dim // self.small.head_dim

    @property
    def q_scale(self) -> float:
        """``sqrt(D/d)``: keeps the softmax scale."""
        return math.sqrt(self.wide.head_dim / self.small.head_dim)

    def head_dims(self) -> torch.Tensor:
        """Wide dim of each small head dim: pair ``i`` (dims ``i, i + d/2``) -> pair ``k i``."""
        d, big, k = self.small.head_dim, self.wide.head_dim, self.dim_factor
        e = torch.arange(d)
        return k * (e % (d // 2)) + (e // (d // 2)) * (big // 2)

    def q_heads(self) -> torch.Tensor:
        """Wide query head of each small query head (same KV group, same place in it)."""
        g_small = self.small.num_attention_heads // self.small.num_key_value_heads
        g_wide = self.wide.num_attention_heads // self.wide.num_key_value_heads
        h = torch.arange(self.small.num_attention_heads)
        return (h // g_small) * g_wide + h % g_small

    def q_rows(self) -> torch.Tensor:
        """Wide q_proj rows (= o_proj columns) of the small ones, head by head."""
        return (self.q_heads()[:, None] * self.wide.head_dim + self.head_dims()[None, :]).reshape(-1)

    def kv_rows(self) -> torch.Tensor:
        """Wide k_proj / v_proj rows of the small ones: KV head ``g`` stays ``g``."""
        g = torch.arange(self.small.num_key_value_heads)
        return (g[:, None] * self.wide.head_dim + self.head_dims()[None, :]).reshape(-1)
