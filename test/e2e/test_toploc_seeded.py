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
ALONE_TOKENS = 24
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


def _greedy(url: str, prompt: list[int]) -> dict:
    resp = post(url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def batch(toploc_server, prompts) -> dict:
    """The seeded responses, and a greedy request without the field sent among them (same batches)."""
    outs = pmap(lambda i: _greedy(toploc_server.url, prompts[1]) if i == len(prompts)
                else _generate(toploc_server.url, prompts[i]), range(len(prompts) + 1))
    return {"seeded": outs[:-1], "greedy": outs[-1]}


@pytest.fixture(scope="module")
def samples(batch) -> list[dict]:
    return batch["seeded"]


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


# (claim, how many responses it is checked on, within how many of them the worker is rejected).
# temperature 1.0 and seed + 1 are rejected at the 2nd response; top_p 1.0 vs 0.9 differs only
# where the cut tail wins a draw: 5 of these 6 responses fail, the worker at the 4th
OTHER_CLAIMS = {
    "temperature": ({"temperature": 1.0, "top_p": 0.9, "sampling_seed": SEED}, 3, 3),
    "top_p": ({"temperature": 0.7, "top_p": 1.0, "sampling_seed": SEED}, 6, 6),
    "seed": ({"temperature": 0.7, "top_p": 0.9, "sampling_seed": SEED + 1}, 3, 3),
}


def test_other_claims_fail(toploc_server, samples) -> None:
    """Every other claim's verifications go as one batch."""
    jobs = [(name, sample) for name, (_, responses, _) in OTHER_CLAIMS.items() for sample in samples[:responses]]
    results = pmap(lambda job: _verify(toploc_server.url, job[1], **OTHER_CLAIMS[job[0]][0]), jobs, workers=len(jobs))
    for name, (claim, _, within) in OTHER_CLAIMS.items():
        reports = [report for (job_name, _), report in zip(jobs, results) if job_name == name]
        failed = [not r["seeded_consistent"] for r in reports]
        counts = [(r["seeded_mismatches"], r["seeded_checked"]) for r in reports]
        record("seeded_other_claim", claim=claim, responses=len(reports), failed=sum(failed), counts=counts)
        evidence = BandEvidence()
        for report in reports:
            evidence.add(band_of_report(report))
        record("seeded_other_claim_rejected_at", claim=claim, response=evidence.rejected_at)
        assert evidence.rejected and evidence.rejected_at <= within, (name, counts)
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
    """The first tokens of a response, drawn alone, are those drawn in the batch."""
    alone = _generate(toploc_server.url, prompts[0], max_new_tokens=ALONE_TOKENS)
    assert alone["output_ids"] == samples[0]["output_ids"][:ALONE_TOKENS]


def test_requests_without_the_field_get_sglangs_answer(batch, plain_server) -> None:
    """The greedy request that ran next to the seeded ones stays sglang's."""
    assert batch["greedy"]["text"] == _greedy(plain_server.url, batch["seeded"][1]["prompt"])["text"]


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
