"""Worker-level evidence: is a worker serving the agreed model, judged over many responses?

One response rarely settles it: a cheaper model (lower precision, slightly changed weights) can
stay inside the per-chunk bounds on each response while still sitting above the honest noise on
average. This module accumulates that evidence as a sequential likelihood-ratio test.

* Each verified response gets a score: its worst chunk statistic as a fraction of the calibrated
  bound for that chunk (``response_score``; above 1 means the response failed verification).
* A calibration file holds histograms of that score for honest responses and for each measured
  cheat. The honest pmf ``p`` and the cheat pmf ``q`` (the cheats mixed with equal weight, plus a
  small uniform part for deviations no measured cheat showed) are smoothed with a pseudo-count
  per bin, and each response contributes
  ``l = log min(q/p, cap)`` where ``cap = alpha ** (-1 / min_responses_to_reject)``: no single
  response, however extreme, accuses a worker alone.
* The running statistic is ``S_n = max(log(floor), S_{n-1} + l_n)``, ``S_0 = 0`` (a CUSUM-like
  floor, so that a worker that switches to cheating after a long honest run is still caught
  quickly).

Sampled work adds a second, independent test: reports with ``sampling_z`` (verification with
``toploc_verification_expect_sampled``) are combined into the Z of all the worker's sampled tokens
(Stouffer's combination, as the plugin's ``sampling.combined_z``), and ``|Z| >= sampling_reject_z``
rejects as well.

Each response's verdict band (pass, suspect, fail: ``sglang_rl_client.bands``) feeds a third
test, a CUSUM of fixed steps that rejects at three suspects or two fails in a row; it also counts
what the score does not show (a failed termination or token check).

Decision rule: ``reject`` once ``S_n >= log(1/alpha)`` or the band test rejects (sticky),
``suspect`` while either statistic is ``>= log(1/suspect_level)``, ``accept`` while
``S_n <= log(accept_level)``, else ``undecided``.

False-accusation rate: for an honest worker whose scores follow the calibration's honest
distribution ``p`` (independent responses), ``exp(S)`` restarted from the floor is a nonnegative
supermartingale (``E_p[min(q/p, cap)] <= 1``), so by Ville's inequality the first climb from 1
reaches ``1/alpha`` with probability at most ``alpha``, and each climb from the floor at most
``alpha * floor``. Hence P(an honest worker is rejected within its first N responses)
``<= alpha * (1 + N * floor)``; with the defaults (alpha 1e-3, floor 1e-4) that is at most
0.0011 over 1,000 responses and 0.002 over 10,000. The band test has the same bound for honest
workers whose responses are suspect at most ``honest_suspect_rate`` (1e-3, the calibration's
per-response budget) and fail at most ``honest_fail_rate`` (1e-4) of the time; either test
together: at most twice that. The guarantee is only as good as the honest
histogram: it must be measured on the configurations the workers really run (hardware, batch
sizes, kernels), see the plugin's ``sglang-rl calibrate``.

Pure Python: the plugin's ``sglang_rl.fingerprint.evidence`` is this module.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_rl_client.bands import BandEvidence, band_of_score
from sglang_rl_client.calibration import (
    BOUND_NAMES,
    STATISTICS,
    Calibration,
    ScoreHistogram,
    ThresholdPolicy,
)

ACCEPT, UNDECIDED, SUSPECT, REJECT = "accept", "undecided", "suspect", "reject"

DEFAULT_EDGES = (
    0.0, 1e-9, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    1.25, 1.5, 2.0, 3.0, 5.0, math.inf,
)
"""Score bins: exactly 0, then steps of the calibrated bound up to 1 (a passing response), then
failing responses by how far they are over."""


def response_score(report: Mapping[str, Any], policy: ThresholdPolicy, chunk_size: int = 32) -> float | None:
    """The worst chunk statistic of a verification report, as a fraction of its bound.

    ``report`` is the result dict a verifier server returns (or the plugin's
    ``VerificationReport.to_dict()``): its ``chunks`` list and, to tell a short final chunk,
    ``response_tokens``. Each chunk is measured against ``policy.for_rows`` of its row count.
    Returns None for a report with an ``error`` or without chunks (the check did not run, so it
    says nothing about the model).
    """
    if "error" in report:
        return None
    chunks = report.get("chunks")
    if not isinstance(chunks, Sequence) or not chunks:
        return None
    n = report.get("response_tokens")
    last_rows = chunk_size if not isinstance(n, int) else n - chunk_size * (len(chunks) - 1)
    worst = 0.0
    for index, chunk in enumerate(chunks):
        rows = last_rows if index == len(chunks) - 1 else chunk_size
        bounds = policy.for_rows(rows, chunk_size)
        for stat in STATISTICS:
            value = float(chunk[stat])
            bound = float(getattr(bounds, BOUND_NAMES[stat]))
            ratio = value / bound if bound > 0 else (math.inf if value > 0 else 0.0)
            worst = max(worst, ratio)
    return worst


def score_bin(score: float, edges: Sequence[float]) -> int:
    """Index k of the bin ``(edges[k], edges[k+1]]`` holding ``score`` (the first bin includes 0)."""
    return min(len(edges) - 2, max(0, bisect_left(edges, score) - 1))


def histogram(scores: Sequence[float], edges: Sequence[float] = DEFAULT_EDGES) -> tuple[int, ...]:
    """Counts of ``scores`` in the bins of ``edges``."""
    counts = [0] * (len(edges) - 1)
    for s in scores:
        counts[score_bin(s, edges)] += 1
    return tuple(counts)


@dataclass(frozen=True)
class EvidencePolicy:
    """The error levels of the decision rule (see the module docstring)."""

    false_accusation_rate: float = 1e-3
    suspect_level: float = 0.05
    accept_level: float = 0.01
    floor: float = 1e-4
    min_responses_to_reject: int = 3
    pseudo_count: float = 0.5
    uniform_weight: float = 0.1
    sampling_reject_z: float = 5.5
    honest_suspect_rate: float = 1e-3
    honest_fail_rate: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("false_accusation_rate", "suspect_level", "accept_level", "floor"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name} must lie in (0, 1), got {value}")
        if self.suspect_level < self.false_accusation_rate:
            raise ValueError("suspect_level must be at least false_accusation_rate")
        if self.floor > self.accept_level:
            raise ValueError("floor must not be above accept_level")
        if self.min_responses_to_reject < 1:
            raise ValueError("min_responses_to_reject must be at least 1")
        if self.pseudo_count <= 0:
            raise ValueError("pseudo_count must be positive")
        if not 0.0 <= self.uniform_weight <= 1.0:
            raise ValueError("uniform_weight must lie in [0, 1]")

    def honest_bound(self, responses: int) -> float:
        """Upper bound on P(an honest worker is rejected within ``responses`` responses)."""
        return min(1.0, self.false_accusation_rate * (1 + responses * self.floor))


def log_likelihood_ratios(hist: ScoreHistogram, policy: EvidencePolicy) -> tuple[float, ...]:
    """Per-bin ``log min(q/p, cap)``: p the smoothed honest pmf; q the smoothed cheat pmfs mixed
    with equal weight, plus ``uniform_weight`` of a uniform pmf over the bins so that a score no
    measured cheat produced (e.g. far beyond every bound) still counts against the worker
    (without cheats, q is uniform)."""
    k = len(hist.honest)
    a = policy.pseudo_count

    def pmf(counts: Sequence[int]) -> list[float]:
        total = sum(counts) + a * k
        return [(c + a) / total for c in counts]

    p = pmf(hist.honest)
    cheat_pmfs = [pmf(c) for c in hist.cheats.values() if sum(c)]
    u = policy.uniform_weight if cheat_pmfs else 1.0
    q = [u / k] * k
    if cheat_pmfs:
        q = [qi + (1 - u) * sum(col) / len(cheat_pmfs) for qi, col in zip(q, zip(*cheat_pmfs))]
    cap = policy.false_accusation_rate ** (-1.0 / policy.min_responses_to_reject)
    return tuple(math.log(min(qi / pi, cap)) for pi, qi in zip(p, q))


@dataclass
class WorkerEvidence:
    """Running evidence about one worker from its responses' verification reports.

    Build it with ``WorkerEvidence.from_calibration(calibration)`` and feed it every report of
    that worker (``add_report``) in the order they were verified.
    """

    edges: tuple[float, ...]
    llr: tuple[float, ...]
    thresholds: ThresholdPolicy
    chunk_size: int = 32
    policy: EvidencePolicy = field(default_factory=EvidencePolicy)
    prior_cheat: float = 0.5
    statistic: float = 0.0
    total_llr: float = 0.0
    responses: int = 0
    failed: int = 0
    errors: int = 0
    rejected_at: int | None = None
    sampling_weighted_z: float = 0.0
    sampling_tokens: int = 0
    sampling_rejected_at: int | None = None
    bands: BandEvidence | None = None

    def __post_init__(self) -> None:
        if self.bands is None:
            policy = self.policy
            self.bands = BandEvidence(
                false_accusation_rate=policy.false_accusation_rate, honest_suspect_rate=policy.honest_suspect_rate,
                honest_fail_rate=policy.honest_fail_rate, floor=policy.floor,
                responses_to_reject=max(2, policy.min_responses_to_reject))

    @classmethod
    def from_calibration(
        cls, calibration: Calibration, policy: EvidencePolicy | None = None, prior_cheat: float = 0.5
    ) -> WorkerEvidence:
        """An accumulator using the calibration's bounds and score histograms."""
        if calibration.histogram is None:
            raise ValueError("the calibration has no score histogram (re-run sglang-rl calibrate)")
        policy = policy or EvidencePolicy()
        return cls(
            edges=calibration.histogram.edges,
            llr=log_likelihood_ratios(calibration.histogram, policy),
            thresholds=calibration.policy(),
            chunk_size=calibration.chunk_size,
            policy=policy,
            prior_cheat=prior_cheat,
        )

    def add_report(self, report: Mapping[str, Any]) -> str:
        """Account for one verification report; returns the verdict after it. A report with an
        ``error`` is counted in ``errors`` and moves nothing. Its ``verdict`` band (from a server
        with bands) feeds the band test; without one, the band follows from its score."""
        score = response_score(report, self.thresholds, self.chunk_size)
        if score is None:
            self.errors += 1
            return self.verdict
        band = report.get("verdict")
        verdict = self.add_score(score, band if band in self.bands.counts else None)
        if report.get("sampling_checked"):
            self.add_sampling(float(report["sampling_z"]), int(report["sampling_checked"]))
        return self.verdict if self.sampling_rejected_at is not None else verdict

    def add_sampling(self, z: float, tokens: int) -> None:
        """Account for one response's temperature-1 sampling test (``sampling_z`` over
        ``sampling_checked`` tokens). The worker's Z over all its sampled tokens is standard normal
        while it samples honestly; it is watched after every response, so the bound
        ``sampling_reject_z`` (5.5) leaves 3.8e-8 per look: at most 3.8e-4 of honest workers are
        accused within 10,000 responses (union bound)."""
        self.sampling_weighted_z += z * math.sqrt(tokens)
        self.sampling_tokens += tokens
        if self.sampling_rejected_at is None and abs(self.sampling_z) >= self.policy.sampling_reject_z:
            self.sampling_rejected_at = self.responses

    @property
    def sampling_z(self) -> float:
        """The Z of all sampled tokens seen (``sampling.combined_z`` of the responses so far)."""
        return self.sampling_weighted_z / math.sqrt(self.sampling_tokens) if self.sampling_tokens else 0.0

    def add_score(self, score: float, band: str | None = None) -> str:
        """Account for one response's score (see ``response_score``) and its band (by default the
        score's: suspect beyond the bound, fail beyond ``fail_factor`` times it); returns the
        verdict."""
        self.bands.add(band or band_of_score(score, self.thresholds.fail_factor))
        step = self.llr[score_bin(score, self.edges)]
        self.responses += 1
        self.failed += int(score > 1.0)
        self.total_llr += step
        self.statistic = max(math.log(self.policy.floor), self.statistic + step)
        if self.rejected_at is None and self.statistic >= -math.log(self.policy.false_accusation_rate):
            self.rejected_at = self.responses
        return self.verdict

    @property
    def verdict(self) -> str:
        """reject (sticky), suspect, accept or undecided, by the rule in the module docstring."""
        if self.rejected_at is not None or self.sampling_rejected_at is not None or self.bands.rejected:
            return REJECT
        if max(self.statistic, self.bands.statistic) >= -math.log(self.policy.suspect_level):
            return SUSPECT
        if self.statistic <= math.log(self.policy.accept_level):
            return ACCEPT
        return UNDECIDED

    @property
    def cheat_probability(self) -> float:
        """Posterior probability that the worker serves a cheat, from ``prior_cheat`` and the total
        (unfloored, capped) likelihood ratio of all its responses."""
        prior = math.log(self.prior_cheat) - math.log1p(-self.prior_cheat)
        logit = prior + self.total_llr
        return 1.0 / (1.0 + math.exp(-logit)) if logit > -700 else 0.0

    def state(self) -> dict[str, Any]:
        """JSON-safe summary of the evidence so far."""
        return {
            "verdict": self.verdict,
            "responses": self.responses,
            "failed_responses": self.failed,
            "errors": self.errors,
            "log_evidence": self.statistic,
            "reject_at_log_evidence": -math.log(self.policy.false_accusation_rate),
            "cheat_probability": self.cheat_probability,
            "rejected_at_response": self.rejected_at,
            "thresholds_source": self.thresholds.source,
            "false_accusation_bound": self.policy.honest_bound(self.responses),
            "sampling_z": self.sampling_z,
            "sampling_tokens": self.sampling_tokens,
            "sampling_rejected_at_response": self.sampling_rejected_at,
            **self.bands.state(),
        }


class Fleet:
    """Worker evidence for many workers: one ``WorkerEvidence`` per worker name, made from the
    same calibration the first time the name is seen."""

    def __init__(self, calibration: Calibration, policy: EvidencePolicy | None = None,
                 prior_cheat: float = 0.5) -> None:
        WorkerEvidence.from_calibration(calibration, policy, prior_cheat)  # refuse a file without histograms now
        self.calibration = calibration
        self.policy = policy or EvidencePolicy()
        self.prior_cheat = prior_cheat
        self.workers: dict[str, WorkerEvidence] = {}

    def worker(self, name: str) -> WorkerEvidence:
        """The evidence about worker ``name`` (new and empty the first time)."""
        if name not in self.workers:
            self.workers[name] = WorkerEvidence.from_calibration(self.calibration, self.policy, self.prior_cheat)
        return self.workers[name]

    def add_report(self, name: str, report: Mapping[str, Any]) -> str:
        """Account for one verification report of worker ``name``; its verdict after it."""
        return self.worker(name).add_report(report)

    def states(self) -> dict[str, dict[str, Any]]:
        """``WorkerEvidence.state()`` of every worker, in the order they were first seen."""
        return {name: w.state() for name, w in self.workers.items()}
