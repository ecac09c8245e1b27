"""Drafter configuration: the target's sizes read from a Hugging Face ``config.json``.

One config type serves both directions: it is built from the *target* model's config (to
create a new drafter) or from a *drafter* folder's config (to load one), and it writes the
drafter's ``config.json`` in the form sglang 0.5.17 loads with
``--speculative-algorithm EAGLE --speculative-draft-model-path DIR``:

* ``architectures`` is ``["LlamaForCausalLMEagle"]`` or ``["Qwen2ForCausalLMEagle"]``
  (sglang picks the draft class by this name);
* ``num_hidden_layers`` is 1 (``layer_types``, when present, is cut to one entry so
  transformers' config validation accepts it);
* ``tie_word_embeddings`` is False: sglang's EAGLE worker replaces the draft's embedding and
  LM head with the target's (``set_embed_and_head``), and with a tied draft that method would
  delete the same parameter twice and fail;
* every other field (rope, vocab, sizes, ``max_position_embeddings``) is the target's, so the
  draft's context length and rotary tables match the target's.

An EAGLE3 drafter folder's config (``LlamaForCausalLMEagle3``, written by ``eagle3.py``) parses
as a Llama one; :attr:`DrafterConfig.is_eagle3` tells it apart.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = [
    "DRAFT_ARCHITECTURES",
    "DTYPE_NAMES",
    "EAGLE3_ARCHITECTURE",
    "DrafterConfig",
    "DrafterConfigError",
    "dtype_from_name",
    "dtype_name",
]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# target family -> the sglang draft class that mirrors it
DRAFT_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLMEagle",
    "qwen2": "Qwen2ForCausalLMEagle",
}
_TARGET_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLMEagle": "llama",
    "Qwen2ForCausalLMEagle": "qwen2",
    # an EAGLE3 draft is a Llama layer whatever the target (its sizes are read the same way)
    EAGLE3_ARCHITECTURE: "llama",
}
_SUPPORTED_ROPE = ("default", "linear", "llama3")

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class DrafterConfigError(ValueError):
    """The target (or drafter) config describes a model this drafter cannot mirror."""


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (also accepts ``"torch.bfloat16"``, ``"fp32"``...)."""
    key = str(name).removeprefix("torch.").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_NAMES:
        raise DrafterConfigError(f"unsupported dtype {name!r}; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise DrafterConfigError(f"unsupported dtype {dtype}")


def _family(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in _TARGET_ARCHITECTURES:
            return _TARGET_ARCHITECTURES[arch]
    model_type = raw.get("model_type")
    if model_type in DRAFT_ARCHITECTURES:
        return str(model_type)
    raise DrafterConfigError(
        f"architectures {archs} / model_type {model_type!r} is neither a Llama nor a Qwen2 model"
    )


def _rope(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers v5 or v4 style config."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = dict(params)
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw["rope_scaling"]) if isinstance(raw.get("rope_scaling"), Mapping) else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind is None:
            raise DrafterConfigError(f"rope scaling {scaling} names no rope_type")
        if kind not in _SUPPORTED_ROPE:
            raise DrafterConfigError(f"rope_type {kind!r} is not supported (supported: {_SUPPORTED_ROPE})")
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
    return theta, scaling


@dataclass(frozen=True)
class DrafterConfig:
    """Sizes of the one-layer EAGLE drafter; they are the target's.

    ``raw`` keeps the full source config so :meth:`to_json_dict` writes every target field
    through unchanged (sglang reads rope and context settings from it).
    """

    family: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    dtype: str
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def is_eagle3(self) -> bool:
        """True for an EAGLE3 drafter folder's config (``LlamaForCausalLMEagle3``)."""
        return EAGLE3_ARCHITECTURE in (self.raw.get("architectures") or [])

    @property
    def draft_architecture(self) -> str:
        """The sglang class name written to ``architectures``."""
        return EAGLE3_ARCHITECTURE if self.is_eagle3 else DRAFT_ARCHITECTURES[self.family]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DrafterConfig":
        """Parse a target or drafter ``config.json`` dict (Llama or Qwen2)."""
        family = _family(raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            intermediate = int(raw["intermediate_size"])
            vocab = int(raw["vocab_size"])
        except KeyError as missing:
            raise DrafterConfigError(f"config has no {missing.args[0]!r}") from None
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise DrafterConfigError(f"hidden_act {act!r} is not supported (sglang's Llama MLP needs silu)")
        head_dim = int(raw.get("head_dim") or hidden // heads)
        rotary_dim = int(float(raw.get("partial_rotary_factor", 1.0)) * head_dim)
        theta, scaling = _rope(raw)
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False) or raw.get("bias", False))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            family=family,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_dim=rotary_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            dtype=dtype_name(dtype_from_name(dtype)),
            raw=copy.deepcopy(dict(raw)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "DrafterConfig":
        """Read ``model_dir/config.json`` (a target model or a drafter folder)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise DrafterConfigError(f"{path} does not exist")
        return cls.from_dict(json.loads(path.read_text()))

    def with_dtype(self, dtype: str | torch.dtype) -> "DrafterConfig":
        """Same config, checkpoint dtype changed."""
        name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype_name(dtype_from_name(dtype))
        return DrafterConfig(**{**self.__dict__, "dtype": name})

    def to_json_dict(self) -> dict[str, Any]:
        """The drafter's ``config.json`` content (see the module docstring)."""
        out = copy.deepcopy(self.raw)
        for key in ("auto_map", "quantization_config", "_name_or_path", "_model_name_or_path"):
            out.pop(key, None)
        out["architectures"] = [self.draft_architecture]
        out["num_hidden_layers"] = 1
        if isinstance(out.get("layer_types"), list) and out["layer_types"]:
            out["layer_types"] = out["layer_types"][:1]
        if "max_window_layers" in out:
            out["max_window_layers"] = min(int(out["max_window_layers"]), 1)
        out["tie_word_embeddings"] = False
        out["dtype"] = self.dtype
        out["torch_dtype"] = self.dtype
        return out
