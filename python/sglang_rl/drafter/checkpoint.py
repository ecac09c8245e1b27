"""Create, save and load drafter folders that sglang loads as an EAGLE draft model.

Folder format (``--speculative-algorithm EAGLE --speculative-draft-model-path DIR``):

* ``config.json``: the target's config with the EAGLE changes described in
  :mod:`sglang_rl.drafter.config` (``architectures = [LlamaForCausalLMEagle]`` or
  ``[Qwen2ForCausalLMEagle]``, ``num_hidden_layers = 1``, ``tie_word_embeddings = false``,
  ``dtype``).
* ``model.safetensors``: the trainable weights under the names that sglang's draft
  ``load_weights`` takes (it prepends ``model.`` itself, and fuses q/k/v and gate/up):
  ``fc.weight``, ``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (plus q/k/v
  biases for Qwen2 or ``attention_bias``), ``layers.0.mlp.{gate,up,down}_proj.weight`` and
  ``layers.0.post_attention_layernorm.weight``. There is no ``input_layernorm``: sglang's
  EAGLE layer 0 has none. There is no ``embed_tokens`` and no ``lm_head`` either: the EAGLE
  worker replaces both with the target's (``set_embed_and_head``), and the draft loader
  skips every ``lm_head`` name.

:func:`load_drafter` also reads published EAGLE-1/2 folders with the same names (optionally
prefixed ``model.``, in ``*.safetensors`` or ``pytorch_model.bin``). Names that sglang
ignores or overwrites (``embed_tokens``, ``lm_head``, ``input_layernorm``, rotary buffers)
are skipped; a missing trainable weight is an error, where sglang would keep its random value.

EAGLE3 folders (``eagle3.py``) go through the same three entry points: :func:`load_drafter`
returns an ``Eagle3Drafter`` for one, :func:`save_drafter` writes one, :func:`sglang_weights`
gives its live-update names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_rl.drafter.checkpoint_format import INIT_SCHEMES, WEIGHTS_FILE, DrafterCheckpointError
from sglang_rl.drafter.config import DrafterConfig, dtype_from_name
from sglang_rl.drafter.model import DraftModel, EagleDrafter
from sglang_rl.drafter.target_weights import load_target_head

__all__ = [
    "INIT_SCHEMES",
    "WEIGHTS_FILE",
    "DrafterCheckpointError",
    "init_drafter",
    "load_drafter",
    "read_draft_weights",
    "save_drafter",
    "sglang_weights",
]

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_IGNORED_NAMES = ("embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight", "norm.weight")
_CONFLICTING_FILES = ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@torch.no_grad()
def _initialise(model: EagleDrafter, scheme: str, seed: int) -> None:
    """Initialise the trainable weights.

    ``normal``: every linear weight ~ N(0, initializer_range), biases 0, norm weights 1 (the
    Hugging Face Llama initialisation). ``passthrough`` (the default): the same, then ``fc``
    copies the target row (``fc.weight = [0 | I]``) and ``o_proj``/``down_proj`` are zero, so
    the untrained drafter predicts ``h_{t+1} = h_t``; each zeroed residual branch still gets
    gradients (from the second step on for the projections behind it).

    Why passthrough: consecutive rows are correlated, so it starts with a lower regression
    loss than ``normal`` (SmolLM2 rollouts: SmoothL1 0.77 vs 1.07) and trains at least as well.
    Its untrained proposals are also predictable: ``argmax lm_head(h_t)`` is the target's
    greedy token, so every draft token is the last committed token repeated (under greedy
    decoding), and sglang accepts exactly where the target repeats a token."""
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"init must be one of {INIT_SCHEMES}, got {scheme!r}")
    gen = torch.Generator().manual_seed(seed)
    std = float(model.config.raw.get("initializer_range", 0.02))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            if module.bias is not None:
                module.bias.zero_()
    for layer in model.layers:
        layer.post_attention_layernorm.weight.fill_(1.0)
    if scheme == "passthrough":
        h = model.config.hidden_size
        model.fc.weight.zero_()
        model.fc.weight[:, h:] = torch.eye(h)
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def init_drafter(
    target_dir: str | Path,
    seed: int = 0,
    init: str = "passthrough",
    dtype: torch.dtype = torch.float32,
) -> EagleDrafter:
    """A fresh drafter for the target folder ``target_dir`` (its embedding and head frozen).

    ``dtype`` is the parameter and compute dtype (float32 for CPU training); the dtype
    written to the checkpoint is chosen in :func:`save_drafter`. See :func:`_initialise`
    for the ``init`` schemes.
    """
    config = DrafterConfig.from_dir(target_dir)
    model = EagleDrafter(config, load_target_head(target_dir, dtype=dtype))
    _initialise(model, init, seed)
    return model.to(dtype)


def sglang_weights(model: DraftModel, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs in the names sglang's EAGLE draft ``load_weights`` accepts.

    Detached, contiguous CPU copies, cast to ``dtype`` when given. These names are the
    checkpoint names; the draft model adds ``model.`` and fuses q/k/v and gate/up itself.
    For an :class:`~sglang_rl.drafter.eagle3_model.Eagle3Drafter` they are ``fc.weight``,
    ``layers.0.*``, ``norm.weight`` and ``lm_head.weight`` (``LlamaForCausalLMEagle3``'s names;
    ``d2t`` / ``t2d`` never change in training and are not sent).
    """
    out = []
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu")
        if dtype is not None:
            t = t.to(dtype)
        out.append((name, t.contiguous().clone()))
    return out


def save_drafter(model: DraftModel, out_dir: str | Path, dtype: str | torch.dtype | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir``; returns the folder.

    ``dtype`` (default: the config's dtype, initially the target's) is the dtype of the saved
    weights and of ``config.json``'s ``dtype``. Each file is written to a temporary name and
    renamed, so a reader never sees a half-written file. An EAGLE3 drafter is written as an
    EAGLE3 folder (:func:`~sglang_rl.drafter.eagle3_model.save_eagle3_drafter`).
    """
    if model.config.is_eagle3:
        from sglang_rl.drafter.eagle3_model import save_eagle3_drafter

        return save_eagle3_drafter(model, out_dir, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clashes = [name for name in _CONFLICTING_FILES if (out / name).exists()]
    if clashes:
        raise DrafterCheckpointError(f"{out} already holds {clashes}; sglang would read those instead")
    config = model.config if dtype is None else model.config.with_dtype(dtype)
    torch_dtype = dtype_from_name(config.dtype)
    tensors = dict(sglang_weights(model, torch_dtype))
    tmp_weights = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_config = out / "config.json.tmp"
    tmp_config.write_text(json.dumps(config.to_json_dict(), indent=2, sort_keys=True) + "\n")
    os.chmod(tmp_weights, 0o644)
    os.replace(tmp_weights, out / WEIGHTS_FILE)
    os.replace(tmp_config, out / "config.json")
    return out


def _normalise(name: str) -> str | None:
    """Checkpoint name -> our parameter name, or None for names sglang skips or overwrites."""
    name = name.removeprefix("model.")
    if name in _IGNORED_NAMES or name.endswith(_IGNORED_SUFFIXES) or "lm_head" in name:
        return None
    return name


def _raw_tensors(draft_dir: Path) -> Iterable[tuple[str, torch.Tensor]]:
    files = sorted(draft_dir.glob("*.safetensors"))
    if files:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(draft_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise DrafterCheckpointError(f"{draft_dir} has no *.safetensors or pytorch_model*.bin")
    for path in bins:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()


def read_draft_weights(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    """The trainable weights of a drafter folder under our (= sglang checkpoint) names."""
    out: dict[str, torch.Tensor] = {}
    for raw_name, tensor in _raw_tensors(Path(draft_dir)):
        name = _normalise(raw_name)
        if name is not None:
            out[name] = tensor
    return out


def load_drafter(
    draft_dir: str | Path,
    target_dir: str | Path,
    dtype: torch.dtype = torch.float32,
) -> DraftModel:
    """Load a drafter folder (ours or a published EAGLE-1/2 one) for the target ``target_dir``.

    The weights are cast to ``dtype`` (the parameter and compute dtype). The config keeps the
    folder's ``dtype`` for the next :func:`save_drafter`. An EAGLE3 folder
    (``LlamaForCausalLMEagle3``) gives an :class:`~sglang_rl.drafter.eagle3_model.Eagle3Drafter`.
    """
    config = DrafterConfig.from_dir(draft_dir)
    if config.is_eagle3:
        from sglang_rl.drafter.eagle3_model import load_eagle3_drafter

        return load_eagle3_drafter(draft_dir, target_dir, dtype)
    model = EagleDrafter(config, load_target_head(target_dir, dtype=dtype)).to(dtype)
    weights = read_draft_weights(draft_dir)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise DrafterCheckpointError(f"{draft_dir} lacks weights {missing}")
    # like sglang's loader, an extra bias the architecture lacks is skipped
    unexpected = sorted(n for n in set(weights) - set(expected) if not n.endswith(".bias"))
    if unexpected:
        raise DrafterCheckpointError(f"{draft_dir} has weights this drafter does not know: {unexpected}")
    weights = {n: t for n, t in weights.items() if n in expected}
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DrafterCheckpointError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(expected[name].shape)}"
            )
    model.load_state_dict({n: t.to(dtype) for n, t in weights.items()})
    return model
