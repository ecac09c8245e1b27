"""The termination check and verdict bands against the real verifier (the suite's TOPLOC server).

Honest greedy chat answers that end on EOS must pass with the EOS probability reported. A worker
that stops early must be caught although its fingerprint is valid: it cuts an honest answer,
appends EOS, and fingerprints the forced tokens by a prefill of its own (rows from transformers,
which the float32 CPU server reproduces), or it stops at a length below the limit it claims.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_rl.fingerprint import encode_fingerprint
from sglang_rl.fingerprint.codec import build_fingerprint
from toploc_helpers import gen_chat, pmap, post, record, verify_chat

QUESTIONS = ("What is 2+2?", "Name a primary color.", "What is the capital of Italy?")
MAX_TOKENS = 64
LIMIT_FIELD = "toploc_verification_max_new_tokens"


@pytest.fixture(scope="module")
def answers(toploc_server) -> list[dict]:
    """Greedy chat answers that stopped on EOS before the limit."""
    samples = pmap(lambda q: gen_chat(toploc_server.url, [{"role": "user", "content": q}], max_tokens=MAX_TOKENS)[0],
                   QUESTIONS, workers=3)
    assert all(s["finish_reason"] == "stop" and len(s["output_ids"]) >= 4 for s in samples), samples
    return samples


def verify(url: str, ids: list[int], fp: str, **fields) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
            "toploc_verification_fingerprint_to_validate": fp, **fields}
    resp = post(url, "/generate", body)
    assert resp.status_code == 200, resp.text
    return json.loads(resp.json()["meta_info"]["toploc_verification_fingerprint_validation_result"])


def forged(model, input_ids: list[int], output_ids: list[int]) -> tuple[str, torch.Tensor]:
    """A fingerprint of `output_ids` built from their transformers rows (a worker's own prefill),
    and the model's log-probs at every response position (to pick where to cut)."""
    seq = torch.tensor([input_ids + output_ids[:-1]])
    with torch.no_grad():
        out = model(input_ids=seq, output_hidden_states=True)
    L, n = len(input_ids), len(output_ids)
    rows = out.hidden_states[-1][0][L - 1: L - 1 + n]
    logprobs = torch.log_softmax(out.logits[0][L - 1: L - 1 + n].float(), -1)
    return encode_fingerprint(build_fingerprint(rows.bfloat16(), topk=128, chunk_size=32)), logprobs


def test_honest_eos_answers_pass_with_their_eos_probability(toploc_server, answers) -> None:
    reports = pmap(lambda s: verify(toploc_server.url, s["input_ids"] + s["output_ids"], s["fingerprint"],
                                    **{LIMIT_FIELD: MAX_TOKENS}), answers, workers=3)
    for sample, rep in zip(answers, reports):
        assert rep["verdict"] == "pass" and rep["verified"] is True and rep["verdict_reasons"] == [], rep
        assert rep["ends_on_eos"] is True and rep["response_last_token"] == sample["output_ids"][-1]
        assert 0.02 <= rep["eos_prob"] <= 1.0 and rep["termination_verified"] is True
        assert rep["min_eos_prob"] == 0.001 and rep["max_new_tokens"] == MAX_TOKENS
        assert rep["fingerprint_verdict"] == "pass" and rep["fail_thresholds"]["max_exp_mismatches"] == 76
    record("termination_honest_eos", eos_prob=[round(r["eos_prob"], 4) for r in reports])


def test_a_forced_early_stop_is_caught(toploc_server, answers, hf_model) -> None:
    """Cut each answer where the model least expects EOS and append EOS (or put EOS in place of
    the token there): the forged fingerprint verifies, the termination check fails."""
    eos = answers[0]["output_ids"][-1]
    cases = []
    for s in answers:
        _, logprobs = forged(hf_model, s["input_ids"], s["output_ids"])
        cut = int(logprobs[1:-1, eos].argmin()) + 1  # keep >= 1 token; never the natural end
        for forced in (s["output_ids"][:cut] + [eos], s["output_ids"][:cut - 1] + [eos]):
            if len(forced) >= 2:
                cases.append((s["input_ids"], forced))
    fps = [forged(hf_model, ids, out)[0] for ids, out in cases]
    reports = pmap(lambda c: verify(toploc_server.url, c[0][0] + c[0][1], c[1], **{LIMIT_FIELD: MAX_TOKENS}),
                   list(zip(cases, fps)), workers=3)
    for rep in reports:
        assert rep["fingerprint_verdict"] == "pass", rep  # the forged fingerprint itself is sound
        assert rep["ends_on_eos"] is True and rep["eos_prob"] < 0.001, rep
        assert rep["verdict"] == "fail" and rep["verified"] is False and rep["termination_verified"] is False
        assert any("probability" in reason for reason in rep["verdict_reasons"]), rep
    record("termination_forced_stop", caught=len(reports), total=len(cases),
           eos_prob=[f"{r['eos_prob']:.2e}" for r in reports])


def test_a_stop_short_of_the_claimed_limit_is_caught(toploc_server, answers) -> None:
    """A response cut without EOS (generated with a smaller limit) fails against the limit the
    operator states, and passes against its own."""
    url = toploc_server.url
    s = answers[0]
    short = gen_chat(url, s["messages"], max_tokens=len(s["output_ids"]) - 2)[0]
    assert short["finish_reason"] == "length" and short["output_ids"] == s["output_ids"][:-2]
    ids = short["input_ids"] + short["output_ids"]
    claimed = verify(url, ids, short["fingerprint"], **{LIMIT_FIELD: MAX_TOKENS})
    assert claimed["fingerprint_verdict"] == "pass" and claimed["ends_on_eos"] is False
    assert claimed["verdict"] == "fail" and claimed["termination_verified"] is False, claimed
    assert any("before its max_new_tokens" in r for r in claimed["verdict_reasons"]), claimed
    own = verify(url, ids, short["fingerprint"], **{LIMIT_FIELD: len(short["output_ids"])})
    assert own["verdict"] == "pass" and own["termination_verified"] is True, own
    unchecked = verify(url, ids, short["fingerprint"])
    assert unchecked["verdict"] == "pass" and unchecked["termination_verified"] is None, unchecked
    over = verify(url, ids, short["fingerprint"], **{LIMIT_FIELD: 2})
    assert over["verdict"] == "fail" and "more than its max_new_tokens" in over["verdict_reasons"][0], over


def test_chat_form_leaves_out_the_eos_and_bad_limits_are_refused(toploc_server, answers) -> None:
    url = toploc_server.url
    s = answers[0]
    status, rep = verify_chat(url, s["messages"], s["text"], s["fingerprint"])
    assert status == 200 and rep["verdict"] == "pass", rep
    assert "ends_on_eos" not in rep and rep["termination_verified"] is None
    ids = s["input_ids"] + s["output_ids"]
    for bad in (0, -3, True, "64", 1.5):
        status, text = _raw(url, ids, s, bad)
        assert status == 400 and LIMIT_FIELD in text, (bad, status, text)
    resp = post(url, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, LIMIT_FIELD: 8})
    assert resp.status_code == 400 and "verification request" in resp.text, resp.text


def _raw(url: str, ids: list[int], s: dict, limit) -> tuple[int, str]:
    resp = post(url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                   "toploc_verification_fingerprint_to_validate": s["fingerprint"], LIMIT_FIELD: limit})
    return resp.status_code, resp.text
