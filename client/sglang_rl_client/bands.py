"""Verdict bands: each verified response is ``pass``, ``suspect`` or ``fail``, and a worker is
judged by how its bands add up, so that one outlier never convicts anyone.

* ``pass``: every check within its bound (the only band with ``verified: true``);
* ``suspect``: a fingerprint chunk beyond its pass bound but within ``fail_factor`` times it
  (honest noise does this rarely; the calibration's budget bounds how rarely);
* ``fail``: a chunk beyond the outer bound, a requested token check (greedy, sampling) or the
  termination check failed, or the check could not run (``error``).

``BandEvidence`` turns a worker's bands into a verdict with a CUSUM of fixed steps: a suspect
adds ``u``, a fail ``1.5 u`` and a pass takes off a little, where ``u = log(1/alpha) / 3``; the
worker is rejected once the sum reaches ``log(1/alpha)``: three suspects or two fails in a row,
never one response. The pass step is chosen so that ``E[exp(step)] = 1`` for a worker whose
responses are suspect with probability ``honest_suspect_rate`` and fail with probability
``honest_fail_rate``; ``exp(S)`` is then a supermartingale for any honest worker at or below those
rates, and Ville's inequality bounds its rejection within N responses by ``alpha * (1 + N * floor)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

PASS, SUSPECT, FAIL = "pass", "suspect", "fail"
BANDS = (PASS, SUSPECT, FAIL)
FAIL_WEIGHT = 1.5
"""A fail's step in units of a suspect's (two fails reject, one never does)."""


def worst(*bands: str) -> str:
    """The most severe of some bands (fail over suspect over pass)."""
    return max(bands, key=BANDS.index, default=PASS)


def band_of_score(score: float, fail_factor: float) -> str:
    """The band of a response score (worst chunk statistic over its pass bound; see
    ``evidence.response_score``): pass up to 1, suspect up to ``fail_factor``, fail beyond."""
    if score <= 1.0:
        return PASS
    return SUSPECT if score <= fail_factor else FAIL


def band_of_report(report: Mapping[str, Any]) -> Optional[str]:
    """The band a verifier gave a response (its ``verdict``); for a report of a server without
    bands, pass when ``verified`` and fail when not. None for a report whose check did not run
    (an ``error``): it says nothing about the worker's model."""
    if "error" in report:
        return None
    verdict = report.get("verdict")
    if verdict in BANDS:
        return verdict
    return PASS if report.get("verified") is True else FAIL


@dataclass
class BandEvidence:
    """Running band evidence about one worker (see the module docstring)."""

    false_accusation_rate: float = 1e-3
    honest_suspect_rate: float = 1e-3
    honest_fail_rate: float = 1e-4
    floor: float = 1e-4
    responses_to_reject: int = 3
    statistic: float = 0.0
    counts: dict = field(default_factory=lambda: {band: 0 for band in BANDS})
    rejected_at: Optional[int] = None

    def __post_init__(self) -> None:
        if not 0.0 < self.false_accusation_rate < 1.0 or self.responses_to_reject < 2:
            raise ValueError("false_accusation_rate must lie in (0, 1) and responses_to_reject be at least 2")
        unit = self.unit
        honest = self.honest_suspect_rate * math.exp(unit) + self.honest_fail_rate * math.exp(FAIL_WEIGHT * unit)
        if self.honest_suspect_rate < 0 or self.honest_fail_rate < 0 or honest >= 1.0:
            raise ValueError(
                f"honest suspect and fail rates {self.honest_suspect_rate} and {self.honest_fail_rate} are too "
                "high for a test that rejects at the third suspect")

    @property
    def unit(self) -> float:
        """A suspect's step: a third of the rejection level (with ``responses_to_reject`` 3)."""
        return -math.log(self.false_accusation_rate) / self.responses_to_reject

    @property
    def steps(self) -> dict[str, float]:
        """The statistic's step per band."""
        rate_s, rate_f = self.honest_suspect_rate, self.honest_fail_rate
        up = rate_s * math.exp(self.unit) + rate_f * math.exp(FAIL_WEIGHT * self.unit)
        return {PASS: math.log((1.0 - up) / (1.0 - rate_s - rate_f)), SUSPECT: self.unit,
                FAIL: FAIL_WEIGHT * self.unit}

    @property
    def responses(self) -> int:
        """Responses counted (those whose check ran)."""
        return sum(self.counts.values())

    def add(self, band: str) -> None:
        """Account for one response's band."""
        if band not in BANDS:
            raise ValueError(f"unknown band {band!r}")
        self.counts[band] += 1
        self.statistic = max(math.log(self.floor), self.statistic + self.steps[band])
        if self.rejected_at is None and self.statistic >= -math.log(self.false_accusation_rate) - 1e-9:
            self.rejected_at = self.responses

    @property
    def rejected(self) -> bool:
        """Whether the worker has been rejected (final)."""
        return self.rejected_at is not None

    def honest_bound(self, responses: int) -> float:
        """Upper bound on P(an honest worker is rejected within ``responses`` responses)."""
        return min(1.0, self.false_accusation_rate * (1 + responses * self.floor))

    def state(self) -> dict[str, Any]:
        """JSON-safe summary."""
        return {"bands": dict(self.counts), "band_log_evidence": self.statistic,
                "band_rejected_at_response": self.rejected_at}
