"""Saved rollouts of `sglang-rl calibrate-server`: the file format, where they are found, how a
record names the pairing, and one-line errors for what cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_rl.calibration import servers
from sglang_rl.calibration.rollouts import cross_config, gpu_label, read_rollouts, rollout_files, write_rollouts

ROW = {"config": "g", "honest": True, "prompt": 3, "input_ids": [1, 2], "output_ids": [5], "fingerprint": "AA==",
       "max_tokens": 64, "generator_gpu": "NVIDIA H100 80GB HBM3"}


def test_rollouts_round_trip_gzip_and_plain(tmp_path: Path) -> None:
    for name in ("r.jsonl.gz", "r.jsonl"):
        write_rollouts([ROW, dict(ROW, prompt=4)], tmp_path / name)
        assert read_rollouts(tmp_path / name) == [ROW, dict(ROW, prompt=4)]
    assert (tmp_path / "r.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"
    (tmp_path / "notes.txt").write_text("not a rollouts file")
    assert rollout_files([tmp_path]) == [tmp_path / "r.jsonl", tmp_path / "r.jsonl.gz"]


def test_a_rollout_without_its_fingerprint_is_named_by_line(tmp_path: Path) -> None:
    bad = dict(ROW)
    del bad["fingerprint"]
    write_rollouts([ROW, bad], tmp_path / "r.jsonl")
    with pytest.raises(ValueError, match=r"r.jsonl:2: a rollout needs fingerprint"):
        read_rollouts(tmp_path / "r.jsonl")


def test_pairing_names() -> None:
    assert gpu_label("NVIDIA H100 80GB HBM3") == "H100" and gpu_label("NVIDIA H200") == "H200"
    assert gpu_label("cpu") == "cpu"
    assert cross_config("fp8_kv", "NVIDIA H100 80GB HBM3", "verifier", "NVIDIA H200") == "fp8_kv:H100>verifier:H200"


@pytest.mark.parametrize("args, message", [
    (["--verify-rollouts", "{tmp}/none"], "no such file or folder"),
    (["--verify-rollouts", "{tmp}"], "no *.jsonl or *.jsonl.gz rollouts files"),
    (["--verify-rollouts", "{tmp}", "--generator", "http://127.0.0.1:9"], "takes no --generator"),
    ([], "--generator, --config and --model-path are needed"),
])
def test_bad_rollout_flags_are_one_line_errors(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    argv = [a.format(tmp=tmp_path) for a in args] + ["--verifier", "http://127.0.0.1:9", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        servers.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err


def _records(config: str, honest: bool, count: int) -> list[dict]:
    chunk = {"exp_mismatches": 1 if honest else 40, "mant_err_mean": 0.5, "mant_err_median": 0.5}
    return [{"config": config, "honest": honest, "prompt": i, "response_tokens": 64, "chunks": [chunk, chunk]}
            for i in range(count)]


def test_calibrate_reads_several_stats_files_after_one_flag(tmp_path: Path, capsys) -> None:
    from sglang_rl.calibration import fit
    from sglang_rl.calibration.measure import write_records
    from sglang_rl.fingerprint.calibration import load_calibration

    write_records(_records("same_type", True, 12), tmp_path / "a.jsonl")
    write_records(_records("g:H100>verifier:H200", True, 12) + _records("cheat:H100>verifier:H200", False, 4),
                  tmp_path / "b.jsonl.gz")
    out = tmp_path / "cal.json"
    assert fit.main(["--model-path", str(tmp_path), "--out", str(out), "--no-measure", "--workers", "5",
                     "--stats", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")]) == 0
    configs = load_calibration(out).summary["configs"]
    assert sorted(configs) == ["cheat:H100>verifier:H200", "g:H100>verifier:H200", "same_type"]
    assert configs["cheat:H100>verifier:H200"]["rejected_per_response"] == 1.0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fit.main(["--model-path", str(tmp_path), "--out", str(out), "--no-measure", "--stats", str(tmp_path / "none")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--stats" in err[0] and "none" in err[0], err
