"""SmolLM2-135M with its attention heads padded so that tensor parallelism of 2 can split them.

SmolLM2-135M has 9 query heads over 3 key/value heads, which TP=2 cannot divide. Appending 3 query
heads and 1 key/value head whose projections are zero (and whose output-projection columns are
zero) gives 12 over 4 heads, the same grouping of 3, and the same function: a zero query over zero
keys attends uniformly to zero values, and zero columns of `o_proj` drop the result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def widen_heads(src: Path, dst: Path, heads: int = 12, kv_heads: int = 4) -> Path:
    """Write `src` with `heads` query and `kv_heads` key/value heads (zero-padded) to `dst`."""
    config = json.loads((src / "config.json").read_text())
    head_dim = config["head_dim"]
    old_heads, old_kv = config["num_attention_heads"], config["num_key_value_heads"]
    if heads // kv_heads != old_heads // old_kv or heads < old_heads or kv_heads < old_kv:
        raise ValueError(f"{heads}/{kv_heads} heads do not extend {old_heads}/{old_kv} group-wise")
    weights = load_file(str(src / "model.safetensors"))
    for name, tensor in list(weights.items()):
        if name.endswith("self_attn.q_proj.weight"):
            extra = tensor.new_zeros((heads - old_heads) * head_dim, tensor.shape[1])
            weights[name] = torch.cat([tensor, extra])
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            extra = tensor.new_zeros((kv_heads - old_kv) * head_dim, tensor.shape[1])
            weights[name] = torch.cat([tensor, extra])
        elif name.endswith("self_attn.o_proj.weight"):
            extra = tensor.new_zeros(tensor.shape[0], (heads - old_heads) * head_dim)
            weights[name] = torch.cat([tensor, extra], dim=1)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, dst / path.name)
    config.update(num_attention_heads=heads, num_key_value_heads=kv_heads)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst
