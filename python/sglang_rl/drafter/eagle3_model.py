"""The one-layer EAGLE3 drafter, in plain torch, computing what sglang's draft model does.

sglang 0.5.17 ``LlamaForCausalLMEagle3`` (models/llama_eagle3.py) runs, for every position::

    x  = fc(aux_t)          # draft step 1: the target's aux rows, [n_aux * H] -> [H], no bias
    x  = g_prev             # chained steps: the previous step's output g, [H], no fc
    r0 = x
    a  = o_proj(attn(qkv(cat(input_layernorm(embed(token)), hidden_norm(x)))))  # 2H wide, causal
    r1 = a + r0                               # fused add inside post_attention_layernorm
    g  = mlp(post_attention_layernorm(r1)) + r1   # fused add inside the final norm
    logits = lm_head(norm(g))                 # draft vocabulary [N]; target id = d + d2t[d]

``g`` (pre-norm: sglang's ``norm_output`` is off) is what a chained step feeds back, and what
:meth:`Eagle3Drafter.forward` returns. The embedding is the target's, frozen (the worker swaps
it in); ``lm_head`` is the draft's own and trained. ``d2t`` / ``t2d`` fix the draft vocabulary.

Parameter names are sglang's checkpoint names as :func:`read_eagle3` returns them after mapping
``midlayer.`` to ``layers.0.`` (``fc.weight``, ``layers.0.hidden_norm.weight``, ...,
``norm.weight``, ``lm_head.weight``): ``state_dict()`` is what ``load_weights`` takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from sglang_rl.drafter.checkpoint_format import DrafterCheckpointError
from sglang_rl.drafter.config import DrafterConfig, DrafterConfigError
from sglang_rl.drafter.eagle3 import read_eagle3, save_eagle3, sglang_name, specforge_name, vocab_map
from sglang_rl.drafter.model import DraftDecoderLayer, DraftModel, RMSNorm, rotary_inv_freq
from sglang_rl.drafter.target_weights import load_target_head

__all__ = ["Eagle3DecoderLayer", "Eagle3Drafter", "eagle3_checkpoint", "load_eagle3_drafter", "save_eagle3_drafter"]

# config switches of sglang's EAGLE3 model that this drafter does not implement
_UNSUPPORTED = ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output", "bias")


def _num_aux(raw: Mapping) -> int:
    """sglang's resolution: ``num_aux_hidden_states`` > the eagle_config layer ids > 3."""
    if raw.get("num_aux_hidden_states") is not None:
        return int(raw["num_aux_hidden_states"])
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def _check(config: DrafterConfig) -> None:
    raw = config.raw
    if not config.is_eagle3:
        raise DrafterConfigError(f"architectures {raw.get('architectures')} is not an EAGLE3 drafter")
    eagle = raw.get("eagle_config") or {}
    on = [k for k in _UNSUPPORTED if raw.get(k) or eagle.get(k)]
    if on:
        raise DrafterConfigError(f"EAGLE3 options {on} are not supported")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise DrafterConfigError("only one-layer EAGLE3 drafters are supported")
    if int(raw.get("target_hidden_size") or config.hidden_size) != config.hidden_size:
        raise DrafterConfigError("target_hidden_size != hidden_size is not supported")
    if raw.get("rope_is_neox_style", True) is False or config.qkv_bias or config.o_bias:
        raise DrafterConfigError("EAGLE3 drafters need neox-style rope and no attention biases")
    if raw.get("draft_vocab_size") is None:
        raise DrafterConfigError("EAGLE3 config has no draft_vocab_size")


class Eagle3DecoderLayer(DraftDecoderLayer):
    """sglang's EAGLE3 layer 0: attention reads ``cat(input_layernorm(embed), hidden_norm(x))``."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config, in_features=2 * config.hidden_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Eagle3Drafter(DraftModel):
    """EAGLE3 drafter: ``(token_{t+1}, aux_t) -> g`` whose logits propose ``token_{t+2}``."""

    def __init__(self, config: DrafterConfig, embed: torch.Tensor, d2t: torch.Tensor,
                 t2d: torch.Tensor | None = None) -> None:
        """``embed [V, H]``: the target's embedding; ``d2t [N]``: target id of draft id ``i`` is
        ``i + d2t[i]``; ``t2d [V]`` bool (derived from ``d2t`` when None, checked otherwise)."""
        super().__init__()
        _check(config)
        v, h, n = config.vocab_size, config.hidden_size, int(config.raw["draft_vocab_size"])
        if tuple(embed.shape) != (v, h):
            raise DrafterConfigError(f"target embed {tuple(embed.shape)} does not match vocab {v} x hidden {h}")
        d2t = torch.as_tensor(d2t).to(torch.int64).reshape(-1)
        if d2t.shape[0] != n:
            raise DrafterCheckpointError(f"d2t has {d2t.shape[0]} entries for a draft vocabulary of {n}")
        hot = torch.arange(n) + d2t
        _, mapped = vocab_map(hot, v)
        if t2d is not None and not torch.equal(torch.as_tensor(t2d).to(torch.bool).reshape(-1), mapped):
            raise DrafterCheckpointError("t2d does not mark exactly the target ids of d2t")
        self.config = config
        self.feature_width = _num_aux(config.raw) * h
        self.fc = nn.Linear(self.feature_width, h, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, n, bias=False)
        self.register_buffer("embed_tokens", embed.detach(), persistent=False)
        self.register_buffer("d2t", d2t, persistent=False)
        self.register_buffer("t2d", mapped, persistent=False)
        index = torch.full((v,), -1, dtype=torch.int64)
        index[hot] = torch.arange(n)
        self.register_buffer("_target_to_draft", index, persistent=False)
        # a plain attribute, not a buffer: ``.to(bfloat16)`` must not round the frequencies
        self._inv_freq = rotary_inv_freq(config)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    def first_feature(self, rows: torch.Tensor) -> torch.Tensor:
        """``fc(aux)``: draft step 1's input from the target's concatenated aux rows."""
        return self.fc(rows)

    def layer_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cat(input_layernorm(embed), hidden_norm(x))`` for attention; ``x`` is the residual."""
        layer = self.layers[0]
        return torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(feature)), dim=-1), feature

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[M, N]``: ``lm_head(norm(g))``."""
        return self.lm_head(self.norm(g.to(self.compute_dtype)))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (sglang's ``hot_token_id``)."""
        return draft_ids + self.d2t[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids; -1 for ids outside the draft vocabulary."""
        return self._target_to_draft[target_ids]

    def set_target_embed(self, embed: torch.Tensor) -> None:
        """Copy a new target embedding (rows past the vocabulary, sglang's padding, are cut)."""
        self.embed_tokens.copy_(embed[: self.embed_tokens.shape[0]].to(self.embed_tokens))


def load_eagle3_drafter(folder: str | Path, target_dir: str | Path,
                        dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """An EAGLE3 folder (checked by :func:`read_eagle3`) with the target's embedding, in ``dtype``."""
    cfg, tensors = read_eagle3(folder)
    config = DrafterConfig.from_dict(cfg)
    embed = load_target_head(target_dir, dtype=dtype).embed
    model = Eagle3Drafter(config, embed, tensors["d2t"], tensors["t2d"])
    state = {sglang_name(n): t.to(dtype) for n, t in tensors.items() if n not in ("d2t", "t2d")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DrafterCheckpointError(f"{folder}: missing {sorted(missing)}, unknown {sorted(unexpected)}")
    return model.to(dtype)


def eagle3_checkpoint(model: Eagle3Drafter, dtype: str | torch.dtype | None = None) -> tuple[dict, dict]:
    """``(config, tensors)`` of the folder :func:`save_eagle3` writes: SpecForge's ``midlayer.``
    names, ``d2t`` and ``t2d``; ``dtype`` (default: the folder's) goes to the config."""
    cfg = dict(model.config.raw)
    if dtype is not None:
        cfg["dtype"] = cfg["torch_dtype"] = model.config.with_dtype(dtype).dtype
    tensors = {specforge_name(n): t.detach().to("cpu").clone()
               for n, t in model.state_dict().items()}
    tensors.update(d2t=model.d2t.detach().to("cpu").clone(), t2d=model.t2d.detach().to("cpu").clone())
    return cfg, tensors


def save_eagle3_drafter(model: Eagle3Drafter, out_dir: str | Path, dtype: str | torch.dtype | None = None) -> Path:
    """Write the drafter as an EAGLE3 folder sglang loads (``--speculative-algorithm EAGLE3``)."""
    return save_eagle3(out_dir, *eagle3_checkpoint(model, dtype))
