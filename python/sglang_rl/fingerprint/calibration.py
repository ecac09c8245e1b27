"""Per-model calibration of the TOPLOC thresholds: the rule that fits them, and the file.

The file format (``Calibration``, its validation, ``load_calibration``) and the bounds it gives
(``Thresholds``, ``ThresholdPolicy``) are pure Python and live in the client package
(``sglang_rl_client.calibration``, which documents the file); they are re-exported here. This
module adds what a server and ``sglang-rl calibrate`` need: the rule that picks bounds from honest
measurements, writing a file, and reading one once per process.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist

from sglang_rl.fingerprint.verify import NOTHING_MATCHED, ChunkResult
from sglang_rl_client.calibration import (  # noqa: F401 - the plugin's names for the shared format
    BOUND_NAMES,
    CALIBRATION_FORMAT,
    CALIBRATION_VERSION,
    STATISTICS,
    UNCALIBRATED,
    Calibration,
    CalibrationError,
    ScoreHistogram,
    ThresholdPolicy,
    Thresholds,
    calibration_from_dict,
    load_calibration,
)

UNITS = {"exp_mismatches": 1.0, "mant_err_mean": 0.25, "mant_err_median": 0.5}
"""The margin above the honest maximum: one mismatch, a quarter and a half mantissa step."""

MIN_SAMPLES = 10


@lru_cache(maxsize=8)
def cached_policy(path: str) -> ThresholdPolicy:
    """The threshold policy of a calibration file, read once per process (server use)."""
    return load_calibration(path).policy(path)


def save_calibration(calibration: Calibration, path: str | Path) -> None:
    """Write a calibration file (validated by reading it back first, so a bad one is never saved)."""
    doc = calibration.to_dict()
    calibration_from_dict(json.loads(json.dumps(doc)))
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


# --------------------------------------------------------------------------------------------
# the threshold rule


def per_check_budget(false_rejection_budget: float, full_chunks_per_response: int) -> float:
    """The false-rejection budget of one statistic of one chunk: the per-response budget split
    evenly (union bound) over the 3 statistics of up to ``full_chunks_per_response`` full chunks
    plus one short final chunk."""
    if not 0.0 < false_rejection_budget < 1.0:
        raise ValueError(f"false_rejection_budget must lie in (0, 1), got {false_rejection_budget}")
    return false_rejection_budget / (3 * (max(1, full_chunks_per_response) + 1))


def choose_bound(values: Sequence[float], check_budget: float, unit: float) -> float:
    """One bound from the honest values of one statistic.

    Rule: ``max(mean + z * sd, honest_max + unit)`` where z is the standard normal quantile of
    ``1 - check_budget``. The first term is a normal-tail estimate of the value that an honest
    chunk exceeds with probability ``check_budget``; the second keeps every measured honest value
    strictly inside the bound with at least one unit of margin, which is what decides the bound
    when the honest values are too concentrated (or too few) for the normal estimate.
    """
    if len(values) < MIN_SAMPLES:
        raise CalibrationError(f"{len(values)} honest values, at least {MIN_SAMPLES} are needed")
    if any(v >= NOTHING_MATCHED or not math.isfinite(v) for v in values):
        raise CalibrationError(
            "an honest chunk matched nothing (mantissa error 2**64): the honest measurement is broken"
        )
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    z = NormalDist().inv_cdf(1.0 - check_budget)
    return max(mean + z * sd, max(values) + unit)


def choose_thresholds(chunks: Sequence[ChunkResult], check_budget: float) -> Thresholds:
    """Bounds for one chunk class (full or short) from its honest chunk results, by
    ``choose_bound`` per statistic; the mismatch bound is rounded up to a whole count and the
    mantissa bounds up to 1/100."""
    bounds = {
        s: choose_bound([float(getattr(c, s)) for c in chunks], check_budget, UNITS[s])
        for s in STATISTICS
    }
    return Thresholds(
        max_exp_mismatches=int(math.ceil(bounds["exp_mismatches"] - 1e-9)),
        max_mant_err_mean=math.ceil(bounds["mant_err_mean"] * 100 - 1e-6) / 100,
        max_mant_err_median=math.ceil(bounds["mant_err_median"] * 100 - 1e-6) / 100,
    )


RULE_TEXT = (
    "per statistic and chunk class (full, short final chunk): bound = max(mean + z*sd, honest_max + unit), "
    "z = normal quantile of 1 - budget/(3*(full_chunks_per_response+1)), unit = 1 mismatch, "
    "0.25 (mean) or 0.5 (median) mantissa steps"
)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, max, mean, sd and the 50/90/99th percentiles (nearest rank) of some statistic's values."""
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    if not n:
        return {"n": 0}
    mean = sum(ordered) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in ordered) / (n - 1)) if n > 1 else 0.0

    def pct(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return {"n": n, "max": ordered[-1], "mean": mean, "sd": sd, "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}
