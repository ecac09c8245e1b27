"""Calibrating across hosts on a real CPU server: `sglang-rl calibrate-server --save-rollouts`
writes a generator's responses, `--verify-rollouts` checks them again on a verifier (as a host
of another GPU type would), and `sglang-rl calibrate --stats` fits on both sets of records."""

from __future__ import annotations

import json
from pathlib import Path

from e2e_servers import Server
from sglang_rl.calibration import fit, servers
from sglang_rl.calibration.measure import read_records
from sglang_rl.calibration.rollouts import read_rollouts, write_rollouts
from sglang_rl.fingerprint.calibration import load_calibration

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def test_saved_rollouts_verify_elsewhere_and_fit_with_the_first_records(
    toploc_server: Server, model_path: str, tmp_path: Path, capsys
) -> None:
    saved, leg_a, leg_b = tmp_path / "rollouts", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    saved.mkdir()
    honest = saved / "rollouts_honest_b10.jsonl.gz"
    assert servers.main(["--generator", toploc_server.url, "--verifier", toploc_server.url, "--model-path", model_path,
                         "--config", "honest_b10", "--prompts", "10", "--max-tokens", "40", "--batch", "10",
                         "--generator-gpu", H100, "--verifier-gpu", H100, "--save-rollouts", str(honest),
                         "--out", str(leg_a)]) == 0
    rows = read_rollouts(honest)
    assert [r["prompt"] for r in rows] == list(range(10)) and all(r["honest"] and r["generator_gpu"] == H100 for r in rows)
    assert [r["max_tokens"] for r in rows] == [40, 40, 33, 33] * 2 + [40, 40]
    # a cheat of the saved kind: one output token changed after the fact, the fingerprint kept
    edited = [dict(r, config="edited", honest=False,
                   output_ids=r["output_ids"][:5] + [(r["output_ids"][5] + 1) % 1000] + r["output_ids"][6:])
              for r in rows[:2]]
    write_rollouts(edited, saved / "rollouts_edited.jsonl")

    assert servers.main(["--verify-rollouts", str(saved), "--verifier", toploc_server.url,
                         "--verifier-config", "verifier_b", "--verifier-gpu", H200, "--batch", "10",
                         "--out", str(leg_b)]) == 0
    a, b = read_records([leg_a]), read_records([leg_b])
    assert all(r["verified"] and r["verifier_gpu"] == H100 and r["config"] == "honest_b10" for r in a)
    by_config: dict[str, list[dict]] = {}
    for r in b:
        by_config.setdefault(r["config"], []).append(r)
    assert sorted(by_config) == ["edited:H100>verifier_b:H200", "honest_b10:H100>verifier_b:H200"]
    assert [r["verified"] for r in by_config["honest_b10:H100>verifier_b:H200"]] == [True] * 10
    assert [r["verified"] for r in by_config["edited:H100>verifier_b:H200"]] == [False] * 2
    assert {(r["generator_gpu"], r["verifier_gpu"], r["verifier_config"]) for r in b} == {(H100, H200, "verifier_b")}
    # the same responses verified twice give the same statistics: leg B checked what leg A saved
    assert [r["chunks"] for r in by_config["honest_b10:H100>verifier_b:H200"]] == [r["chunks"] for r in a]

    cal_path = tmp_path / "cal.json"
    capsys.readouterr()
    assert fit.main(["--model-path", model_path, "--out", str(cal_path), "--no-measure", "--workers", "10",
                     "--stats", str(leg_a), "--stats", str(leg_b)]) == 0
    cal = load_calibration(cal_path)
    configs = json.loads(cal_path.read_text())["summary"]["configs"]
    assert configs["honest_b10"]["responses"] == 10 and configs["edited:H100>verifier_b:H200"]["responses"] == 2
    assert configs["edited:H100>verifier_b:H200"]["rejected_per_response"] == 1.0
    assert cal.full.max_exp_mismatches >= 1
