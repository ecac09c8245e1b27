"""Worker-level evidence on synthetic result streams: honest workers are accused no more often
than the stated rate, cheats are caught within a few responses, the CLI reads saved results."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from sglang_rl.fingerprint import Thresholds
from sglang_rl.fingerprint.calibration import Calibration, ScoreHistogram, ThresholdPolicy, save_calibration
from sglang_rl.fingerprint.evidence import (
    ACCEPT,
    DEFAULT_EDGES,
    REJECT,
    SUSPECT,
    EvidencePolicy,
    WorkerEvidence,
    log_likelihood_ratios,
    response_score,
    score_bin,
)

# honest scores sit near 0; the cheat overlaps them but sits higher (bins of DEFAULT_EDGES)
HONEST = (300, 200, 150, 100, 50, 20, 5) + (0,) * 13
CHEAT = (10, 10, 20, 40, 60, 100, 100, 60, 30, 10) + (0,) * 10
HIST = ScoreHistogram(DEFAULT_EDGES, HONEST, {"cheat": CHEAT})
BOUNDS = ThresholdPolicy(full=Thresholds(10, 2.0, 2.0), short=Thresholds(20, 4.0, 4.0), source="test")


def bin_score(k: int) -> float:
    """A score inside bin k (its upper edge; 0 for the first bin)."""
    return 0.0 if k == 0 else DEFAULT_EDGES[k + 1] if math.isfinite(DEFAULT_EDGES[k + 1]) else 10.0


def stream(counts: tuple[int, ...], rng: random.Random):
    bins = range(len(counts))
    while True:
        yield bin_score(rng.choices(bins, weights=counts)[0])


def worker(policy: EvidencePolicy | None = None) -> WorkerEvidence:
    policy = policy or EvidencePolicy()
    return WorkerEvidence(DEFAULT_EDGES, log_likelihood_ratios(HIST, policy), BOUNDS, policy=policy)


def test_bin_scores_land_in_their_bins() -> None:
    assert [score_bin(bin_score(k), DEFAULT_EDGES) for k in range(len(HONEST))] == list(range(len(HONEST)))
    assert score_bin(math.inf, DEFAULT_EDGES) == len(HONEST) - 1


def test_each_response_is_a_fair_bet_for_an_honest_worker() -> None:
    """E_p[likelihood ratio] <= 1 under the smoothed honest pmf: what makes the statistic a
    supermartingale for honest workers (the false-accusation guarantee)."""
    for policy in (EvidencePolicy(), EvidencePolicy(min_responses_to_reject=1), EvidencePolicy(pseudo_count=3.0)):
        llr = log_likelihood_ratios(HIST, policy)
        total = sum(HONEST) + policy.pseudo_count * len(HONEST)
        expectation = sum((c + policy.pseudo_count) / total * math.exp(l) for c, l in zip(HONEST, llr))
        assert expectation <= 1.0 + 1e-12
        assert max(llr) <= -math.log(policy.false_accusation_rate) / policy.min_responses_to_reject + 1e-12
    no_cheats = log_likelihood_ratios(ScoreHistogram(DEFAULT_EDGES, HONEST), EvidencePolicy())
    assert no_cheats[0] < 0 < no_cheats[-1]


def test_honest_workers_are_accused_at_most_at_the_stated_rate() -> None:
    policy = EvidencePolicy(false_accusation_rate=0.05, suspect_level=0.2, accept_level=0.05, floor=0.01)
    rng = random.Random(1)
    n_workers, n_responses = 2000, 100
    accused = 0
    for _ in range(n_workers):
        w = worker(policy)
        scores = stream(HONEST, rng)
        for _ in range(n_responses):
            w.add_score(next(scores))
        accused += w.verdict == REJECT
    bound = policy.honest_bound(n_responses)
    assert bound == pytest.approx(0.1)
    assert accused / n_workers <= bound + 3 * math.sqrt(bound / n_workers), accused


def test_cheat_workers_are_caught_within_a_few_responses() -> None:
    """The cheat overlaps the honest scores (a third of its responses look honest): 99.5% of cheat
    workers are rejected within 16 responses, all within 32, none before min_responses_to_reject."""
    rng = random.Random(2)
    caught_at = []
    for _ in range(1000):
        w = worker()
        scores = stream(CHEAT, rng)
        while w.verdict != REJECT and w.responses < 32:
            w.add_score(next(scores))
        caught_at.append(w.rejected_at)
    assert all(n is not None for n in caught_at)
    assert sum(n <= 16 for n in caught_at) >= 995
    assert sorted(caught_at)[500] <= 6
    assert min(caught_at) >= EvidencePolicy().min_responses_to_reject


def test_a_worker_that_switches_to_cheating_is_caught_quickly() -> None:
    rng = random.Random(3)
    for _ in range(200):
        w = worker()
        honest, cheat = stream(HONEST, rng), stream(CHEAT, rng)
        for _ in range(300):
            w.add_score(next(honest))
        assert w.verdict == ACCEPT
        for _ in range(24):
            w.add_score(next(cheat))
        assert w.verdict == REJECT, w.state()


def test_one_extreme_response_does_not_accuse_two_do() -> None:
    """A score far beyond the bound is a fail band: the first makes the worker suspect, the
    second rejects it (the score test alone would wait for a third)."""
    w = worker()
    w.add_score(50.0)
    assert w.verdict == SUSPECT and w.failed == 1 and w.rejected_at is None
    w.add_score(50.0)
    assert w.verdict == REJECT and w.bands.rejected_at == 2 and w.rejected_at is None
    for _ in range(100):
        w.add_score(0.0)
    assert w.verdict == REJECT, "a rejection is final"


def test_cheat_probability_follows_the_evidence() -> None:
    rng = random.Random(4)
    honest, cheat = worker(), worker()
    h, c = stream(HONEST, rng), stream(CHEAT, rng)
    for _ in range(40):
        honest.add_score(next(h))
        cheat.add_score(next(c))
    assert honest.cheat_probability < 0.01 < 0.99 < cheat.cheat_probability
    assert honest.statistic == pytest.approx(math.log(EvidencePolicy().floor))


def test_scores_use_short_bounds_for_the_final_short_chunk_and_skip_errors() -> None:
    chunk = lambda e, m: {"exp_mismatches": e, "mant_err_mean": m, "mant_err_median": 0.0}  # noqa: E731
    report = {"response_tokens": 40, "chunks": [chunk(5, 0.5), chunk(16, 1.0)]}
    assert response_score(report, BOUNDS) == pytest.approx(0.8)
    assert response_score({**report, "response_tokens": 64}, BOUNDS) == pytest.approx(1.6)
    assert response_score({"error": "rows missing", "verified": False}, BOUNDS) is None
    w = worker()
    w.add_report({"error": "rows missing", "verified": False})
    assert (w.errors, w.responses, w.statistic) == (1, 0, 0.0)
    w.add_report({**report, "response_tokens": 64})
    assert (w.responses, w.failed) == (1, 1)


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="false_accusation_rate"):
        EvidencePolicy(false_accusation_rate=0.0)
    with pytest.raises(ValueError, match="suspect_level"):
        EvidencePolicy(false_accusation_rate=0.1, suspect_level=0.05)
    with pytest.raises(ValueError, match="floor"):
        EvidencePolicy(floor=0.5, accept_level=0.01)


def test_worker_evidence_script(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cal_path = tmp_path / "cal.json"
    save_calibration(
        Calibration("tiny", "/m", 128, 32, 1e-3, BOUNDS.full, BOUNDS.short, {}, HIST, "test"), cal_path
    )
    chunk = lambda e: {"exp_mismatches": e, "mant_err_mean": 0.0, "mant_err_median": 0.0}  # noqa: E731
    lines = []
    for i in range(12):
        lines.append({"worker": "honest-w", "result": {"verified": True, "response_tokens": 64,
                                                        "chunks": [chunk(0), chunk(0)]}})
        lines.append({"worker": "cheat-w", "result": json.dumps({"verified": True, "response_tokens": 64,
                                                                  "chunks": [chunk(5), chunk(6)]})})
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in lines))
    verify_json = tmp_path / "lone.json"
    verify_json.write_text(json.dumps([{"form": "token", "endpoint": "/v1/completions",
                                        "result": {"verified": True, "chunks": [chunk(0)]}}]))
    from sglang_rl_client import worker_evidence as script  # `sglang-rl evidence`
    assert script.main(["--calibration", str(cal_path), "--quiet", str(results), str(verify_json)]) == 1
    out = capsys.readouterr().out
    assert "cheat-w: REJECT after" in out
    assert "honest-w: ACCEPT after 12 responses" in out
    assert "lone: UNDECIDED after 1 responses" in out
    assert script.main(["--calibration", str(tmp_path / "nope.json"), str(results)]) == 2


def test_sampled_work_is_judged_by_the_z_of_all_its_tokens() -> None:
    """Honest sampling (each response's Z standard normal) is never accused over many responses;
    a worker whose responses each sit at Z = -2.4, inside the per-response bound (as sampling at
    0.7 often is), is rejected once the combined Z passes 5.5."""
    rng = random.Random(5)
    chunk = {"exp_mismatches": 0, "mant_err_mean": 0.0, "mant_err_median": 0.0}
    report = lambda z: {"response_tokens": 64, "chunks": [chunk, chunk], "sampling_z": z,  # noqa: E731
                        "sampling_checked": 64}
    for _ in range(50):
        honest = worker()
        for _ in range(200):
            honest.add_report(report(rng.gauss(0.0, 1.0)))
        assert honest.verdict != REJECT and honest.sampling_rejected_at is None
    cold = worker()
    verdicts = [cold.add_report(report(-2.4)) for _ in range(8)]
    assert verdicts[3] != REJECT and verdicts[-1] == REJECT
    assert cold.sampling_rejected_at == 6  # -2.4 * sqrt(6) = -5.88 passes 5.5; sqrt(5) does not
    state = cold.state()
    assert state["sampling_tokens"] == 8 * 64 and state["sampling_z"] == pytest.approx(-2.4 * math.sqrt(8))
    plain = worker()
    plain.add_report({"response_tokens": 64, "chunks": [chunk, chunk]})
    assert plain.sampling_tokens == 0 and plain.state()["sampling_z"] == 0.0
