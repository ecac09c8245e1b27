"""Widen an EAGLE-1/2 or EAGLE3 drafter of a small model to the same model widened (model.py), so
that it drafts what it drafted for the small target.

EAGLE-1/2 (``LlamaForCausalLMEagle``): ``x = fc(cat(embed, h))`` reads the real dims of the token's
embedding and of the target row (the wide target's post-norm rows are the small ones padded with
zeros: its final norm weighs copies by 0). The draft's output goes straight to the target's tied
LM head, whose embedding rows carry the copies, so the draft's own stream is zero-padded: its
``post_attention_layernorm`` weight is scaled by ``sqrt(h/H)`` and its ``rms_norm_eps`` by ``h/H``.
Its layer has no input norm: q/k/v read ``x`` itself; queries are scaled as the target's are.

EAGLE3 (``LlamaForCausalLMEagle3``): ``fc`` reads the real dims of each aux row (the wide target's
residual stream), and the draft's stream has the target's layout (the embedding it normalises
carries the copies): ``fc``, ``o_proj`` and ``down_proj`` write real dims and copies, norms are the
target's kind, q/k/v read the real dims of both halves of ``cat(input_layernorm(embed),
hidden_norm(x))``, ``lm_head`` reads the real dims. The aux layer ids stay: the wide target's first
``L`` layers are the small one's. ``d2t`` / ``t2d`` are unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_rl.drafter.checkpoint import WEIGHTS_FILE, read_draft_weights
from sglang_rl.drafter.config import EAGLE3_ARCHITECTURE, DrafterConfig, dtype_from_name, dtype_name
from sglang_rl.drafter.eagle3 import eagle3_config, read_eagle3, save_eagle3
from sglang_rl.widen.model import widening_of
from sglang_rl.widen.shape import HeadMap, HiddenLayout, Shape, WidenError
from sglang_rl.widen.tensors import DecoderLayerMap, place, widen_norm
from sglang_rl.widen.writer import MARK_KEY

__all__ = ["widen_drafter", "widen_eagle3_tensors", "widen_eagle_tensors"]


def _layer_shape(cfg: dict, layers: int) -> Shape:
    return Shape.from_config({**cfg, "num_hidden_layers": layers})


def _check_matches(draft_cfg: dict, small: Shape) -> None:
    got = _layer_shape(draft_cfg, small.num_hidden_layers)
    if got != small:
        raise WidenError(f"the drafter's layer {got} is not the small target's {small}")


def widen_eagle_tensors(tensors: dict[str, torch.Tensor], small: Shape, wide: Shape,
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """EAGLE-1/2 tensors (``fc.weight``, ``fc.bias``, ``layers.0.*``) at the wide shape."""
    layout = HiddenLayout.make(small.hidden_size, wide.hidden_size, "zeros")
    big = wide.hidden_size
    both = torch.cat((layout.real(), big + layout.real()))
    layer = DecoderLayerMap(HeadMap(small, wide), layout, dtype)
    out = {}
    for name, t in tensors.items():
        if name == "fc.weight":
            out[name] = place(t, (big, 2 * big), layout.rows(), both, dtype)
        elif name == "fc.bias":
            out[name] = place(t, (big,), layout.rows(), None, dtype)
        elif name.startswith("layers.0.") and t.dim() == 2 or name.endswith("norm.weight"):
            out[name] = layer(name, t)
        else:
            raise WidenError(f"no widening rule for drafter tensor {name!r} {tuple(t.shape)}")
    return out


def widen_eagle3_tensors(tensors: dict[str, torch.Tensor], small: Shape, wide: Shape, layout: HiddenLayout,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """EAGLE3 tensors (SpecForge names: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
    ``lm_head.weight``, ``d2t``, ``t2d``) at the wide shape, in ``layout``."""
    big = wide.hidden_size
    both = torch.cat((layout.real(), big + layout.real()))
    layer = DecoderLayerMap(HeadMap(small, wide), layout, dtype, in_cols=both, in_width=2 * big)
    out = {}
    for name, t in tensors.items():
        if name in ("d2t", "t2d"):
            out[name] = t
        elif name == "fc.weight":
            n_aux = t.shape[1] // small.hidden_size
            cols = torch.cat([j * big + layout.real() for j in range(n_aux)])
            out[name] = place(t, (big, n_aux * big), layout.rows(), cols, dtype)
        elif name == "norm.weight":
            out[name] = widen_norm(t, layout, dtype)
        elif name == "lm_head.weight":
            out[name] = place(t, (t.shape[0], big), [(torch.arange(t.shape[0]), 1.0)], layout.real(), dtype)
        elif name.startswith("midlayer."):
            out[name] = layer(name, t)
        else:
            raise WidenError(f"no widening rule for EAGLE3 tensor {name!r} {tuple(t.shape)}")
    return out


def _write(out: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
    (out / "config.json.tmp").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / WEIGHTS_FILE)
    os.replace(out / "config.json.tmp", out / "config.json")
    return out


def widen_drafter(draft_dir: str | Path, wide_target: str | Path, out_dir: str | Path,
                  dtype: str | None = None) -> tuple[Path, str]:
    """Write the wide drafter of ``draft_dir`` for the widened target ``wide_target`` to ``out_dir``;
    returns ``(folder, architecture)``. ``dtype`` defaults to the drafter's."""
    draft_dir, out = Path(draft_dir), Path(out_dir)
    draft_cfg = json.loads((draft_dir / "config.json").read_text())
    wide_cfg = json.loads((Path(wide_target) / "config.json").read_text())
    small, wide, layout = widening_of(wide_cfg)
    _check_matches(draft_cfg, small)
    name = dtype_name(dtype_from_name(dtype or draft_cfg.get("dtype") or draft_cfg.get("torch_dtype") or "float32"))
    torch_dtype = dtype_from_name(name)
    target_cfg = {k: v for k, v in wide_cfg.items() if k != MARK_KEY}
    if draft_cfg.get("architectures") == [EAGLE3_ARCHITECTURE]:
        cfg, tensors = read_eagle3(draft_dir)
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        wide_draft_cfg = eagle3_config(DrafterConfig.from_dict(target_cfg), int(cfg["draft_vocab_size"]), ids, name)
        return save_eagle3(out, wide_draft_cfg, widen_eagle3_tensors(tensors, small, wide, layout, torch_dtype)), \
            EAGLE3_ARCHITECTURE
    config = DrafterConfig.from_dict(target_cfg).with_dtype(name)
    wide_draft_cfg = config.to_json_dict()
    # the draft's own stream is zero-padded whatever the target's layout (see the module docstring)
    zeros = HiddenLayout.make(small.hidden_size, wide.hidden_size, "zeros")
    wide_draft_cfg["rms_norm_eps"] = float(draft_cfg.get("rms_norm_eps", 1e-6)) * zeros.eps_scale
    tensors = widen_eagle_tensors(read_draft_weights(draft_dir), small, wide, torch_dtype)
    return _write(out, wide_draft_cfg, tensors), config.draft_architecture
