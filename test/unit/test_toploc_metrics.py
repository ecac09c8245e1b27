"""TOPLOC metrics and log lines (adapters/toploc_metrics.py; the plugin's load line, hooks.py), on real
prometheus_client objects."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from sglang_rl.adapters import toploc_metrics
from sglang_rl.adapters.toploc_metrics import ToplocMetrics, metrics_of, observe_output, verdict_of
from sglang_rl.hooks import server_started
from sglang_rl.request_options import (
    FINGERPRINTS_FIELD,
    RESULT_FIELD,
    InvalidFingerprintError,
    RequestOptionError,
    validate_fields,
    validate_fingerprint_to_validate,
)

CALIBRATION = Path(__file__).resolve().parents[2] / "docs" / "results" / "cpu_smollm2_calibration.json"
P = toploc_metrics.PREFIX


def _report(verified: bool, exp: int, mean: float, median: float, **extra) -> dict:
    return {"verified": verified, "exp_mismatches": exp, "mant_err_mean": mean, "mant_err_median": median,
            **extra}


def _args(**overrides) -> SimpleNamespace:
    values = dict(enable_metrics=True, toploc_verification=True, toploc_verification_topk=128,
                  toploc_verification_max_exp_mismatches=None, toploc_verification_max_mant_err_mean=10.0,
                  toploc_verification_max_mant_err_median=8.0, toploc_verification_calibration=None,
                  drafter_cotrain=False)
    return SimpleNamespace(**{**values, **overrides})


def _value(metric, suffix: str, **labels) -> float:
    """A sample of a metric that is in no registry (as on a server)."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name + suffix and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_verifications_are_counted_by_verdict_with_their_statistics() -> None:
    registry = CollectorRegistry()
    metrics = ToplocMetrics(registry)
    metrics.verification(_report(True, 3, 1.5, 1.0), 0.2)
    metrics.verification(_report(False, 90, 20.0, 16.0), 0.4)
    metrics.verification({"error": "does not fit", "verified": False}, 0.05)
    metrics.verification(_report(False, 40, 9.0, 7.0, verdict="suspect"), 0.3)
    get = registry.get_sample_value
    assert [get(f"{P}verifications_total", {"verdict": v}) for v in ("pass", "fail", "error", "suspect")] == [1, 1, 1, 1]
    assert get(f"{P}verification_seconds_count") == 4
    assert get(f"{P}verification_seconds_sum") == pytest.approx(0.95)
    # the error report has no statistics: three observations each, of the reports' worst values
    assert get(f"{P}exp_mismatches_count") == 3 and get(f"{P}exp_mismatches_sum") == 133
    assert get(f"{P}mant_err_mean_sum") == pytest.approx(30.5)
    assert get(f"{P}mant_err_median_sum") == pytest.approx(24.0)
    assert get(f"{P}exp_mismatches_bucket", {"le": "38.0"}) == 1
    assert get(f"{P}exp_mismatches_bucket", {"le": "48.0"}) == 2


def test_counters_start_at_zero_and_count() -> None:
    registry = CollectorRegistry()
    metrics = ToplocMetrics(registry)
    get = registry.get_sample_value
    assert [get(f"{P}verifications_total", {"verdict": v}) for v in ("pass", "fail", "error")] == [0, 0, 0]
    assert get(f"{P}fingerprints_built_total") == 0 and get(f"{P}invalid_fingerprints_total") == 0
    metrics.fingerprints_built(2)
    metrics.invalid_fingerprint()
    assert get(f"{P}fingerprints_built_total") == 2 and get(f"{P}invalid_fingerprints_total") == 1


def test_verdict_label_rule() -> None:
    assert verdict_of({"verified": True}) == "pass"
    assert verdict_of({"verified": False}) == "fail"
    assert verdict_of({"verified": False, "verdict": "suspect"}) == "suspect"
    assert verdict_of({"verified": False, "verdict": "fail", "error": "x"}) == "error"


def test_metrics_are_made_only_with_enable_metrics_and_toploc() -> None:
    assert metrics_of(SimpleNamespace(server_args=_args(enable_metrics=False))) is None
    assert metrics_of(SimpleNamespace(server_args=_args(toploc_verification=False))) is None
    manager = SimpleNamespace(server_args=_args())
    made = metrics_of(manager)
    assert isinstance(made, ToplocMetrics) and metrics_of(manager) is made
    # a second manager in the same process (a second Engine) gets its own objects, no collision
    assert metrics_of(SimpleNamespace(server_args=_args())) is not made


def _output(rid: str, report: dict | None = None, fingerprints: list | None = None) -> dict:
    meta: dict = {"id": rid}
    if report is not None:
        meta[RESULT_FIELD] = json.dumps(report)
    if fingerprints is not None:
        meta[FINGERPRINTS_FIELD] = fingerprints
    return {"text": "", "meta_info": meta}


def test_outputs_count_fingerprints_and_reports_and_log_failures(caplog) -> None:
    manager = SimpleNamespace(server_args=_args())
    metrics = metrics_of(manager)
    started = time.perf_counter() - 0.5
    with caplog.at_level(logging.INFO, logger=toploc_metrics.__name__):
        observe_output(manager, _output("gen-1", fingerprints=["fp"]), started)
        observe_output(manager, _output("ok-1", _report(True, 0, 0.0, 0.0)), started)
        observe_output(manager, _output("bad-1", _report(False, 99, 30.0, 20.0, fingerprint_verified=False)), started)
        observe_output(manager, _output("plain-1"), started)
    assert _value(metrics.fingerprints, "_total") == 1
    assert _value(metrics.verifications, "_total", verdict="pass") == 1
    assert _value(metrics.verifications, "_total", verdict="fail") == 1
    assert _value(metrics.seconds, "_count") == 2 and _value(metrics.seconds, "_sum") >= 1.0
    assert _value(metrics.statistics["exp_mismatches"], "_sum") == 99
    failed = [r for r in caplog.records if "verification failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.INFO
    assert "rid=bad-1" in failed[0].getMessage() and "exp_mismatches=99" in failed[0].getMessage()


def test_failures_are_logged_without_metrics(caplog) -> None:
    manager = SimpleNamespace(server_args=_args(enable_metrics=False))
    with caplog.at_level(logging.INFO, logger=toploc_metrics.__name__):
        observe_output(manager, _output("err-1", {"error": "the prefill rows were not computed", "verified": False}),
                       time.perf_counter())
    assert any("rid=err-1" in r.getMessage() and "verdict=error" in r.getMessage() for r in caplog.records)


def test_server_start_logs_the_load_line_and_warns_about_uncalibrated_bounds(caplog) -> None:
    manager = SimpleNamespace(server_args=_args())
    with caplog.at_level(logging.INFO, logger="sglang_rl"):
        server_started((manager, None, None), object, manager.server_args)
    loaded = [r for r in caplog.records if "sglang-rl" in r.getMessage() and "loaded" in r.getMessage()]
    assert len(loaded) == 1 and loaded[0].levelno == logging.INFO
    assert "TOPLOC metrics on" in loaded[0].getMessage()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "uncalibrated defaults" in warnings[0].getMessage()
    assert "max_exp_mismatches=38" in warnings[0].getMessage()
    assert isinstance(getattr(manager, toploc_metrics.ATTR), ToplocMetrics)


def test_a_calibrated_server_starts_without_the_warning(caplog) -> None:
    args = _args(toploc_verification_calibration=str(CALIBRATION), enable_metrics=False)
    manager = SimpleNamespace(server_args=args)
    with caplog.at_level(logging.INFO, logger="sglang_rl"):
        server_started((manager,), object, server_args=args)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("TOPLOC metrics off" in r.getMessage() for r in caplog.records)
    assert getattr(manager, toploc_metrics.ATTR) is False


def test_bounds_set_by_flags_are_still_uncalibrated(caplog) -> None:
    args = _args(toploc_verification_max_exp_mismatches=50)
    with caplog.at_level(logging.WARNING, logger="sglang_rl"):
        server_started(None, object, args)
    assert any("uncalibrated, set by flags" in r.getMessage() and "max_exp_mismatches=50" in r.getMessage()
               for r in caplog.records)


def test_malformed_fingerprints_raise_the_counted_error() -> None:
    with pytest.raises(InvalidFingerprintError, match="invalid toploc_verification_fingerprint_to_validate"):
        validate_fingerprint_to_validate("not a fingerprint", _args())
    with pytest.raises(InvalidFingerprintError, match="must be a string"):
        validate_fields({"toploc_verification_fingerprint_to_validate": 12}, _args())
    assert issubclass(InvalidFingerprintError, RequestOptionError)  # still a 400 with the reason
    with pytest.raises(RequestOptionError) as refused:
        validate_fields({"toploc_verification_fingerprint_to_validate": "x"}, _args(toploc_verification=False))
    assert not isinstance(refused.value, InvalidFingerprintError)  # a server without TOPLOC: not a bad proof
