"""TOPLOC observability: Prometheus series on a `--enable-metrics` server, and TOPLOC's log lines.

Everything is observed in the API process (the tokenizer manager), which sees each response's
fingerprints, each verification's final report (after the greedy and sampling checks of
`verification_report.finalize_report`, which can turn a passing fingerprint into a failure) and
each fingerprint refused with a 400. One `ToplocMetrics` per tokenizer manager, kept on it: made
when the server starts (`server_started`), or at the first request of a tokenizer process that
sglang started otherwise. Its series go to prometheus_client's multiprocess files, which sglang's
`GET /metrics` collects from all processes; without `--enable-metrics` nothing is made and
prometheus_client is not imported (sglang imports it only after it set PROMETHEUS_MULTIPROC_DIR).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

from sglang_rl.request_options import FINGERPRINTS_FIELD, RESULT_FIELD

logger = logging.getLogger(__name__)

PREFIX = "sglang_rl_toploc_"
ATTR = "_sglang_rl_toploc_metrics"
"""The tokenizer manager's attribute holding its `ToplocMetrics` (False: metrics are off)."""

VERDICTS = ("pass", "fail", "error")
"""Verdict labels exported from the start (at 0); a report's own `verdict` may add others."""

SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
EXP_BUCKETS = (0, 1, 2, 4, 8, 16, 24, 32, 38, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
MANT_BUCKETS = (0, 0.5, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128)
STATISTICS = ("exp_mismatches", "mant_err_mean", "mant_err_median")


class ToplocMetrics:
    """The TOPLOC series of one process. `registry`: where to register them (tests pass their
    own); None on a server, whose multiprocess files carry them to `/metrics` without one (and a
    second instance in the same process, e.g. a second Engine, cannot collide)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import Counter, Histogram

        self.fingerprints = Counter(
            f"{PREFIX}fingerprints_built", "Fingerprints built and returned with generated responses",
            registry=registry)
        self.verifications = Counter(
            f"{PREFIX}verifications", "Verification requests answered, by verdict (error: the "
            "fingerprint could not be checked against the prefill)", ["verdict"], registry=registry)
        self.invalid = Counter(
            f"{PREFIX}invalid_fingerprints", "Verification requests refused with 400 because their "
            "fingerprint is malformed or was made with another topk", registry=registry)
        self.seconds = Histogram(
            f"{PREFIX}verification_seconds", "Time from a verification request's arrival to its "
            "report (queueing, prefill and the check)", buckets=SECONDS_BUCKETS, registry=registry)
        self.statistics = {
            name: Histogram(f"{PREFIX}{name}", f"Worst per-chunk {name} of each checked response",
                            buckets=EXP_BUCKETS if name == "exp_mismatches" else MANT_BUCKETS,
                            registry=registry)
            for name in STATISTICS
        }
        for verdict in VERDICTS:
            self.verifications.labels(verdict=verdict)

    def fingerprints_built(self, count: int) -> None:
        self.fingerprints.inc(count)

    def invalid_fingerprint(self) -> None:
        self.invalid.inc()

    def verification(self, report: dict, seconds: float) -> None:
        """One finished verification: its verdict, latency and (if it was checked) statistics."""
        self.verifications.labels(verdict=verdict_of(report)).inc()
        self.seconds.observe(seconds)
        if "error" in report:
            return
        for name, histogram in self.statistics.items():
            value = report.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                histogram.observe(value)


def verdict_of(report: dict) -> str:
    """The verdict label of a report: "error" when it could not be checked, else its own
    `verdict` when it has one, else "pass" or "fail" from `verified`."""
    if "error" in report:
        return "error"
    verdict = report.get("verdict")
    if isinstance(verdict, str) and verdict:
        return verdict
    return "pass" if report.get("verified") else "fail"


def metrics_of(manager: Any) -> Optional[ToplocMetrics]:
    """The tokenizer manager's TOPLOC metrics, made at the first call on a server with
    `--enable-metrics` and `--toploc-verification`; None on any other server."""
    metrics = getattr(manager, ATTR, None)
    if metrics is None:
        args = getattr(manager, "server_args", None)
        wanted = bool(getattr(args, "enable_metrics", False) and getattr(args, "toploc_verification", False))
        metrics = ToplocMetrics() if wanted else False
        setattr(manager, ATTR, metrics)
    return metrics or None


def count_invalid_fingerprint(manager: Any) -> None:
    """A verification request was refused (400) for its fingerprint."""
    metrics = metrics_of(manager)
    if metrics is not None:
        metrics.invalid_fingerprint()


def observe_output(manager: Any, out: dict, started: float) -> None:
    """One finished output of `TokenizerManager.generate_request` (its meta_info fields made by
    `api._finish_meta`): count its fingerprints, record its verification report, and log a
    failed verification with its request id. `started`: when the request arrived (perf_counter)."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        return
    raw = meta.get(RESULT_FIELD)
    fingerprints = meta.get(FINGERPRINTS_FIELD)
    if raw is None and not fingerprints:
        return
    metrics = metrics_of(manager)
    if fingerprints and metrics is not None:
        metrics.fingerprints_built(len(fingerprints))
    if not isinstance(raw, str):
        return
    report = json.loads(raw)
    if metrics is not None:
        metrics.verification(report, time.perf_counter() - started)
    if not report.get("verified"):
        logger.info("TOPLOC verification failed: rid=%s verdict=%s %s", meta.get("id"), verdict_of(report),
                    _failure_details(report))


def _failure_details(report: dict) -> str:
    if "error" in report:
        return f"error={report['error']}"
    parts = [f"{name}={report.get(name)}" for name in STATISTICS]
    for check in ("fingerprint_verified", "greedy_consistent", "sampling_consistent"):
        if check in report:
            parts.append(f"{check}={report[check]}")
    return " ".join(parts)


def server_started(result: Any, engine_cls: Any, *args: Any, **kwargs: Any) -> None:
    """Once the server has started (after the plugin's load line, `hooks.server_started`): the
    warning about uncalibrated bounds, and the tokenizer manager's metrics."""
    server_args = kwargs.get("server_args", args[0] if args else None)
    if server_args is None:
        return
    if getattr(server_args, "toploc_verification", False):
        _warn_if_uncalibrated(server_args)
    manager = result[0] if isinstance(result, tuple) and result else None
    if manager is not None:
        metrics_of(manager)


def _warn_if_uncalibrated(server_args: Any) -> None:
    from sglang_rl.adapters.toploc import thresholds_from_server_args

    if getattr(server_args, "toploc_verification_calibration", None):
        return
    policy = thresholds_from_server_args(server_args)
    bounds = policy.full
    logger.warning(
        "TOPLOC verification runs with %s (max_exp_mismatches=%s, max_mant_err_mean=%s, "
        "max_mant_err_median=%s), which can miss small model changes: fit this model's bounds with "
        "`sglang-rl calibrate` and pass them with --toploc-verification-calibration",
        policy.source, bounds.max_exp_mismatches, bounds.max_mant_err_mean, bounds.max_mant_err_median)
