"""Widen a Llama model folder (SmolLM2-135M) into a larger Llama shape with the same function.

What the wide model computes on its real dims is what the small one computes (see shape.py for
the layout of hidden dims and heads):

* embeddings: the small rows in the real dims (and their copies); vocabulary unchanged, tied as
  the small model's are;
* layer ``n < L``: q/k/v read the real dims of the normed input; query head ``r`` of group ``g``
  lands in wide head ``g * G + r`` with rotate-half pair ``i`` at pair ``k * i`` and queries times
  ``sqrt(D/d)``; k/v keep their group; ``o_proj`` columns of unused heads are zero; MLP rows and
  columns past the small ones are zero; ``o_proj``/``down_proj`` write the real dims and copies;
* layers ``L..L'-1``: zero projections, so they pass the residual stream through;
* norms: weights on the real dims (times ``sqrt(h/H)`` and ``rms_norm_eps`` times ``h/H`` when the
  padding is zeros), zero elsewhere.

:func:`widen_model` streams it: one layer at a time is read, widened and handed to the shard writer.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from sglang_rl.widen.shape import HeadMap, HiddenLayout, Shape, WidenError
from sglang_rl.widen.tensors import DecoderLayerMap, widen_embedding, widen_norm
from sglang_rl.widen.writer import (
    MARK_KEY,
    ShardWriter,
    copy_side_files,
    finish_folder,
    read_tensors,
    staging_folder,
    tensor_files,
)

__all__ = ["DTYPES", "check_small_config", "widen_model", "widened_config", "widening_of"]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def check_small_config(cfg: Mapping[str, Any]) -> None:
    """WidenError for a model this construction does not cover."""
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in (cfg.get("architectures") or []):
        raise WidenError(f"only Llama models can be widened (model_type {cfg.get('model_type')!r})")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise WidenError("partial rotary embeddings are not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise WidenError("attention or MLP biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise WidenError(f"hidden_act {cfg.get('hidden_act')!r} is not supported")


def widened_config(small_cfg: Mapping[str, Any], wide: Shape, layout: HiddenLayout, dtype: str) -> dict:
    """The wide model's ``config.json``: the small one's with the wide sizes, the layout's
    ``rms_norm_eps`` and a record of the widening under ``sglang_rl_widened``."""
    small = Shape.from_config(small_cfg)
    cfg = copy.deepcopy(dict(small_cfg))
    for key in ("_model_name_or_path", "_name_or_path"):
        cfg.pop(key, None)
    cfg.update(wide.__dict__)
    cfg["rms_norm_eps"] = float(small_cfg.get("rms_norm_eps", 1e-6)) * layout.eps_scale
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        cfg["layer_types"] = (cfg["layer_types"] + [cfg["layer_types"][-1]] * wide.num_hidden_layers)[
            : wide.num_hidden_layers]
    cfg[MARK_KEY] = {"from": small.__dict__, "rms_norm_eps": float(small_cfg.get("rms_norm_eps", 1e-6)),
                     **layout.to_json()}
    return cfg


def widening_of(wide_cfg: Mapping[str, Any]) -> tuple[Shape, Shape, HiddenLayout]:
    """``(small shape, wide shape, hidden layout)`` of a widened model's config."""
    mark = wide_cfg.get(MARK_KEY)
    if not isinstance(mark, Mapping):
        raise WidenError(f"the config has no {MARK_KEY!r} record: not a widened model")
    small, wide = Shape(**mark["from"]), Shape.from_config(wide_cfg)
    return small, wide, HiddenLayout(small.hidden_size, wide.hidden_size, tuple(mark.get("copies", ())))


def widen_model(src: str | Path, out: str | Path, wide: Shape, layout: str = "copies", dtype: str | None = None,
                shard_bytes: int = 2 << 30, progress: bool = True,
                log: Callable[[str], None] | None = None) -> Path:
    """Write the widened folder of the model at ``src`` to ``out``; returns ``out``.

    ``layout``: ``copies`` (exact norms where the shape has room) or ``zeros``; ``dtype``: of the
    written weights (default: the small model's)."""
    src, out = Path(src), Path(out)
    small_cfg = json.loads((src / "config.json").read_text())
    check_small_config(small_cfg)
    small = Shape.from_config(small_cfg)
    wide.check_holds(small)
    dtype = dtype or str(small_cfg.get("dtype") or small_cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype not in DTYPES:
        raise WidenError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    hidden = HiddenLayout.make(small.hidden_size, wide.hidden_size, layout)
    tmp = staging_folder(out)
    try:
        _write(src, tmp, small_cfg, wide, hidden, dtype, shard_bytes, progress, log)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed build leaves nothing behind
        raise
    return finish_folder(tmp, out)


def _write(src: Path, tmp: Path, small_cfg: dict, wide: Shape, hidden: HiddenLayout, dtype: str, shard_bytes: int,
           progress: bool, log: Callable[[str], None] | None) -> None:
    """Stream the widened tensors, config and side files of the model at ``src`` into ``tmp``."""
    small, torch_dtype = Shape.from_config(small_cfg), DTYPES[dtype]
    layer_map = DecoderLayerMap(HeadMap(small, wide), hidden, torch_dtype)
    files = tensor_files(src)
    tied = bool(small_cfg.get("tie_word_embeddings", "lm_head.weight" not in files))
    writer = ShardWriter(tmp, shard_bytes)
    embed = read_tensors(files, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    writer.add("model.embed_tokens.weight", widen_embedding(embed, hidden, torch_dtype))
    if not tied:
        head = read_tensors(files, ["lm_head.weight"])["lm_head.weight"]
        writer.add("lm_head.weight", widen_norm_free_head(head, hidden, torch_dtype))
    layers = range(wide.num_hidden_layers)
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc=f"widening to {wide.hidden_size} wide", unit="layer")
    for n in layers:
        names = [f"model.layers.{n}.{t}" for t in LAYER_TENSORS]
        if n < small.num_hidden_layers:
            for name, tensor in read_tensors(files, names).items():
                writer.add(name, layer_map(name, tensor))
        else:
            for name, tensor in layer_map.empty_layer(names, torch.ones(small.hidden_size)).items():
                writer.add(name, tensor)
    norm = read_tensors(files, ["model.norm.weight"])["model.norm.weight"]
    writer.add("model.norm.weight", widen_norm(norm, hidden, torch_dtype))
    shards = writer.close()
    (tmp / "config.json").write_text(json.dumps(widened_config(small_cfg, wide, hidden, dtype), indent=2) + "\n")
    copy_side_files(src, tmp)
    if log:
        log(f"{len(shards)} shard(s), {writer.total_bytes / 2**30:.2f} GiB, layout {hidden.name}")


def widen_norm_free_head(head: torch.Tensor, layout: HiddenLayout, dtype: torch.dtype) -> torch.Tensor:
    """An untied LM head ``[V, h]`` -> ``[V, H]``: it reads the final norm's output, whose copies are
    zero, so only the real dims are filled."""
    out = torch.zeros((head.shape[0], layout.wide), dtype=dtype)
    out[:, : layout.small] = head.to(dtype)
    return out
