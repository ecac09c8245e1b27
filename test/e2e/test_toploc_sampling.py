"""The temperature-1 sampling test on a real server: honest sampled responses pass, greedy or
hotter responses presented as temperature-1 samples fail at the worker level (one short,
low-entropy response carries little evidence), and the two expectations exclude each other."""

from __future__ import annotations

import pytest

from toploc_helpers import gen_generate, pmap, post, verify_tokens
from sglang_rl.calibration.measure import gsm8k_prompts
from sglang_rl.fingerprint.sampling import combined_z

MAX_TOKENS = 64
TEMPERATURES = (1.0, 0.0, 1.6)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return gsm8k_prompts(tokenizer, 8, offset=300)


def _check(reports: list[dict], samples: list[dict]) -> None:
    for sample, report in zip(samples, reports):
        assert report["fingerprint_verified"], report  # the prefill is honest in every case
        assert report["expect_sampled"] is True
        assert report["sampling_checked"] == len(sample["output_ids"])


@pytest.fixture(scope="module")
def checked(toploc_server, prompts) -> dict:
    """Reports of the responses at each temperature (and at 1.0 through /v1/completions), every
    generation in one batch and every verification in one batch."""
    url = toploc_server.url
    jobs = [(t, "generate", p) for t in TEMPERATURES for p in prompts] + [(1.0, "completions", p) for p in prompts[:2]]
    samples = pmap(lambda job: gen_generate(url, input_ids=job[2], max_tokens=MAX_TOKENS, temperature=job[0])[0],
                   jobs, workers=len(jobs))
    results = pmap(lambda js: verify_tokens(url, js[1]["input_ids"] + js[1]["output_ids"], js[1]["fingerprint"],
                                            via=js[0][1], expect_sampled=True), list(zip(jobs, samples)),
                   workers=len(jobs))
    assert all(status == 200 for status, _ in results), results
    out: dict = {}
    for (temperature, via, _), sample, (_, report) in zip(jobs, samples, results):
        out.setdefault((temperature, via), ([], []))
        out[(temperature, via)][0].append(report)
        out[(temperature, via)][1].append(sample)
    for reports, group in out.values():
        _check(reports, group)
    return {key: reports for key, (reports, _) in out.items()}


def _worker_z(reports: list[dict]) -> float:
    return combined_z([r["sampling_z"] for r in reports], [r["sampling_checked"] for r in reports])


def test_honest_temperature_1_samples_pass(checked) -> None:
    reports = checked[(1.0, "generate")]
    assert all(r["verified"] and r["sampling_consistent"] for r in reports), [r["sampling_z"] for r in reports]
    assert abs(_worker_z(reports)) < 4.0
    assert all(r["verified"] for r in checked[(1.0, "completions")])


@pytest.mark.parametrize("temperature,sign", [(0.0, -1), (1.6, 1)])
def test_other_temperatures_fail_at_the_worker_level(checked, temperature, sign) -> None:
    reports = checked[(temperature, "generate")]
    assert sign * _worker_z(reports) > 4.0, [r["sampling_z"] for r in reports]
    assert all((r["verified"] == r["sampling_consistent"]) for r in reports)


def test_greedy_and_sampled_expectations_exclude_each_other(toploc_server, prompts) -> None:
    sample = gen_generate(toploc_server.url, input_ids=prompts[0], max_tokens=8)[0]
    resp = post(toploc_server.url, "/generate", {
        "input_ids": sample["input_ids"] + sample["output_ids"], "sampling_params": {"max_new_tokens": 0},
        "toploc_verification_fingerprint_to_validate": sample["fingerprint"],
        "toploc_verification_expect_greedy": True, "toploc_verification_expect_sampled": True})
    assert resp.status_code == 400 and "exclude each other" in resp.text
    status, report = verify_tokens(toploc_server.url, sample["input_ids"] + sample["output_ids"],
                                   sample["fingerprint"], expect_greedy=True)
    assert status == 200 and report["verified"] and "sampling_z" not in report
