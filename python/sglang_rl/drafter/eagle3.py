"""EAGLE3 drafter folders in the layout sglang 0.5.17 loads (``LlamaForCausalLMEagle3``).

``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`` reads, from ``DIR``:

* ``config.json``: the target's sizes with ``architectures = [LlamaForCausalLMEagle3]``
  (also for Qwen2 targets: the draft is always a Llama layer), ``num_hidden_layers = 1``,
  ``tie_word_embeddings = false`` (a tied draft would use the embedding as its head),
  ``draft_vocab_size`` (rows of the draft's own LM head) and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the target layers whose outputs are
  concatenated into the draft's input; sglang captures the input of layer ``id + 1``).
* ``model.safetensors`` in SpecForge's names: ``fc.weight [H, 3H]`` (no bias),
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]``,
  ``midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]`` (attention reads
  ``cat(input_layernorm(embed), hidden_norm(fc(aux)))``), ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight [H]``, ``lm_head.weight [N, H]``,
  ``d2t`` (int64 ``[N]``: target id of draft id ``i`` is ``i + d2t[i]``) and ``t2d`` (bool
  ``[V]``: which target ids the draft vocabulary holds; sglang skips it). No ``embed_tokens``:
  the worker swaps in the target's embedding.

Plain torch; nothing here imports sglang.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from sglang_rl.drafter.checkpoint_format import INIT_SCHEMES, WEIGHTS_FILE, DrafterCheckpointError
from sglang_rl.drafter.config import EAGLE3_ARCHITECTURE, DrafterConfig, dtype_from_name
from sglang_rl.drafter.target_weights import _read, load_target_head, tensor_files

__all__ = [
    "EAGLE3_ARCHITECTURE",
    "default_aux_layer_ids",
    "draft_vocab",
    "eagle3_config",
    "eagle3_shapes",
    "init_eagle3",
    "read_eagle3",
    "save_eagle3",
    "sglang_name",
    "specforge_name",
    "vocab_map",
]

_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
SPECFORGE_LAYER, SGLANG_LAYER = "midlayer.", "layers.0."


def specforge_name(name: str) -> str:
    """A tensor name as an EAGLE3 folder holds it (SpecForge's ``midlayer.``)."""
    return name.replace(SGLANG_LAYER, SPECFORGE_LAYER, 1)


def sglang_name(name: str) -> str:
    """A tensor name as sglang's EAGLE3 draft model and the trainer name it (``layers.0.``)."""
    return name.replace(SPECFORGE_LAYER, SGLANG_LAYER, 1)


def vocab_map(hot: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [N] int64, t2d [V] bool)`` of the draft vocabulary whose draft id ``i`` is target id
    ``hot[i]``. DrafterCheckpointError unless ``hot`` holds distinct ids of the vocabulary."""
    hot = torch.as_tensor(hot).to(torch.int64).reshape(-1)
    if (hot < 0).any() or (hot >= vocab_size).any() or hot.unique().shape[0] != hot.shape[0]:
        raise DrafterCheckpointError("d2t maps draft ids outside the vocabulary or two to one target id")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[hot] = True
    return hot - torch.arange(hot.shape[0]), t2d


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high target layers; sglang's own default capture for a target of
    ``num_layers`` layers (layer inputs 2, L/2, L-3 are the outputs of layers 1, L/2-1, L-4)."""
    if num_layers < 4:
        raise DrafterCheckpointError(f"an EAGLE3 drafter needs a target of at least 4 layers, got {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def draft_vocab(vocab_size: int, size: int | None = None,
                counts: Sequence[float] | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [N] int64, t2d [V] bool)`` of a draft vocabulary of ``size`` target ids.

    With ``counts`` (one count per target id) the ``size`` most frequent ids are chosen (ties:
    the lower id); without, the first ``size`` ids. ``size`` None is the full vocabulary. Draft
    ids follow ascending target ids, as SpecForge orders them."""
    size = vocab_size if size is None else int(size)
    if not 1 <= size <= vocab_size:
        raise DrafterCheckpointError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    if counts is None:
        chosen = torch.arange(size)
    else:
        c = torch.as_tensor(counts, dtype=torch.float64).reshape(-1)
        if c.shape[0] != vocab_size:
            raise DrafterCheckpointError(f"token counts have {c.shape[0]} entries for a vocabulary of {vocab_size}")
        if not torch.isfinite(c).all() or (c < 0).any():
            raise DrafterCheckpointError("token counts must be finite and non-negative")
        # stable sort on -count keeps the lower id first among equal counts
        chosen = torch.sort(torch.argsort(-c, stable=True)[:size]).values
    return vocab_map(chosen, vocab_size)


def eagle3_config(target: DrafterConfig, draft_vocab_size: int, aux_layer_ids: Sequence[int] | None = None,
                  dtype: str | None = None) -> dict:
    """The EAGLE3 drafter's ``config.json`` for the target (see the module docstring)."""
    out = target.with_dtype(dtype or target.dtype).to_json_dict()
    num_layers = int(target.raw.get("num_hidden_layers", 0))
    ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    if any(not 0 <= i < num_layers for i in ids) or not ids:
        raise DrafterCheckpointError(f"aux layer ids {ids} are not layers of a {num_layers}-layer target")
    out.update(architectures=[EAGLE3_ARCHITECTURE], model_type="llama", draft_vocab_size=int(draft_vocab_size),
               attention_bias=False, bias=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})
    for key in ("layer_types", "max_window_layers", "use_sliding_window", "sliding_window"):
        out.pop(key, None)  # Qwen2 fields a Llama config has no use for
    return out


def eagle3_shapes(cfg: Mapping) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every tensor of an EAGLE3 drafter with config ``cfg``."""
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    d = int(cfg.get("head_dim") or h // int(cfg["num_attention_heads"]))
    q, kv = int(cfg["num_attention_heads"]) * d, int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * d
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    m = "midlayer."
    return {
        "fc.weight": (h, n_aux * h),
        **{f"{m}{n}.weight": (h,) for n in _NORMS},
        f"{m}self_attn.q_proj.weight": (q, 2 * h),
        f"{m}self_attn.k_proj.weight": (kv, 2 * h),
        f"{m}self_attn.v_proj.weight": (kv, 2 * h),
        f"{m}self_attn.o_proj.weight": (h, q),
        f"{m}mlp.gate_proj.weight": (inter, h),
        f"{m}mlp.up_proj.weight": (inter, h),
        f"{m}mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (int(cfg["draft_vocab_size"]), h),
        "d2t": (int(cfg["draft_vocab_size"]),),
        "t2d": (int(cfg["vocab_size"]),),
    }


def _target_final_norm(target_dir: Path, hidden: int) -> torch.Tensor:
    files = tensor_files(target_dir)
    name = next((n for n in ("model.norm.weight", "norm.weight") if n in files), None)
    return torch.ones(hidden) if name is None else _read(files, name).to(torch.float32)


@torch.no_grad()
def init_eagle3(target_dir: str | Path, draft_vocab_size: int | None = None,
                counts: Sequence[float] | torch.Tensor | None = None, seed: int = 0,
                init: str = "passthrough") -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, float32 tensors)`` of a fresh EAGLE3 drafter for the target folder.

    ``normal``: linear weights ~ N(0, initializer_range), norms 1, ``lm_head`` the target's
    head rows of the draft vocabulary. ``passthrough`` (default): the same, then ``fc`` copies
    the highest aux row, ``o_proj``/``down_proj`` are zero and ``norm`` is the target's final
    norm, so the untrained drafter reads the logit lens of that layer (mostly the token it was
    given: it drafts the last token again) instead of random ids."""
    if init not in INIT_SCHEMES:
        raise ValueError(f"init must be one of {INIT_SCHEMES}, got {init!r}")
    target_dir = Path(target_dir)
    target = DrafterConfig.from_dir(target_dir)
    d2t, t2d = draft_vocab(target.vocab_size, draft_vocab_size, counts)
    cfg = eagle3_config(target, d2t.shape[0])
    gen = torch.Generator().manual_seed(seed)
    std = float(target.raw.get("initializer_range", 0.02))
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in eagle3_shapes(cfg).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * std
    hot = torch.arange(d2t.shape[0]) + d2t
    tensors.update(d2t=d2t, t2d=t2d, **{"lm_head.weight": load_target_head(target_dir).lm_head[hot].clone()})
    if init == "passthrough":
        h = target.hidden_size
        tensors["fc.weight"].zero_()
        tensors["fc.weight"][:, -h:] = torch.eye(h)
        tensors["midlayer.self_attn.o_proj.weight"].zero_()
        tensors["midlayer.mlp.down_proj.weight"].zero_()
        tensors["norm.weight"] = _target_final_norm(target_dir, h)
    return cfg, tensors


def save_eagle3(out_dir: str | Path, cfg: Mapping, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float tensors in ``cfg["dtype"]``).

    Each file goes to a temporary name first and is renamed, so readers never see half a file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors.index.json").exists() or (out / "pytorch_model.bin").exists():
        raise DrafterCheckpointError(f"{out} already holds other weights; sglang would read those instead")
    dtype = dtype_from_name(cfg.get("dtype", "float32"))
    data = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(data, str(tmp), metadata={"format": "pt"})
    tmp_cfg = out / "config.json.tmp"
    tmp_cfg.write_text(json.dumps(dict(cfg), indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / WEIGHTS_FILE)
    os.replace(tmp_cfg, out / "config.json")
    return out


def read_eagle3(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of an EAGLE3 drafter folder, checked: every tensor present with its
    shape, and d2t/t2d one consistent mapping (DrafterCheckpointError with the reason)."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("architectures") != [EAGLE3_ARCHITECTURE]:
        raise DrafterCheckpointError(f"{folder} is not an EAGLE3 drafter: architectures {cfg.get('architectures')}")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    tensors = {n.removeprefix("model."): t for n, t in tensors.items()}
    tensors = {specforge_name(n): t for n, t in tensors.items()}
    for name, shape in eagle3_shapes(cfg).items():
        if name not in tensors:
            raise DrafterCheckpointError(f"{folder} lacks {name}")
        if tuple(tensors[name].shape) != shape:
            raise DrafterCheckpointError(f"{name}: shape {tuple(tensors[name].shape)} != expected {shape}")
    d2t, t2d = tensors["d2t"], tensors["t2d"].to(torch.bool)
    _, mapped = vocab_map(torch.arange(d2t.shape[0]) + d2t.to(torch.int64), t2d.shape[0])
    if not torch.equal(t2d, mapped):
        raise DrafterCheckpointError("t2d does not mark exactly the target ids of d2t")
    return cfg, tensors
