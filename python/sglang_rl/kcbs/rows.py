"""Beams in a token table (row r, position i -> the KV slot holding that token): forked in place
between steps, and their slots dealt back so that freeing the rows frees every slot once.

Between steps a beam slot j takes over the row of the beam it extends (index sharing, no KV
copy). After forks a slot can be referenced by several rows or by none, so the slot each beam
wrote at each step is recorded, and written back before the rows are freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class BeamRows:
    """Where one search's beams sit in the table at a step."""

    rows: list[int]
    """The table row of each beam slot."""
    start: int
    """The first beam position (the prompt's positions are shared and never forked)."""
    newest: int
    """The position each beam wrote at this step."""
    parents: Optional[list[int]]
    """Slot j takes the row of slot parents[j] over [start, newest]; None: no fork (the search ended)."""


def fork_rows(table: Tensor, groups: list[BeamRows]) -> list[Tensor]:
    """Read the slot each beam wrote at its newest position, then fork the rows: one gather and
    one scatter for all groups. Returns the slots read, one tensor per group."""
    width = table.shape[1]
    flat = table.view(-1)
    newest, src, dst = [], [], []
    for g in groups:
        newest.extend(row * width + g.newest for row in g.rows)
        for j, parent in enumerate(g.parents or ()):
            if parent != j:
                src.extend(range(g.rows[parent] * width + g.start, g.rows[parent] * width + g.newest + 1))
                dst.extend(range(g.rows[j] * width + g.start, g.rows[j] * width + g.newest + 1))
    slots = flat[torch.tensor(newest, device=table.device)]
    out, at = [], 0
    for g in groups:
        out.append(slots[at:at + len(g.rows)])
        at += len(g.rows)
    if dst:
        flat[torch.tensor(dst, device=table.device)] = flat[torch.tensor(src, device=table.device)]
    return out


def return_slots(table: Tensor, rows: list[int], start: int, owned: list[Tensor]) -> None:
    """Write the slots recorded per step (`owned[s][i]`: beam i's slot at step s) back into the
    rows at positions start + s, so that each slot is in exactly one row again."""
    width = table.shape[1]
    steps = len(owned)
    dst = [row * width + start + i for row in rows for i in range(steps)]
    table.view(-1)[torch.tensor(dst, device=table.device)] = torch.stack(owned).t().reshape(-1)
