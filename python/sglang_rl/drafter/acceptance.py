"""Acceptance per chain position from sglang's per-request histogram of accepted drafts.

sglang 0.5.17 returns ``meta_info["spec_correct_drafts_histogram"]`` for every speculative
request: entry ``k`` counts the verify steps that accepted exactly ``k`` draft tokens (greedy
chain drafting accepts a prefix, so a step that accepted ``k`` accepted positions ``1..k``).
The accept rate at draft position ``j`` is the share of the steps that reached position ``j``
(accepted ``>= j - 1``) that also accepted it (``>= j``). :func:`at_least_rates` is the
unconditional share: of all verify steps, those that accepted at least ``k`` drafts.
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["at_least_rates", "merge_histograms", "position_accept_rates", "tokens_per_step"]


def merge_histograms(histograms: Iterable[Sequence[int] | None]) -> list[int]:
    """Sum per-request histograms of possibly different lengths (None / empty: no steps)."""
    total: list[int] = []
    for hist in histograms:
        for k, count in enumerate(hist or ()):
            if k >= len(total):
                total.extend([0] * (k + 1 - len(total)))
            total[k] += int(count)
    return total


def position_accept_rates(histogram: Sequence[int], positions: int) -> list[float | None]:
    """Accept rate at draft positions ``1..positions``; None where no step reached a position."""
    hist = list(histogram) + [0] * max(0, positions + 1 - len(histogram))
    if any(c < 0 for c in hist):
        raise ValueError(f"histogram counts must be >= 0, got {list(histogram)}")
    rates: list[float | None] = []
    for j in range(1, positions + 1):
        reached = sum(hist[j - 1:])
        rates.append(sum(hist[j:]) / reached if reached else None)
    return rates


def tokens_per_step(histogram: Sequence[int]) -> float | None:
    """Mean tokens per verify step, the accepted drafts plus the target's own token."""
    steps = sum(histogram)
    return 1 + sum(k * c for k, c in enumerate(histogram)) / steps if steps else None


def at_least_rates(histogram: Sequence[int]) -> list[float]:
    """For draft positions ``k = 1..len(histogram) - 1``: the share of verify steps that accepted
    at least ``k`` drafts (empty without steps)."""
    steps = sum(histogram)
    if any(c < 0 for c in histogram):
        raise ValueError(f"histogram counts must be >= 0, got {list(histogram)}")
    return [sum(histogram[k:]) / steps for k in range(1, len(histogram))] if steps else []
