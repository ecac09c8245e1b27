"""Calibration files of the TOPLOC bounds: the format, its validation and the bounds it gives.

A calibration file is JSON written by the plugin's ``sglang-rl calibrate``. It names the model it
was measured on, the fingerprint parameters (topk, chunk size), the per-chunk bounds for full
chunks and for a short final chunk (fewer rows than the chunk size: its top-k is taken over fewer
values, so its noise differs), the per-response false-rejection budget the bounds were chosen for,
a summary of the honest and cheat statistics they came from, and the per-response score
histograms that worker-level evidence (``sglang_rl_client.evidence``) uses as its honest and
cheat distributions, and optionally ``fail_factor``: the outer bound of the verdict bands as a
multiple of the pass bound (2 when absent). Without a file a server keeps the TOPLOC authors' uncalibrated defaults.

Reading a file needs only the standard library (operators judge workers with it); fitting one is
the plugin's (``sglang_rl.fingerprint.calibration``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION_FORMAT = "sglang-rl-toploc-calibration"
CALIBRATION_VERSION = 1
UNCALIBRATED = "uncalibrated defaults"
STATISTICS = ("exp_mismatches", "mant_err_mean", "mant_err_median")
BOUND_NAMES = {
    "exp_mismatches": "max_exp_mismatches",
    "mant_err_mean": "max_mant_err_mean",
    "mant_err_median": "max_mant_err_median",
}
REFERENCE_TOPK = 128
FAIL_FACTOR = 2.0
"""The outer (fail) bound of each statistic as a multiple of its pass bound (verdict bands)."""


class CalibrationError(ValueError):
    """A calibration file is missing, malformed, or does not fit the server it is loaded into."""


@dataclass(frozen=True)
class Thresholds:
    """Acceptance bounds for one chunk; a chunk passes when every value is at most its bound."""

    max_exp_mismatches: int
    max_mant_err_mean: float
    max_mant_err_median: float

    @classmethod
    def for_topk(
        cls,
        topk: int,
        exp_mismatches_at_128: int = 38,
        mant_err_mean: float = 10.0,
        mant_err_median: float = 8.0,
    ) -> Thresholds:
        """The TOPLOC authors' bounds (38 of 128 mismatches), the mismatch bound scaled to topk."""
        if topk < 1:
            raise ValueError(f"topk must be at least 1, got {topk}")
        scaled = max(1, round(exp_mismatches_at_128 * topk / REFERENCE_TOPK))
        return cls(
            max_exp_mismatches=scaled,
            max_mant_err_mean=float(mant_err_mean),
            max_mant_err_median=float(mant_err_median),
        )


@dataclass(frozen=True)
class ThresholdPolicy:
    """The bounds a verifier applies: ``full`` for chunks of ``chunk_size`` rows, ``short`` (when
    set) for a final chunk with fewer rows, and where they came from (``source``). A chunk within
    them passes; one beyond ``fail_factor`` times a bound fails; in between it is suspect."""

    full: Thresholds
    short: Thresholds | None = None
    source: str = UNCALIBRATED
    fail_factor: float = FAIL_FACTOR

    def for_rows(self, rows: int, chunk_size: int) -> Thresholds:
        """The bounds for a chunk of ``rows`` rows."""
        if self.short is not None and rows < chunk_size:
            return self.short
        return self.full

    def outer(self, bounds: Thresholds) -> Thresholds:
        """The fail bounds that go with pass bounds ``bounds`` (``fail_factor`` times each)."""
        return scaled(bounds, self.fail_factor)


def scaled(bounds: Thresholds, factor: float) -> Thresholds:
    """``bounds`` times ``factor`` (the mismatch count rounded down: a count above the product
    is above the rounded bound)."""
    return Thresholds(
        max_exp_mismatches=int(math.floor(bounds.max_exp_mismatches * factor + 1e-9)),
        max_mant_err_mean=bounds.max_mant_err_mean * factor,
        max_mant_err_median=bounds.max_mant_err_median * factor,
    )


@dataclass(frozen=True)
class ScoreHistogram:
    """Counts of the per-response score (see ``evidence.response_score``) in bins
    ``(edges[k], edges[k+1]]`` (the first bin also holds ``edges[0]``), for the honest responses
    and for each measured cheat."""

    edges: tuple[float, ...]
    honest: tuple[int, ...]
    cheats: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (the last edge, infinity, is written as the string "inf")."""
        return {
            "edges": [e if math.isfinite(e) else "inf" for e in self.edges],
            "honest": list(self.honest),
            "cheats": {name: list(counts) for name, counts in self.cheats.items()},
        }


@dataclass(frozen=True)
class Calibration:
    """The content of a calibration file (see the module docstring)."""

    model_name: str
    model_path: str
    topk: int
    chunk_size: int
    false_rejection_budget: float
    full: Thresholds
    short: Thresholds | None
    summary: Mapping[str, Any] = field(default_factory=dict)
    histogram: ScoreHistogram | None = None
    rule: str = ""
    fail_factor: float = FAIL_FACTOR

    def policy(self, path: str | None = None) -> ThresholdPolicy:
        """The thresholds to apply, with a source naming this calibration's model (and file)."""
        where = f", file {path}" if path else ""
        return ThresholdPolicy(self.full, self.short, f"calibrated: {self.model_name}{where}", self.fail_factor)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of the file."""
        return {
            "format": CALIBRATION_FORMAT,
            "version": CALIBRATION_VERSION,
            "model": {"name": self.model_name, "path": self.model_path},
            "topk": self.topk,
            "chunk_size": self.chunk_size,
            "false_rejection_budget": self.false_rejection_budget,
            "rule": self.rule,
            "thresholds": {
                "full": asdict(self.full),
                "short": asdict(self.short) if self.short is not None else None,
            },
            "summary": dict(self.summary),
            "histogram": self.histogram.to_dict() if self.histogram is not None else None,
            "fail_factor": self.fail_factor,
        }


def _require(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise CalibrationError(f"{where}: missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CalibrationError(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")
    return value


def _thresholds(doc: Any, where: str) -> Thresholds:
    if not isinstance(doc, Mapping):
        raise CalibrationError(f"{where} must be an object with the three bounds")
    exp = _require(doc, "max_exp_mismatches", int, where)
    mean = float(_require(doc, "max_mant_err_mean", (int, float), where))
    median = float(_require(doc, "max_mant_err_median", (int, float), where))
    if exp < 0 or not (math.isfinite(mean) and mean >= 0) or not (math.isfinite(median) and median >= 0):
        raise CalibrationError(f"{where}: bounds must be finite and non-negative")
    return Thresholds(max_exp_mismatches=exp, max_mant_err_mean=mean, max_mant_err_median=median)


def _histogram(doc: Any, where: str) -> ScoreHistogram:
    if not isinstance(doc, Mapping):
        raise CalibrationError(f"{where} must be an object")
    raw_edges = _require(doc, "edges", list, where)
    edges = tuple(math.inf if e == "inf" else e for e in raw_edges)
    if len(edges) < 2 or not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in edges):
        raise CalibrationError(f"{where}: edges must be at least two numbers")
    edges = tuple(float(e) for e in edges)
    if edges[0] != 0.0 or edges[-1] != math.inf or any(b <= a for a, b in zip(edges, edges[1:])):
        raise CalibrationError(f"{where}: edges must rise strictly from 0 to \"inf\"")

    def counts(value: Any, name: str) -> tuple[int, ...]:
        if (
            not isinstance(value, list)
            or len(value) != len(edges) - 1
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value)
        ):
            raise CalibrationError(
                f"{where}: {name} must be {len(edges) - 1} non-negative integer counts"
            )
        return tuple(value)

    honest = counts(_require(doc, "honest", list, where), "honest")
    if not sum(honest):
        raise CalibrationError(f"{where}: the honest histogram is empty")
    cheats = _require(doc, "cheats", dict, where)
    return ScoreHistogram(
        edges=edges,
        honest=honest,
        cheats={str(name): counts(c, f"cheats[{name!r}]") for name, c in cheats.items()},
    )


def calibration_from_dict(doc: Any, where: str = "calibration") -> Calibration:
    """Validate a parsed calibration document; raise CalibrationError naming the first problem."""
    if not isinstance(doc, Mapping):
        raise CalibrationError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != CALIBRATION_FORMAT:
        raise CalibrationError(f"{where}: not a calibration file (format must be {CALIBRATION_FORMAT!r})")
    version = doc.get("version")
    if version != CALIBRATION_VERSION:
        raise CalibrationError(
            f"{where}: calibration version {version!r}, this sglang-rl reads version {CALIBRATION_VERSION}"
        )
    model = _require(doc, "model", dict, where)
    name = _require(model, "name", str, f"{where}: model")
    path = _require(model, "path", str, f"{where}: model")
    topk = _require(doc, "topk", int, where)
    chunk_size = _require(doc, "chunk_size", int, where)
    if not 1 <= topk <= 4096:
        raise CalibrationError(f"{where}: topk must be in 1..4096, got {topk}")
    if not 1 <= chunk_size <= 255:
        raise CalibrationError(f"{where}: chunk_size must be in 1..255, got {chunk_size}")
    budget = float(_require(doc, "false_rejection_budget", (int, float), where))
    if not 0.0 < budget < 1.0:
        raise CalibrationError(f"{where}: false_rejection_budget must lie in (0, 1), got {budget}")
    bounds = _require(doc, "thresholds", dict, where)
    full = _thresholds(bounds.get("full"), f"{where}: thresholds.full")
    short = bounds.get("short")
    short_t = None if short is None else _thresholds(short, f"{where}: thresholds.short")
    summary = doc.get("summary", {})
    if not isinstance(summary, Mapping):
        raise CalibrationError(f"{where}: summary must be an object")
    hist = doc.get("histogram")
    fail_factor = doc.get("fail_factor", FAIL_FACTOR)
    if (not isinstance(fail_factor, (int, float)) or isinstance(fail_factor, bool)
            or not math.isfinite(fail_factor) or fail_factor <= 1.0):
        raise CalibrationError(f"{where}: fail_factor must be a number above 1, got {fail_factor!r}")
    return Calibration(
        model_name=name,
        model_path=path,
        topk=topk,
        chunk_size=chunk_size,
        false_rejection_budget=budget,
        full=full,
        short=short_t,
        summary=summary,
        histogram=None if hist is None else _histogram(hist, f"{where}: histogram"),
        rule=str(doc.get("rule", "")),
        fail_factor=float(fail_factor),
    )


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file; raise CalibrationError with the path and the reason."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CalibrationError(f"cannot read the calibration file {path}: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"the calibration file {path} is not JSON: {exc}") from None
    return calibration_from_dict(doc, where=f"calibration file {path}")
