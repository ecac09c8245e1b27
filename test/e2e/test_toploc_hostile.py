"""Hostile verification requests: each gets HTTP 400 with its reason, and the server keeps serving.

toploc's C++ verifier kills the process on some malformed proofs (zero modulus: SIGFPE; more
proofs than chunks: abort), so every bad input must be refused before it gets there. Each bad
request is sent at the same time as an honest generation on the same server; the honest request
must succeed, and the servers must still be alive (and still verify correctly) at the end.
"""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from sglang_rl.fingerprint import encode_fingerprint
from sglang_rl.fingerprint.codec import build_fingerprint
from toploc_helpers import (
    FP_FIELD,
    RESULT_FIELD,
    decode,
    gen_chat,
    gen_generate,
    pmap,
    post,
    record,
    sse_events,
    verify_sample,
)

HEADER = struct.Struct(">2sBBHI")


@pytest.fixture(scope="module")
def material(toploc_server) -> dict:
    url = toploc_server.url
    [tokens], [chat] = pmap(lambda job: job(), [
        lambda: gen_generate(url, text="The quick brown fox jumps over the lazy dog. Then the fox",
                             max_tokens=70, temperature=0.0, ignore_eos=True),
        lambda: gen_chat(url, [{"role": "user", "content": "Write two sentences about mountains."}],
                         max_tokens=45, temperature=0.0)])
    assert len(tokens["output_ids"]) == 70 and decode(tokens["fingerprint"]).num_chunks == 3
    return {"tokens": tokens, "chat": chat}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def bad_fingerprints(material: dict) -> dict[str, tuple[object, str]]:
    """name -> (value of toploc_verification_fingerprint_to_validate, expected reason substring)."""
    fp = material["tokens"]["fingerprint"]
    raw = base64.b64decode(fp)
    header, proofs = raw[: HEADER.size], raw[HEADER.size:]
    magic, version, chunk, topk, n_rows = HEADER.unpack(header)
    one_proof = proofs[: 2 + 2 * topk]
    zero_modulus = header + b"\x00\x00" + proofs[2:]
    rows = torch.randn(n_rows, 576, generator=torch.Generator().manual_seed(3))
    return {
        "not_base64": ("this is *not* base64!", "base64"),
        "truncated": (_b64(raw[:-6]), "payload has"),
        "zero_modulus": (_b64(zero_modulus), "modulus 0"),
        "wrong_chunk_count": (_b64(HEADER.pack(magic, version, chunk, topk, 64) + one_proof), "payload has"),
        "topk_64": (encode_fingerprint(build_fingerprint(rows, topk=64)), "topk=64"),
        "not_a_string": (12345, "toploc_verification_fingerprint_to_validate"),
    }


def _bad_request(url: str, endpoint: str, value: object, material: dict, max_tokens: int = 0,
                 prompt_ids: list[int] | None = None, reply: str | None = None):
    s, c = material["tokens"], material["chat"]
    ids = prompt_ids if prompt_ids is not None else s["input_ids"] + s["output_ids"]
    if endpoint == "generate":
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens},
                "toploc_verification_fingerprint_to_validate": value}
        return post(url, "/generate", body)
    if endpoint == "completions":
        body = {"model": "default", "prompt": ids, "max_tokens": max_tokens,
                "toploc_verification_fingerprint_to_validate": value}
        return post(url, "/v1/completions", body)
    messages = c["messages"] + [{"role": "assistant", "content": reply if reply is not None else c["text"]}]
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "toploc_verification_fingerprint_to_validate": value}
    return post(url, "/v1/chat/completions", body)


def _honest_generation(url: str, fingerprinted: bool) -> dict:
    """An honest 16-token generation; on the --toploc-verification server it must carry a
    fingerprint of 16 rows."""
    if fingerprinted:
        [sample] = gen_generate(url, text="Counting: one, two, three,", max_tokens=16, temperature=0.0,
                                ignore_eos=True)
        assert decode(sample["fingerprint"]).n_rows == 16
        return {"tokens": len(sample["output_ids"]), "fingerprinted": True}
    resp = post(url, "/generate", {"text": "Counting: one, two, three,",
                                   "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    assert FP_FIELD not in resp.json()["meta_info"]
    return {"tokens": resp.json()["meta_info"]["completion_tokens"], "fingerprinted": False}


def _with_honest_neighbour(url: str, fingerprinted: bool, send_bad):
    """Send the bad request and an honest generation to the same server at the same time."""
    with ThreadPoolExecutor(2) as pool:
        honest = pool.submit(_honest_generation, url, fingerprinted)
        bad = pool.submit(send_bad)
        return bad.result(), honest.result()


def _cases(material: dict, toploc_url: str, plain_url: str) -> list[tuple[str, str, str, object]]:
    """(case name, endpoint, server url, callable sending the bad request, expected reason)."""
    cases = []
    for name, (value, reason) in bad_fingerprints(material).items():
        for endpoint in ("generate", "completions", "chat"):
            cases.append((name, endpoint, toploc_url,
                          lambda e=endpoint, v=value: _bad_request(toploc_url, e, v, material), reason))
    good = material["tokens"]["fingerprint"]
    good_chat = material["chat"]["fingerprint"]
    for endpoint in ("generate", "completions", "chat"):
        value = good_chat if endpoint == "chat" else good
        cases.append(("max_tokens_not_zero", endpoint, toploc_url,
                      lambda e=endpoint, v=value: _bad_request(toploc_url, e, v, material, max_tokens=4),
                      "prefill-only"))
        cases.append(("server_without_flag", endpoint, plain_url,
                      lambda e=endpoint, v=value: _bad_request(plain_url, e, v, material),
                      "without --toploc-verification"))
    # a fingerprint of 40 (45) response tokens against a prompt of fewer tokens than that
    short = material["tokens"]["input_ids"][:8]
    for endpoint in ("generate", "completions"):
        cases.append(("more_rows_than_prompt", endpoint, toploc_url,
                      lambda e=endpoint: _bad_request(toploc_url, e, good, material, prompt_ids=short), "covers"))
    return cases


@pytest.fixture(scope="module")
def outcomes(toploc_server, plain_server, material) -> list[dict]:
    cases = _cases(material, toploc_server.url, plain_server.url)

    def run(case):
        name, endpoint, url, send, reason = case
        bad, honest = _with_honest_neighbour(url, url == toploc_server.url, send)
        return {"name": name, "endpoint": endpoint, "reason": reason, "status": bad.status_code,
                "body": bad.text, "honest": honest}

    return pmap(run, cases, workers=len(cases))  # all at once: the honest neighbours share decode batches


def test_every_bad_input_gets_400_with_its_reason(outcomes) -> None:
    wrong = [(o["name"], o["endpoint"], o["status"], o["body"][:300]) for o in outcomes
             if o["status"] != 400 or o["reason"] not in o["body"]]
    record("hostile_400", cases=len(outcomes), ok=len(outcomes) - len(wrong),
           names=sorted({o["name"] for o in outcomes}))
    assert len(outcomes) >= 26
    assert not wrong, wrong


def test_bad_inputs_produce_no_verification_result(outcomes) -> None:
    for o in outcomes:
        # (an error message may name the fields; no response may carry them as keys)
        assert f'"{RESULT_FIELD}":' not in o["body"] and f'"{FP_FIELD}":' not in o["body"], (
            o["name"], o["endpoint"], o["body"][:300])


def test_concurrent_honest_requests_succeed(outcomes) -> None:
    assert {o["honest"]["fingerprinted"] for o in outcomes} == {True, False}
    for o in outcomes:
        assert o["honest"]["tokens"] == 16, o


def test_chat_fingerprint_longer_than_the_prompt_gets_400(toploc_server, material) -> None:
    """The chat form with a fingerprint covering more response tokens than the whole prompt has
    (70 rows; the conversation with the short reply "Hi." is ~40 tokens) must be refused with a
    400 like the exact-token form is, not answered 200 with verified=false."""
    fp = material["tokens"]["fingerprint"]
    n_rows = decode(fp).n_rows
    resp = _bad_request(toploc_server.url, "chat", fp, material, reply="Hi.")
    prompt_tokens = resp.json().get("usage", {}).get("prompt_tokens") if resp.status_code == 200 else None
    assert prompt_tokens is None or prompt_tokens < n_rows  # the case really is "more rows than prompt"
    assert resp.status_code == 400, (
        f"HTTP {resp.status_code} for a {n_rows}-row fingerprint and a {prompt_tokens}-token prompt: {resp.text[:400]}")
    assert "covers" in resp.text or "fingerprint" in resp.text


def test_streaming_bad_input_reports_the_reason(toploc_server, material) -> None:
    """Streaming requests carry the refusal (HTTP 400, or sglang's in-stream error event) and no
    result."""
    url = toploc_server.url
    ids = material["tokens"]["input_ids"] + material["tokens"]["output_ids"]
    checks = []
    for path, body in (
        ("/generate", {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 0},
                       "toploc_verification_fingerprint_to_validate": "AAAA"}),
        ("/v1/completions", {"model": "default", "prompt": ids, "stream": True, "max_tokens": 0,
                             "toploc_verification_fingerprint_to_validate": "AAAA"}),
        ("/v1/chat/completions", {"model": "default", "stream": True, "max_tokens": 0,
                                  "messages": material["chat"]["messages"]
                                  + [{"role": "assistant", "content": material["chat"]["text"]}],
                                  "toploc_verification_fingerprint_to_validate": "AAAA"}),
    ):
        resp = post(url, path, body, stream=True)
        if resp.status_code == 400:
            text = resp.text
        else:
            assert resp.status_code == 200
            events = sse_events(resp)
            assert any("error" in e for e in events), events
            text = str(events)
        checks.append((path, resp.status_code))
        assert "fingerprint" in text and RESULT_FIELD not in text, (path, text[:300])
    record("hostile_streaming", statuses=checks)


def test_servers_survive_and_still_verify(outcomes, toploc_server, plain_server, material) -> None:
    assert toploc_server.alive() and plain_server.alive()
    for server in (toploc_server, plain_server):
        assert requests.get(server.url + "/health_generate", timeout=300).status_code == 200
    reports = pmap(lambda s: verify_sample(toploc_server.url, s, "tokens"),
                   [material["tokens"], material["chat"]])
    assert all(r["verified"] for r in reports), reports
    resp = post(plain_server.url, "/generate", {"text": "Still alive?",
                                                "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 4
    assert toploc_server.alive() and plain_server.alive()
