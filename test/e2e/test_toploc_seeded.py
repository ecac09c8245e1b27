"""Seeded sampling on a real server: responses sampled with a seed at temperature 0.7, top_p 0.9
verify token by token; the same responses claimed at another temperature, top_p or seed fail;
a seeded draw does not depend on the batch it ran in; requests without the field are untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_rl_client.bands import BandEvidence, band_of_report
from toploc_helpers import pmap, post, record
from sglang_rl.calibration.measure import gsm8k_prompts

MAX_TOKENS = 80
SEED = 1234
HONEST = {"temperature": 0.7, "top_p": 0.9}


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return gsm8k_prompts(tokenizer, 6, offset=500)


def _generate(url: str, prompt: list[int], seed: int = SEED, seeded: bool = True, **params) -> dict:
    body = {"input_ids": prompt, "return_output_ids": True,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "sampling_seed": seed, **HONEST, **params}}
    if seeded:
        body["toploc_verification_seeded_sampling"] = True
    resp = post(url, "/generate", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return {"prompt": prompt, "output_ids": out["meta_info"].get("output_ids"), "text": out["text"],
            "meta": out["meta_info"]}


def _verify(url: str, sample: dict, **claim) -> dict:
    params = {"max_new_tokens": 0, **claim}
    resp = post(url, "/generate", {
        "input_ids": sample["prompt"] + sample["output_ids"], "sampling_params": params,
        "toploc_verification_fingerprint_to_validate": sample["meta"]["toploc_verification_fingerprints"][-1],
        "toploc_verification_expect_seeded": True})
    assert resp.status_code == 200, resp.text
    return json.loads(resp.json()["meta_info"]["toploc_verification_fingerprint_validation_result"])


@pytest.fixture(scope="module")
def samples(toploc_server, prompts) -> list[dict]:
    return pmap(lambda p: _generate(toploc_server.url, p), prompts)


def test_honest_seeded_responses_verify(toploc_server, samples) -> None:
    reports = pmap(lambda s: _verify(toploc_server.url, s, sampling_seed=SEED, **HONEST), samples)
    record("seeded_honest", responses=len(reports), checked=sum(r["seeded_checked"] for r in reports),
           undecided=sum(r["seeded_undecided"] for r in reports), consistent=sum(r["seeded_consistent"] for r in reports))
    evidence = BandEvidence()
    for report in reports:
        evidence.add(band_of_report(report))
    assert not evidence.rejected, [r["verdict_reasons"] for r in reports]
    for sample, report in zip(samples, reports):
        assert report["fingerprint_verified"], report
        assert report["seeded_consistent"] and report["seeded_mismatches"] == 0, report
        assert report["seeded_checked"] + report["seeded_undecided"] == len(sample["output_ids"])
        assert report["seeded_checked"] >= len(sample["output_ids"]) * 2 // 3, report
        assert not any("seeded" in reason for reason in report["verdict_reasons"]), report


@pytest.mark.parametrize("claim,within", [
    ({"temperature": 1.0, "top_p": 0.9, "sampling_seed": SEED}, 3),
    # top_p 1.0 vs 0.9 differs only where the cut tail wins a draw: 5 of these 6 responses fail
    ({"temperature": 0.7, "top_p": 1.0, "sampling_seed": SEED}, 6),
    ({"temperature": 0.7, "top_p": 0.9, "sampling_seed": SEED + 1}, 3),
], ids=["temperature", "top_p", "seed"])
def test_other_claims_fail(toploc_server, samples, claim, within) -> None:
    reports = pmap(lambda s: _verify(toploc_server.url, s, **claim), samples)
    failed = [not r["seeded_consistent"] for r in reports]
    counts = [(r["seeded_mismatches"], r["seeded_checked"]) for r in reports]
    record("seeded_other_claim", claim=claim, responses=len(reports), failed=sum(failed), counts=counts)
    evidence = BandEvidence()
    for report in reports:
        evidence.add(band_of_report(report))
    record("seeded_other_claim_rejected_at", claim=claim, response=evidence.rejected_at)
    assert evidence.rejected and evidence.rejected_at <= within, counts
    for report, bad in zip(reports, failed):
        assert report["verified"] is (False if bad else report["verified"])
        if bad:
            assert report["verdict"] == "fail"
            assert any("expect_seeded" in reason for reason in report["verdict_reasons"]), report


def test_sglang_rl_verify_checks_seeded_claims(toploc_server, samples, tmp_path: Path) -> None:
    """The client's command sends a record's `seeded_sampling` claim: the honest worker's claims
    verify, a worker that claims temperature 1.0 for the same responses fails on every one."""
    honest = {"seed": SEED, **HONEST}
    lines = [{"input_ids": s["prompt"], "output_ids": s["output_ids"], "worker": worker,
              "fingerprint": s["meta"]["toploc_verification_fingerprints"][-1],
              "seeded_sampling": claim}
             for worker, claim in (("honest", honest), ("liar", {**honest, "temperature": 1.0}))
             for s in samples[:3]]
    path, out = tmp_path / "rollouts.jsonl", tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run([str(Path(sys.executable).parent / "sglang-rl-verify"), str(path), "--server",
                          toploc_server.url, "--out", str(out), "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    responses = [r for r in records if r["type"] == "response"]
    assert [r["status"] for r in responses] == ["verified"] * 3 + ["failed"] * 3, \
        [r.get("result", {}).get("verdict_reasons") or r.get("error") for r in responses]
    assert all(r["result"]["expect_seeded"] and r["result"]["seeded_checked"] > 0 for r in responses)
    assert {r["worker"]: r["verdict"] for r in records if r["type"] == "worker"} == {"honest": "verified",
                                                                                      "liar": "failed"}


def test_a_seeded_draw_does_not_depend_on_its_batch(toploc_server, prompts, samples) -> None:
    alone = _generate(toploc_server.url, prompts[0])
    assert alone["output_ids"] == samples[0]["output_ids"]


def test_requests_without_the_field_get_sglangs_answer(toploc_server, plain_server, prompts) -> None:
    def greedy(url: str) -> dict:
        resp = post(url, "/generate", {"input_ids": prompts[1],
                                        "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}})
        assert resp.status_code == 200, resp.text
        return resp.json()

    # the greedy request runs next to seeded ones (same batches) and stays sglang's
    mixed = pmap(lambda i: greedy(toploc_server.url) if i == 0 else _generate(toploc_server.url, prompts[i]),
                 range(4))
    reference = greedy(plain_server.url)
    assert mixed[0]["text"] == reference["text"]


@pytest.mark.parametrize("body,reason", [
    ({"sampling_params": {"max_new_tokens": 4}, "toploc_verification_seeded_sampling": True}, "sampling_seed"),
    ({"sampling_params": {"max_new_tokens": 4, "sampling_seed": 1, "n": 2},
      "toploc_verification_seeded_sampling": True}, "n > 1"),
    ({"sampling_params": {"max_new_tokens": 4, "sampling_seed": 1, "frequency_penalty": 0.5},
      "toploc_verification_seeded_sampling": True}, "frequency_penalty"),
    ({"sampling_params": {"max_new_tokens": 4, "sampling_seed": 1},
      "toploc_verification_seeded_sampling": "yes"}, "true or false"),
])
def test_bad_seeded_requests_get_400(toploc_server, prompts, body, reason) -> None:
    resp = post(toploc_server.url, "/generate", {"input_ids": prompts[0], **body})
    assert resp.status_code == 400 and reason in resp.text, resp.text


def test_bad_seeded_claims_get_400(toploc_server, samples) -> None:
    sample = samples[0]
    base = {"input_ids": sample["prompt"] + sample["output_ids"],
            "toploc_verification_fingerprint_to_validate": sample["meta"]["toploc_verification_fingerprints"][-1],
            "toploc_verification_expect_seeded": True}
    no_seed = post(toploc_server.url, "/generate", {**base, "sampling_params": {"max_new_tokens": 0}})
    assert no_seed.status_code == 400 and "sampling_seed" in no_seed.text
    both = post(toploc_server.url, "/generate", {**base, "toploc_verification_expect_greedy": True,
                                                 "sampling_params": {"max_new_tokens": 0, "sampling_seed": 1}})
    assert both.status_code == 400 and "exclude each other" in both.text
    zero = post(toploc_server.url, "/generate", {**base, "sampling_params": {
        "max_new_tokens": 0, "sampling_seed": 1, "temperature": 0.0}})
    assert zero.status_code == 400 and "temperature" in zero.text
