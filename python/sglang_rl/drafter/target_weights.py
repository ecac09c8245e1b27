"""Read the target model's token embedding and LM head from its safetensors files.

The drafter never owns these two matrices: sglang's EAGLE worker hands the target's
embedding and head to the draft model at start-up, so training uses the same frozen
tensors. Only these two tensors are read (``safe_open``), never the whole checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["TargetHead", "load_target_head"]

_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")
_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")


@dataclass(frozen=True)
class TargetHead:
    """The target's ``embed [V, H]`` and ``lm_head [V, H]``; the same tensor when tied."""

    embed: torch.Tensor
    lm_head: torch.Tensor

    @property
    def tied(self) -> bool:
        """True when embedding and head are one tensor."""
        return self.embed is self.lm_head


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``model_dir`` that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update({name: path for name in f.keys()})
    return out


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(model_dir: str | Path, dtype: torch.dtype | None = torch.float32) -> TargetHead:
    """Load the target folder's embedding and LM head (tied when the config or the files say so).

    ``dtype`` converts both (default float32, the CPU training dtype); ``None`` keeps the
    checkpoint dtype.
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    files = tensor_files(model_dir)
    embed_name = next((n for n in _EMBED_NAMES if n in files), None)
    if embed_name is None:
        raise KeyError(f"{model_dir} has no token embedding (looked for {_EMBED_NAMES})")
    embed = _read(files, embed_name)
    if dtype is not None:
        embed = embed.to(dtype)
    head_name = next((n for n in _HEAD_NAMES if n in files), None)
    tied = config.get("tie_word_embeddings")
    if tied is True or (tied is None and head_name is None):
        return TargetHead(embed=embed, lm_head=embed)
    if head_name is None:
        raise KeyError(f"{model_dir} says tie_word_embeddings=false but has no lm_head.weight")
    head = _read(files, head_name)
    if dtype is not None:
        head = head.to(dtype)
    return TargetHead(embed=embed, lm_head=head)
