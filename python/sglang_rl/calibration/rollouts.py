"""Saved rollouts for calibrating across hosts: a generator's responses written on one host,
verified on another (a verifier on another GPU type), into the records of ``measure``.

A rollouts file holds JSON lines (gzip when the name ends in .gz), one response each:
``{"config", "honest", "prompt", "input_ids", "output_ids", "fingerprint", "max_tokens",
"generator_gpu"}``. A record made from one adds ``generator_config``, ``generator_gpu``,
``verifier_config`` and ``verifier_gpu``, so that records of both hosts fit in one
``sglang-rl calibrate --stats`` run and say which pairing each came from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sglang_rl.calibration.jsonl import json_lines, write_json_lines
from sglang_rl_client import Rollout, VerifierClient

ROLLOUT_KEYS = ("config", "honest", "prompt", "input_ids", "output_ids", "fingerprint")


def gpu_name(index: int = 0) -> str:
    """The name of GPU ``index`` as nvidia-smi reports it (after CUDA_VISIBLE_DEVICES), else
    torch's, else ``cpu`` when this host has no GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    physical = visible.split(",")[index] if visible.strip() else str(index)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", physical],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(index)
    except ImportError:
        pass
    return "cpu"


def gpu_label(name: str) -> str:
    """A short label of a GPU name: ``NVIDIA H100 80GB HBM3`` -> ``H100``, ``cpu`` -> ``cpu``."""
    words = [w for w in name.split() if w.upper() != "NVIDIA"]
    return words[0] if words else name


def write_rollouts(rollouts: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Save rollouts as JSON lines, gzip-compressed when the name ends in .gz."""
    write_json_lines(rollouts, path, separators=(",", ":"))


def rollout_files(paths: Iterable[str | Path]) -> list[Path]:
    """The rollouts files named: each path a file, or a folder of ``*.jsonl`` / ``*.jsonl.gz``
    files (sorted). Raises ValueError for a path that is neither, or a folder without any."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
            if not found:
                raise ValueError(f"{path}: no *.jsonl or *.jsonl.gz rollouts files in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such file or folder")
    return files


def read_rollouts(path: str | Path) -> list[dict[str, Any]]:
    """The rollouts of one file; raises ValueError naming the line that lacks a field."""
    out = []
    for number, row in json_lines(path):
        missing = [k for k in ROLLOUT_KEYS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{number}: a rollout needs {', '.join(missing)}")
        out.append(row)
    return out


def cross_config(generator_config: str, generator_gpu: str, verifier_config: str, verifier_gpu: str) -> str:
    """The ``config`` of a record whose rollout was verified elsewhere, e.g.
    ``fp8_weights:H100>verifier:H200`` (cheats are reported per config)."""
    return f"{generator_config}:{gpu_label(generator_gpu)}>{verifier_config}:{gpu_label(verifier_gpu)}"


def verify_saved(
    verifier: str, rollouts: Sequence[dict[str, Any]], verifier_config: str, verifier_gpu: str,
    batch: int = 16, timeout: float = 1800.0,
) -> list[dict[str, Any]]:
    """Verify saved rollouts on ``verifier`` (``batch`` requests in flight, one response each, as
    when they were generated); one record per rollout, in order."""
    check = VerifierClient(verifier, timeout=timeout)

    def one(row: dict[str, Any]) -> dict[str, Any]:
        report = check.verify(Rollout(row["input_ids"], row["output_ids"], row["fingerprint"]))
        gen_gpu = row.get("generator_gpu", "unknown")
        return {"config": cross_config(row["config"], gen_gpu, verifier_config, verifier_gpu),
                "honest": bool(row["honest"]), "prompt": row["prompt"],
                "generator_config": row["config"], "generator_gpu": gen_gpu,
                "verifier_config": verifier_config, "verifier_gpu": verifier_gpu, **report}

    with ThreadPoolExecutor(batch) as pool:
        return list(pool.map(one, rollouts))
