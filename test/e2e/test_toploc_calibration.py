"""--toploc-verification-calibration on a real CPU server: the file's bounds (short final chunks
included) are applied and named in every result; a bad file stops the server at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from e2e_servers import Server, Spec, server_fixture
from sglang_rl.fingerprint.calibration import load_calibration
from toploc_helpers import gen_generate, verify_tokens

CALIBRATION = Path(__file__).resolve().parents[2] / "docs" / "results" / "cpu_smollm2_calibration.json"


CALIBRATED = Spec("toploc-calibrated", ("--toploc-verification", "--toploc-verification-calibration", str(CALIBRATION)))
calibrated_server = server_fixture(CALIBRATED, scope="module")


def test_calibrated_bounds_are_applied_and_named(calibrated_server: Server) -> None:
    cal = load_calibration(CALIBRATION)
    samples = gen_generate(calibrated_server.url, text="Question: what is 17 * 3? Answer:", max_tokens=40,
                           ignore_eos=True)
    status, report = verify_tokens(calibrated_server.url, samples[0]["input_ids"] + samples[0]["output_ids"],
                                   samples[0]["fingerprint"])
    assert status == 200 and report["verified"], report
    assert report["thresholds_source"] == f"calibrated: {cal.model_name}, file {CALIBRATION}"
    assert report["thresholds"]["max_exp_mismatches"] == cal.full.max_exp_mismatches
    assert report["num_chunks"] == 2 and report["response_tokens"] == 40
    assert report["short_chunk_thresholds"]["max_mant_err_mean"] == cal.short.max_mant_err_mean


def test_a_bad_calibration_file_stops_the_server(model_path: str, tmp_path: Path) -> None:
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"format": "sglang-rl-toploc-calibration", "version": 9}))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--device", "cpu",
         "--toploc-verification", "--toploc-verification-calibration", str(bad)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "calibration version 9, this sglang-rl reads version 1" in proc.stderr + proc.stdout
