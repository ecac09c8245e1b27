"""Calibration files: round trip, validation errors, the threshold rule, short final chunks, the
server flag and the calibrate CLI on pre-measured records (no model)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_rl.adapters.prefill_verification import PrefillVerification
from sglang_rl.adapters.toploc import thresholds_from_server_args
from sglang_rl.fingerprint import Thresholds, verify_rows
from sglang_rl.fingerprint.calibration import (
    UNCALIBRATED,
    Calibration,
    CalibrationError,
    ScoreHistogram,
    ThresholdPolicy,
    calibration_from_dict,
    choose_bound,
    choose_thresholds,
    load_calibration,
    per_check_budget,
    save_calibration,
)
from sglang_rl.fingerprint.codec import build_fingerprint
from sglang_rl.fingerprint.evidence import DEFAULT_EDGES
from sglang_rl.fingerprint.verify import NOTHING_MATCHED, ChunkResult

STRICT = Thresholds(0, 0.0, 0.0)
LOOSE = Thresholds(128, 1e30, 1e30)


def sample_calibration(**changes) -> Calibration:
    fields = dict(
        model_name="tiny",
        model_path="/models/tiny",
        topk=128,
        chunk_size=32,
        false_rejection_budget=1e-3,
        full=Thresholds(3, 0.75, 0.5),
        short=Thresholds(5, 1.25, 1.0),
        summary={"configs": {"decode_b1": {"responses": 4}}},
        histogram=ScoreHistogram(DEFAULT_EDGES, (9,) + (0,) * 19, {"bf16": (0,) * 10 + (5,) + (0,) * 9}),
        rule="test",
    )
    fields.update(changes)
    return Calibration(**fields)


def test_round_trip(tmp_path: Path) -> None:
    cal = sample_calibration()
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    loaded = load_calibration(path)
    assert loaded == cal
    assert json.loads(path.read_text())["histogram"]["edges"][-1] == "inf"
    assert loaded.policy(str(path)).source == f"calibrated: tiny, file {path}"
    without_short = sample_calibration(short=None, histogram=None)
    assert calibration_from_dict(json.loads(json.dumps(without_short.to_dict()))) == without_short


def _doc(**changes) -> dict:
    doc = sample_calibration().to_dict()
    doc = json.loads(json.dumps(doc))
    for key, value in changes.items():
        target = doc
        *parents, last = key.split(".")
        for parent in parents:
            target = target[parent]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return doc


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "something"}, "not a calibration file"),
        ({"version": 2}, "calibration version 2"),
        ({"topk": KeyError}, "missing field 'topk'"),
        ({"topk": "128"}, "'topk' must be int"),
        ({"topk": 0}, "topk must be in 1..4096"),
        ({"chunk_size": 300}, "chunk_size must be in 1..255"),
        ({"model.name": 7}, "'name' must be str"),
        ({"false_rejection_budget": 0}, "false_rejection_budget must lie in"),
        ({"thresholds.full": None}, "thresholds.full must be an object"),
        ({"thresholds.short.max_mant_err_mean": -1}, "finite and non-negative"),
        ({"thresholds.full.max_exp_mismatches": 2.5}, "'max_exp_mismatches' must be int"),
        ({"histogram.honest": [1, 2]}, "honest must be 20 non-negative integer counts"),
        ({"histogram.edges": [0, 1, 0.5, "inf"]}, "edges must rise strictly"),
        ({"histogram.honest": [0] * 20}, "the honest histogram is empty"),
        ({"histogram.cheats": {"bf16": [-1] * 20}}, "cheats\\['bf16'\\] must be 20"),
    ],
)
def test_validation_errors(changes: dict, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        calibration_from_dict(_doc(**changes))


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="cannot read the calibration file"):
        load_calibration(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CalibrationError, match="is not JSON"):
        load_calibration(bad)
    bad.write_text("[]")
    with pytest.raises(CalibrationError, match="expected a JSON object"):
        load_calibration(bad)


# --------------------------------------------------------------------------------------------
# the rule


def test_rule_concentrated_honest_values_get_one_unit_of_margin() -> None:
    assert choose_bound([0.0] * 50, 1e-4, 1.0) == 1.0
    assert choose_bound([0.0] * 49 + [3.0], 1e-6, 0.5) >= 3.5
    bounds = choose_thresholds([ChunkResult(0, 0.0, 0.0)] * 20 + [ChunkResult(2, 0.3, 0.0)], 1e-4)
    assert bounds.max_exp_mismatches >= 3 and bounds.max_mant_err_mean >= 0.55
    assert bounds.max_mant_err_median >= 0.5


def test_rule_keeps_fresh_honest_samples_inside_the_budget() -> None:
    """On a normal honest distribution measured with fewer samples than 1/budget, the bound sits
    at the budget's quantile: fresh honest samples exceed it about as often as the budget allows.
    With many more samples the honest maximum decides and the rate falls below the budget."""
    rng = random.Random(0)
    budget = 1e-3
    fresh = [rng.gauss(10.0, 2.0) for _ in range(200_000)]
    few = [rng.gauss(10.0, 2.0) for _ in range(200)]
    bound = choose_bound(few, budget, 0.01)
    assert abs(bound - (10.0 + 3.09 * 2.0)) < 0.6
    rate = sum(v > bound for v in fresh) / len(fresh)
    assert 0.0002 < rate < 0.004, (bound, rate)
    many = [rng.gauss(10.0, 2.0) for _ in range(20_000)]
    bound = choose_bound(many, budget, 0.01)
    assert bound == pytest.approx(max(many) + 0.01)
    assert sum(v > bound for v in fresh) / len(fresh) < budget


def test_rule_budget_is_split_over_statistics_and_chunks() -> None:
    assert per_check_budget(1e-3, 2) == pytest.approx(1e-3 / 9)
    assert per_check_budget(1e-3, 0) == pytest.approx(1e-3 / 6)
    with pytest.raises(ValueError):
        per_check_budget(0.0, 2)


def test_rule_refuses_too_few_or_broken_honest_values() -> None:
    with pytest.raises(CalibrationError, match="at least 10"):
        choose_bound([0.0] * 5, 1e-3, 1.0)
    with pytest.raises(CalibrationError, match="matched nothing"):
        choose_bound([0.0] * 20 + [NOTHING_MATCHED], 1e-3, 1.0)


# --------------------------------------------------------------------------------------------
# short final chunks


def rows_with_changed_tail(n: int, changed: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Honest rows [n, 576] and a copy whose last ``changed`` rows carry strong noise."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, 576, generator=gen)
    other = rows.clone()
    other[n - changed :] += 0.5 * torch.randn(changed, 576, generator=gen)
    return rows, other


def test_policy_picks_short_bounds_for_short_chunks_only() -> None:
    policy = ThresholdPolicy(full=STRICT, short=LOOSE, source="x")
    assert policy.for_rows(31, 32) == LOOSE and policy.for_rows(1, 32) == LOOSE
    assert policy.for_rows(32, 32) == STRICT
    assert ThresholdPolicy(full=STRICT).for_rows(5, 32) == STRICT


def test_short_bounds_apply_to_the_last_partial_chunk() -> None:
    verifier, generator = rows_with_changed_tail(70, 6)
    fp = build_fingerprint(generator.to(torch.bfloat16))
    assert not verify_rows(verifier, fp, STRICT).verified
    report = verify_rows(verifier, fp, STRICT, short_chunk_thresholds=LOOSE)
    assert report.verified
    assert report.chunks[-1].exp_mismatches > 0 and report.chunks[0].exp_mismatches == 0
    assert report.to_dict()["short_chunk_thresholds"]["max_exp_mismatches"] == 128


def test_short_bounds_never_apply_to_a_full_last_chunk() -> None:
    verifier, generator = rows_with_changed_tail(64, 6)
    fp = build_fingerprint(generator.to(torch.bfloat16))
    assert not verify_rows(verifier, fp, STRICT, short_chunk_thresholds=LOOSE).verified


def test_without_calibration_the_report_is_unchanged() -> None:
    verifier, generator = rows_with_changed_tail(40, 3)
    fp = build_fingerprint(generator.to(torch.bfloat16))
    report = verify_rows(verifier, fp).to_dict()
    assert "short_chunk_thresholds" not in report
    assert report["thresholds"] == {"max_exp_mismatches": 38, "max_mant_err_mean": 10.0, "max_mant_err_median": 8.0}


# --------------------------------------------------------------------------------------------
# the server side


def server_args(**changes) -> SimpleNamespace:
    fields = dict(
        toploc_verification_topk=128,
        toploc_verification_max_exp_mismatches=None,
        toploc_verification_max_mant_err_mean=10.0,
        toploc_verification_max_mant_err_median=8.0,
        toploc_verification_calibration=None,
    )
    fields.update(changes)
    return SimpleNamespace(**fields)


def test_server_thresholds_without_a_file_are_the_uncalibrated_defaults() -> None:
    policy = thresholds_from_server_args(server_args())
    assert policy == ThresholdPolicy(Thresholds.for_topk(128), None, UNCALIBRATED)
    flagged = thresholds_from_server_args(server_args(toploc_verification_max_exp_mismatches=5))
    assert flagged.full.max_exp_mismatches == 5 and flagged.source == "uncalibrated, set by flags"


def test_server_verification_applies_and_names_the_calibration(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    save_calibration(sample_calibration(full=STRICT, short=LOOSE, model_name="SmolLM2-test"), path)
    policy = thresholds_from_server_args(server_args(toploc_verification_calibration=str(path)))
    prompt_len, n = 20, 38
    verifier, generator = rows_with_changed_tail(n, 6)
    fp = build_fingerprint(generator.to(torch.bfloat16))
    check = PrefillVerification(fp, prompt_len, policy)
    prefill = torch.cat([torch.zeros(prompt_len - 1, 576), verifier, torch.zeros(1, 576)])
    check.add_rows(prefill)
    report = check.finish(prompt_len + n)
    assert report["verified"], report
    assert report["thresholds_source"] == f"calibrated: SmolLM2-test, file {path}"
    assert report["thresholds"]["max_exp_mismatches"] == 0
    assert report["short_chunk_thresholds"]["max_exp_mismatches"] == 128


def test_server_flag_validates_the_file_at_start_up(tmp_path: Path) -> None:
    from sglang_rl.server_args import RLServerArgs

    def start(path: Path, **flags) -> None:
        RLServerArgs(model_path="unused", toploc_verification_calibration=str(path), **flags)

    with pytest.raises(ValueError, match="needs --toploc-verification"):
        start(tmp_path / "x.json")
    with pytest.raises(CalibrationError, match="cannot read the calibration file"):
        start(tmp_path / "missing.json", toploc_verification=True)
    other_topk = tmp_path / "topk64.json"
    save_calibration(sample_calibration(topk=64), other_topk)
    with pytest.raises(ValueError, match="topk=64, the server uses --toploc-verification-topk 128"):
        start(other_topk, toploc_verification=True)
    other_chunk = tmp_path / "chunk16.json"
    save_calibration(sample_calibration(chunk_size=16), other_chunk)
    with pytest.raises(ValueError, match="chunks of 16 rows"):
        start(other_chunk, toploc_verification=True)
    good = tmp_path / "good.json"
    save_calibration(sample_calibration(), good)
    with pytest.raises(ValueError, match="leave the --toploc-verification-max-\\* flags"):
        start(good, toploc_verification=True, toploc_verification_max_mant_err_mean=3.0)


# --------------------------------------------------------------------------------------------
# the calibrate CLI on pre-measured records (the hook for GPU measurements)


def synthetic_records(seed: int = 0) -> list[dict]:
    """Honest responses with small noise, a cheat with clearly larger statistics."""
    rng = random.Random(seed)
    records = []
    for prompt in range(40):
        for config, honest, scale in (("decode_b1", True, 1), ("batch", True, 1), ("cheat", False, 8)):
            n = rng.choice([64, 40, 20])
            chunks = [
                {"exp_mismatches": rng.randint(0, 2) * scale, "mant_err_mean": rng.random() * 0.5 * scale,
                 "mant_err_median": float(rng.randint(0, 1) * scale)}
                for _ in range(-(-n // 32))
            ]
            records.append({"config": config, "honest": honest, "prompt": prompt, "response_tokens": n,
                            "chunks": chunks})
    return records


def test_calibrate_cli_from_stat_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sglang_rl.calibration.fit import main

    stats = tmp_path / "records.jsonl"
    stats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records()))
    out = tmp_path / "cal.json"
    code = main(["--model-path", "/models/tiny", "--out", str(out), "--stats", str(stats), "--no-measure",
                 "--workers", "50", "--budget", "0.01"])
    assert code == 0
    cal = load_calibration(out)
    assert cal.model_name == "tiny" and cal.topk == 128 and cal.short is not None
    assert 2 < cal.full.max_exp_mismatches < 16
    configs = cal.summary["configs"]
    assert configs["decode_b1"]["rejected_per_response"] == 0.0
    assert configs["cheat"]["rejected_per_response"] > 0.5
    assert set(cal.histogram.cheats) == {"cheat"}
    assert cal.summary["held_out"]["calibrated"]["cheats"]["cheat"]["workers_rejected_within"]["16"] == 1.0
    assert "wrote" in capsys.readouterr().out


def test_records_round_trip_gzip_and_plain(tmp_path: Path) -> None:
    from sglang_rl.calibration.measure import read_records, write_records

    records = synthetic_records()[:20]
    for name in ("records.jsonl", "records.jsonl.gz"):
        write_records(records, tmp_path / name)
        assert read_records([tmp_path / name]) == records
    assert (tmp_path / "records.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"
    assert (tmp_path / "records.jsonl.gz").stat().st_size < (tmp_path / "records.jsonl").stat().st_size
