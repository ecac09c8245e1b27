"""Break-even table of the speculation switch: batch size -> tokens per verify step where drafting pays.

File format (JSON, written by benchmark/bench_spec_curve.py --switch-table):
    {"break_even_tokens_per_step": {"1": 1.51, "8": 1.78, "32": 2.61, "64": null}, "description": "..."}
A null entry means drafting never pays at that batch size. Between entries the break-even is
interpolated linearly; below the first entry the first one holds; above the last entry that has a
value (the last drafting entry) drafting is off.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

KEY = "break_even_tokens_per_step"
DEFAULT_TABLE = {
    "description": "EAGLE (3 steps, top-1) against plain decoding, 8B-shaped Llama pair, one NVIDIA H200 "
                   "(docs/results/gpu_h200_spec_curve.txt); for H100/H200-class GPUs",
    KEY: {"1": 1.51, "8": 1.78, "32": 2.614, "64": None},
}
"""The shipped table (a module constant, so that every install has it)."""


class BreakEvenTable:
    """Sorted (batch size, break-even tokens per step or None) entries."""

    def __init__(self, entries: dict[int, Optional[float]], description: str = "") -> None:
        if not entries:
            raise ValueError("a break-even table needs at least one entry")
        for batch, value in entries.items():
            if int(batch) < 1 or (value is not None and (not math.isfinite(value) or value < 0)):
                raise ValueError(f"bad break-even entry {batch}: {value}")
        self.entries = sorted((int(b), None if v is None else float(v)) for b, v in entries.items())
        self.description = description
        drafting = [b for b, v in self.entries if v is not None]
        self.max_drafting_batch = drafting[-1] if drafting else 0

    @classmethod
    def load(cls, path: str | Path | None = None) -> "BreakEvenTable":
        """The table in `path` (the shipped H100/H200 table when None)."""
        data = DEFAULT_TABLE if path is None else json.loads(Path(path).read_text())
        if KEY not in data:
            raise ValueError(f"{path}: no {KEY!r} field")
        return cls({int(k): v for k, v in data[KEY].items()}, data.get("description", ""))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict:
        return {"description": self.description, KEY: {str(b): v for b, v in self.entries}}

    def break_even(self, batch_size: int) -> Optional[float]:
        """Tokens per verify step from which drafting pays at `batch_size`; None: it never does."""
        if batch_size > self.max_drafting_batch:
            return None
        prev = None
        for batch, value in self.entries:
            if batch == batch_size or (prev is None and batch > batch_size):
                return value
            if batch > batch_size:
                b0, v0 = prev
                if v0 is None or value is None:  # a never-pays gap: the nearer side decides
                    return v0 if batch_size - b0 <= batch - batch_size else value
                return v0 + (value - v0) * (batch_size - b0) / (batch - b0)
            prev = (batch, value)
        return prev[1] if prev else None
