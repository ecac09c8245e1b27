"""Reading a model folder's tensors one at a time and writing a wide one shard by shard.

The wide 8B folder is ~15 GB in bf16: :class:`ShardWriter` holds at most one shard in memory and
writes it as soon as it is full, so a folder is built without holding the model, let alone twice.
The folder is written beside its destination under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_rl.drafter.target_weights import tensor_files

__all__ = ["COPIED_FILES", "ShardWriter", "copy_side_files", "finish_folder", "read_tensors", "staging_folder", "tensor_files"]

# tokenizer and generation files a model folder carries beside its weights
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
MARK_KEY = "sglang_rl_widened"  # config.json key that marks (and describes) a widened model


def read_tensors(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (read one by one, never whole files)."""
    out = {}
    for name in names:
        with safe_open(str(files[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and generation files of ``src`` that exist; returns their names."""
    copied = []
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def staging_folder(out: Path) -> Path:
    """A fresh temporary folder beside ``out``; ValueError if ``out`` is a non-empty folder that is
    not a widened model (a rebuild replaces only its own kind)."""
    if out.exists():
        cfg = out / "config.json"
        entries = list(out.iterdir()) if out.is_dir() else [out]
        ours = cfg.is_file() and MARK_KEY in json.loads(cfg.read_text())
        if entries and not ours:
            raise ValueError(f"{out} exists and is not a widened model folder; choose a new path")
    tmp = out.with_name(f".{out.name}.building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_folder(tmp: Path, out: Path) -> Path:
    """Move the finished ``tmp`` to ``out`` (replacing a previous build there)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


class ShardWriter:
    """Collects tensors and writes ``model-0000i-of-0000N.safetensors`` shards of at most
    ``shard_bytes`` (one tensor may exceed it) plus ``model.safetensors.index.json``; a model that
    fits in one shard is written as ``model.safetensors``."""

    def __init__(self, folder: Path, shard_bytes: int = 2 << 30) -> None:
        self.folder, self.shard_bytes = folder, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _path(self, i: int) -> Path:
        return self.folder / f"part-{i:05d}.safetensors"

    def flush(self) -> None:
        if not self.pending:
            return
        save_file(self.pending, str(self._path(len(self.shards))), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is left, name the shards, write the index; returns the file names."""
        self.flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self._path(0), self.folder / "model.safetensors")
            return ["model.safetensors"]
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(self._path(i), self.folder / name)
        weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names
