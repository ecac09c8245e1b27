"""--toploc-verification-calibration on a real CPU server: the file's bounds (short final chunks
included) are applied and named in every result. (A bad file stops the server while its flags are
read: test/unit/test_server_args.py.)"""

from __future__ import annotations

from differential import CALIBRATION, DIFFERENTIAL_TOPLOC
from e2e_servers import Server, server_fixture
from sglang_rl.fingerprint.calibration import UNCALIBRATED, load_calibration
from toploc_helpers import gen_generate, verify_tokens

calibrated_server = server_fixture(DIFFERENTIAL_TOPLOC, scope="module")


def test_calibrated_bounds_are_applied_and_named(calibrated_server: Server, hs_server: Server) -> None:
    cal = load_calibration(CALIBRATION)
    samples = gen_generate(calibrated_server.url, text="Question: what is 17 * 3? Answer:", max_tokens=40,
                           ignore_eos=True)
    ids, fp = samples[0]["input_ids"] + samples[0]["output_ids"], samples[0]["fingerprint"]
    status, report = verify_tokens(calibrated_server.url, ids, fp)
    assert status == 200 and report["verified"], report
    assert report["thresholds_source"] == f"calibrated: {cal.model_name}, file {CALIBRATION}"
    assert report["thresholds"]["max_exp_mismatches"] == cal.full.max_exp_mismatches
    assert report["num_chunks"] == 2 and report["response_tokens"] == 40
    assert report["short_chunk_thresholds"]["max_mant_err_mean"] == cal.short.max_mant_err_mean
    # the same response on a server of the same model without the file: the default bounds, named as such
    status, default = verify_tokens(hs_server.url, ids, fp)
    assert status == 200 and default["verified"], default
    assert default["thresholds_source"] == UNCALIBRATED
