"""Verdict bands and the termination check: a report's band from its chunks and checks, the
termination rule, and band evidence (one outlier never convicts; cheats go within 3 responses;
honest workers are accused no more often than the stated bound)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sglang_rl.fingerprint import build_fingerprint, verify_rows
from sglang_rl.fingerprint.termination import check_termination, last_token_logprob, termination_inputs
from sglang_rl.fingerprint.verdict import complete_verdict
from sglang_rl.fingerprint.verify import ChunkResult, Thresholds, fingerprint_band
from sglang_rl_client.bands import FAIL, PASS, SUSPECT, BandEvidence, band_of_report, band_of_score
from sglang_rl_client.calibration import CalibrationError, ThresholdPolicy, calibration_from_dict, scaled

BOUND = Thresholds(10, 2.0, 2.0)


def test_chunk_bands_follow_the_pass_and_fail_bounds() -> None:
    ok, over, far = ChunkResult(10, 2.0, 2.0), ChunkResult(11, 1.0, 1.0), ChunkResult(3, 4.5, 0.0)
    assert fingerprint_band([ok, ok], [BOUND, BOUND], 2.0) == (PASS, None)
    band, reason = fingerprint_band([ok, over], [BOUND, BOUND], 2.0)
    assert band == SUSPECT and reason == "chunk 1: exp_mismatches 11 above the pass bound 10"
    band, reason = fingerprint_band([over, far], [BOUND, BOUND], 2.0)
    assert band == FAIL and reason == "chunk 1: mant_err_mean 4.5 above the fail bound 4"
    assert fingerprint_band([ChunkResult(20, 0, 0)], [BOUND], 2.0)[0] == SUSPECT  # 20 = 2 x 10 is inside
    assert fingerprint_band([ChunkResult(21, 0, 0)], [BOUND], 2.0)[0] == FAIL
    assert scaled(Thresholds(38, 10.0, 8.0), 1.5) == Thresholds(57, 15.0, 12.0)


def test_verify_rows_bands_real_proofs() -> None:
    """toploc's own verdict on rows with growing noise: pass, then suspect, then fail."""
    torch.manual_seed(0)
    rows = torch.randn(40, 256)
    fp = build_fingerprint(rows.bfloat16(), topk=32, chunk_size=32)
    tight = Thresholds(2, 0.5, 0.5)
    seen = {}
    for noise in (0.0, 0.003, 0.01, 0.03, 0.3):
        report = verify_rows(rows + noise * torch.randn_like(rows), fp, tight)
        seen[noise] = report.to_dict()
        assert report.verified == (report.verdict == PASS)
    assert seen[0.0]["fingerprint_verdict"] == PASS and "fingerprint_reason" not in seen[0.0]
    assert seen[0.3]["fingerprint_verdict"] == FAIL and "fail bound" in seen[0.3]["fingerprint_reason"]
    assert seen[0.0]["fail_thresholds"] == {"max_exp_mismatches": 4, "max_mant_err_mean": 1.0,
                                            "max_mant_err_median": 1.0}
    assert [seen[n]["fingerprint_verdict"] for n in sorted(seen)] == [PASS, PASS, SUSPECT, FAIL, FAIL]


def _report(n: int = 10, ends: bool | None = True, limit: int | None = None, bound: float = 0.02) -> dict:
    out = {"response_tokens": n, **termination_inputs(ends is not None, 2 if ends else 7,
                                                      lambda t: t == 2, bound, limit)}
    return out


@pytest.mark.parametrize("case, logprob, ok, reason", [
    (dict(limit=64), math.log(0.3), True, None),
    (dict(limit=64), math.log(0.01), False, "probability 0.01 there, below 0.02"),
    (dict(bound=0.0, limit=64), math.log(0.01), None, None),           # the check is off
    (dict(), math.log(0.01), None, None),                              # no stated limit (a grammar's end)
    (dict(limit=10), math.log(1e-6), True, None),                      # the limit explains the end
    (dict(limit=12), math.log(1e-6), False, "below 0.02"),
    (dict(ends=False, limit=10), None, True, None),
    (dict(ends=False, limit=64), None, False, "before its max_new_tokens 64"),
    (dict(ends=False), None, None, None),                              # nothing to check against
    (dict(ends=None, limit=64), None, None, None),                     # chat form: EOS outside the prefill
    (dict(n=70, ends=False, limit=64), None, False, "more than its max_new_tokens 64"),
    (dict(limit=64), -math.inf, False, "probability 0 there"),
])
def test_termination_rule(case: dict, logprob: float | None, ok: bool | None, reason: str | None) -> None:
    report = _report(**case)
    fields, why = check_termination(report, logprob)
    assert fields["termination_verified"] is ok
    assert (why is None) == (reason is None) and (reason is None or reason in why), why
    if report.get("ends_on_eos") and logprob is not None:
        assert fields["eos_prob"] == pytest.approx(math.exp(logprob))


def test_the_eos_log_prob_is_the_last_prefill_entry_of_that_token() -> None:
    report = _report()
    assert last_token_logprob(report, {"input_token_logprobs": [[-1.0, 5, None], [-0.5, 2, None]]}) == -0.5
    assert last_token_logprob(report, {"input_token_logprobs": [[-0.5, 3, None]]}) is None
    assert last_token_logprob(report, {}) is None
    assert last_token_logprob({"response_tokens": 3}, {"input_token_logprobs": [[-0.5, 2, None]]}) is None


def test_the_verdict_is_the_worst_band_and_verified_means_pass() -> None:
    meta = {"input_token_logprobs": [[math.log(0.5), 2, None]]}
    base = {**_report(limit=64), "fingerprint_verified": True, "fingerprint_verdict": PASS}
    out = complete_verdict(dict(base), meta)
    assert (out["verdict"], out["verified"], out["verdict_reasons"]) == (PASS, True, [])
    suspect = complete_verdict({**base, "fingerprint_verified": False, "fingerprint_verdict": SUSPECT,
                                "fingerprint_reason": "chunk 0: exp_mismatches 12 above the pass bound 10"}, meta)
    assert suspect["verdict"] == SUSPECT and suspect["verified"] is False and "fingerprint_reason" not in suspect
    assert suspect["verdict_reasons"] == ["chunk 0: exp_mismatches 12 above the pass bound 10"]
    greedy = complete_verdict({**base, "expect_greedy": True, "greedy_consistent": False, "argmax_checked": 10,
                               "argmax_matches": 9}, meta)
    assert greedy["verdict"] == FAIL and "1 of 10 response tokens" in greedy["verdict_reasons"][0]
    low = complete_verdict(dict(base), {"input_token_logprobs": [[math.log(0.001), 2, None]]})
    assert low["verdict"] == FAIL and low["termination_verified"] is False and low["eos_prob"] == pytest.approx(0.001)
    error = complete_verdict({"error": "rows missing", "verified": False}, meta)
    assert (error["verdict"], error["verdict_reasons"]) == (FAIL, ["rows missing"])
    legacy = complete_verdict({"response_tokens": 4, "fingerprint_verified": False}, {})
    assert legacy["verdict"] == FAIL and legacy["termination_verified"] is None


def test_report_bands_for_evidence() -> None:
    assert band_of_report({"verdict": SUSPECT, "verified": False}) == SUSPECT
    assert band_of_report({"verified": True}) == PASS and band_of_report({"verified": False}) == FAIL
    assert band_of_report({"error": "x", "verdict": FAIL}) is None
    assert [band_of_score(s, 2.0) for s in (0.0, 1.0, 1.01, 2.0, 2.01)] == [PASS, PASS, SUSPECT, SUSPECT, FAIL]


def test_one_outlier_never_convicts_and_cheats_go_within_three() -> None:
    for band in (SUSPECT, FAIL):
        w = BandEvidence()
        w.add(band)
        assert not w.rejected
    for first, second, third in [(SUSPECT, SUSPECT, SUSPECT), (FAIL, SUSPECT, SUSPECT), (SUSPECT, FAIL, PASS)]:
        w = BandEvidence()
        for band in (first, second):
            w.add(band)
        rejected_by_two = w.rejected
        w.add(third)
        assert w.rejected or third == PASS, (first, second, third)
        assert rejected_by_two == (first == FAIL and second == FAIL)
    w = BandEvidence()
    w.add(FAIL)
    w.add(FAIL)
    assert w.rejected_at == 2
    w = BandEvidence()
    for band in (SUSPECT, SUSPECT, PASS, SUSPECT):
        w.add(band)
    assert not w.rejected, "a pass between suspects costs the third its conviction"
    w.add(SUSPECT)
    assert w.rejected_at == 5


def test_honest_workers_are_accused_at_most_at_the_stated_rate() -> None:
    """Workers at the assumed honest rates (raised so that accusations happen at all)."""
    rng = random.Random(7)
    w0 = BandEvidence(false_accusation_rate=0.05, honest_suspect_rate=0.03, honest_fail_rate=0.003, floor=0.01)
    steps = w0.steps
    expectation = (1 - 0.033) * math.exp(steps[PASS]) + 0.03 * math.exp(steps[SUSPECT]) + 0.003 * math.exp(steps[FAIL])
    assert expectation == pytest.approx(1.0)
    workers, n = 3000, 100
    accused = 0
    for _ in range(workers):
        w = BandEvidence(false_accusation_rate=0.05, honest_suspect_rate=0.03, honest_fail_rate=0.003, floor=0.01)
        for _ in range(n):
            u = rng.random()
            w.add(FAIL if u < 0.003 else SUSPECT if u < 0.033 else PASS)
        accused += w.rejected
    bound = w0.honest_bound(n)
    assert accused / workers <= bound + 3 * math.sqrt(bound / workers), (accused, bound)
    assert accused > 0, "the simulation must be able to accuse"


def test_rates_that_leave_no_room_are_refused() -> None:
    with pytest.raises(ValueError, match="too high"):
        BandEvidence(honest_suspect_rate=0.08, honest_fail_rate=0.02)
    with pytest.raises(ValueError, match="responses_to_reject"):
        BandEvidence(responses_to_reject=1)


def test_calibration_files_carry_the_fail_factor() -> None:
    from sglang_rl.fingerprint.calibration import Calibration

    cal = Calibration("m", "/m", 128, 32, 1e-3, BOUND, None, fail_factor=3.0)
    doc = cal.to_dict()
    assert calibration_from_dict(doc).policy().fail_factor == 3.0
    assert calibration_from_dict({k: v for k, v in doc.items() if k != "fail_factor"}).fail_factor == 2.0
    for bad in (1.0, 0.5, "2", True):
        with pytest.raises(CalibrationError, match="fail_factor"):
            calibration_from_dict({**doc, "fail_factor": bad})
    assert ThresholdPolicy(BOUND).outer(BOUND) == Thresholds(20, 4.0, 4.0)


def test_rollouts_carry_their_limit_and_workers_count_bands() -> None:
    from sglang_rl_client import cli
    from sglang_rl_client.fingerprint import Fingerprint, encode_fingerprint
    from sglang_rl_client.verifier import Rollout, RolloutError, request_body

    fp = encode_fingerprint(Fingerprint(topk=1, chunk_size=32, n_rows=2, proofs=(b"\x00\x05\x00\x01",)))
    record = {"input_ids": [1, 2], "output_ids": [3, 2], "fingerprint": fp, "max_new_tokens": 64, "step": 1}
    rollout = Rollout.from_dict(record)
    rollout.check()
    assert rollout.data == {"step": 1}
    assert request_body([rollout])["sampling_params"] == {"max_new_tokens": 0, "toploc_verification_max_new_tokens": 64}
    assert "toploc_verification_max_new_tokens" not in Rollout.from_dict({**record, "max_new_tokens": None}).sampling_params()
    for bad in (0, "64", True):
        with pytest.raises(RolloutError, match="max_new_tokens must be a positive integer"):
            Rollout.from_dict({**record, "max_new_tokens": bad}).check()
    tally = cli.Tally()
    for result in ({"verified": True, "verdict": PASS}, {"verified": False, "verdict": SUSPECT},
                   {"verified": False, "verdict": FAIL, "verdict_reasons": ["x"]}, {"verified": False, "error": "e"}):
        tally.add("w", "verified" if result["verified"] else "failed", result)
    [worker] = tally.worker_records()
    assert (worker["pass"], worker["suspect"], worker["fail"], worker["verdict"]) == (1, 1, 1, "failed")
    assert cli._why({"verdict": FAIL, "verdict_reasons": ["a", "b"]}) == " (fail: a; b)"
