"""Client-side helpers of the TOPLOC end-to-end tests: generate, verify, parse, record metrics.

Everything here talks HTTP to a real server (the `Server` fixtures of test/conftest.py); nothing
is mocked. A *sample* is one generated choice with what a verifier needs:

    {"endpoint", "stream", "input_ids", "output_ids", "fingerprint", "text", "finish_reason",
     "messages" (chat only), "temperature"}
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import requests
from openai import OpenAI

from sglang_rl.fingerprint import Fingerprint, decode_fingerprint

TIMEOUT = 900
FP_FIELD = "toploc_verification_fingerprints"
RESULT_FIELD = "toploc_verification_fingerprint_validation_result"
RL_FIELDS = (FP_FIELD, RESULT_FIELD, "input_ids", "output_ids")
METRICS_PATH = Path(os.environ.get("SGLANG_RL_TEST_LOGS", "/tmp/sglang-rl-test-logs")) / "e2e-metrics.jsonl"


# --------------------------------------------------------------------------------------------
# plumbing


def post(url: str, path: str, body: dict, stream: bool = False) -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT, stream=stream)


def sse_events(resp: requests.Response) -> list[dict]:
    """All JSON `data:` events of a server-sent-events response (without [DONE])."""
    events = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[len(b"data: "):]))
    return events


def openai_client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def pmap(fn: Callable, items: Iterable, workers: int = 8) -> list:
    """Run fn over items with `workers` concurrent requests (so they share server batches)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def chunks_for(n: int, chunk: int = 32) -> int:
    return math.ceil(n / chunk)


def last_fp(fields: dict) -> str:
    fps = fields.get(FP_FIELD)
    assert isinstance(fps, list) and fps and all(isinstance(s, str) for s in fps), f"no fingerprints in {fields}"
    return fps[-1]


def decode(fp: str) -> Fingerprint:
    return decode_fingerprint(fp)


def record(name: str, **values: Any) -> None:
    """Print a measured value and append it to METRICS_PATH (read by the report)."""
    line = {"metric": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **values}
    print(f"\n[METRIC] {json.dumps(line)}", flush=True)
    METRICS_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(METRICS_PATH, "a") as f:
        f.write(json.dumps(line) + "\n")


# --------------------------------------------------------------------------------------------
# generation (each returns a list of samples, one per choice)


def _sample(endpoint: str, stream: bool, fields: dict, text: str, finish: Any, **extra: Any) -> dict:
    return {
        "endpoint": endpoint,
        "stream": stream,
        "input_ids": list(fields["input_ids"]),
        "output_ids": list(fields["output_ids"]),
        "fingerprint": last_fp(fields),
        "all_fingerprints": list(fields[FP_FIELD]),
        "text": text,
        "finish_reason": finish,
        **extra,
    }


def _finish_type(finish: Any) -> Optional[str]:
    if isinstance(finish, dict):
        return finish.get("type")
    return finish


def gen_generate(url: str, *, input_ids: Optional[list] = None, text: Optional[str] = None,
                 max_tokens: int, temperature: float = 0.0, stream: bool = False, n: int = 1,
                 ignore_eos: bool = False) -> list[dict]:
    """/generate with return_input_ids/return_output_ids as top-level fields."""
    body: dict = {
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature, "n": n,
                            "ignore_eos": ignore_eos},
        "return_input_ids": True,
        "return_output_ids": True,
        "stream": stream,
    }
    if input_ids is not None:
        body["input_ids"] = input_ids
    else:
        body["text"] = text
    resp = post(url, "/generate", body, stream=stream)
    assert resp.status_code == 200, resp.text
    if stream:
        finals: dict[int, dict] = {}
        for event in sse_events(resp):
            assert "error" not in event, event
            if event["meta_info"].get("finish_reason") is not None:
                finals[event.get("index", 0)] = event
        outs = [finals[i] for i in sorted(finals)]
    else:
        data = resp.json()
        outs = data if isinstance(data, list) else [data]
    assert len(outs) == n, outs
    samples = []
    for out in outs:
        meta = out["meta_info"]
        samples.append(_sample("generate", stream, meta, out["text"], _finish_type(meta["finish_reason"]),
                               temperature=temperature))
    return samples


def gen_completions(url: str, prompt: Any, *, max_tokens: int, temperature: float = 0.0,
                    stream: bool = False, n: int = 1) -> list[dict]:
    """/v1/completions through the openai client, sglang-rl fields in extra_body."""
    client = openai_client(url)
    extra = {"return_input_ids": True, "return_output_ids": True}
    if not stream:
        resp = client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens,
                                         temperature=temperature, n=n, extra_body=extra)
        choices = sorted((c.model_dump() for c in resp.choices), key=lambda c: c["index"])
        assert len(choices) == n
        return [_sample("completions", False, c, c["text"], c["finish_reason"], temperature=temperature)
                for c in choices]
    texts: dict[int, str] = {}
    finals: dict[int, dict] = {}
    for chunk in client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens,
                                           temperature=temperature, n=n, stream=True, extra_body=extra):
        for c in chunk.choices:
            c = c.model_dump()
            texts[c["index"]] = texts.get(c["index"], "") + (c.get("text") or "")
            if c.get("finish_reason") is not None:
                finals[c["index"]] = c
    assert sorted(finals) == list(range(n)), finals
    return [_sample("completions", True, finals[i], texts[i], finals[i]["finish_reason"], temperature=temperature)
            for i in range(n)]


def gen_chat(url: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0,
             stream: bool = False, n: int = 1) -> list[dict]:
    """/v1/chat/completions: non-streaming through the openai client (extra_body), streaming as
    raw SSE (the fields arrive in the delta of the chunk that carries finish_reason)."""
    extra = {"return_input_ids": True, "return_output_ids": True}
    if not stream:
        client = openai_client(url)
        resp = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                              temperature=temperature, n=n, extra_body=extra)
        choices = sorted((c.model_dump() for c in resp.choices), key=lambda c: c["index"])
        assert len(choices) == n
        return [_sample("chat", False, c["message"], c["message"]["content"] or "", c["finish_reason"],
                        messages=messages, temperature=temperature) for c in choices]
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "n": n, "stream": True, **extra}
    resp = post(url, "/v1/chat/completions", body, stream=True)
    assert resp.status_code == 200, resp.text
    texts: dict[int, str] = {}
    finals: dict[int, dict] = {}
    for event in sse_events(resp):
        assert "error" not in event, event
        for c in event.get("choices", []):
            delta = c.get("delta") or {}
            texts[c["index"]] = texts.get(c["index"], "") + (delta.get("content") or "")
            if c.get("finish_reason") is not None:
                finals[c["index"]] = c
    assert sorted(finals) == list(range(n)), finals
    return [_sample("chat", True, finals[i]["delta"], texts[i], finals[i]["finish_reason"],
                    messages=messages, temperature=temperature) for i in range(n)]


# --------------------------------------------------------------------------------------------
# verification (each returns (http_status, report dict or error body))


def _parse_report(fields: dict) -> dict:
    raw = fields.get(RESULT_FIELD)
    assert isinstance(raw, str), f"no {RESULT_FIELD} string in {fields}"
    return json.loads(raw)


def verify_tokens(url: str, ids: list[int], fp: Any, *, via: str = "generate",
                  expect_greedy: Optional[bool] = None, max_tokens: int = 0,
                  expect_sampled: Optional[bool] = None) -> tuple[int, Any]:
    """Exact-token form: input_ids + output_ids as /generate input_ids or a /v1/completions
    token prompt."""
    flags = {name: value for name, value in (("toploc_verification_expect_greedy", expect_greedy),
                                             ("toploc_verification_expect_sampled", expect_sampled))
             if value is not None}
    flags["toploc_verification_return_token_logprobs"] = True  # the tests read response_token_logprobs
    if via == "generate":
        body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens},
                      "toploc_verification_fingerprint_to_validate": fp, **flags}
        resp = post(url, "/generate", body)
        if resp.status_code != 200:
            return resp.status_code, resp.text
        return 200, _parse_report(resp.json()["meta_info"])
    body = {"model": "default", "prompt": ids, "max_tokens": max_tokens,
            "toploc_verification_fingerprint_to_validate": fp, **flags}
    resp = post(url, "/v1/completions", body)
    if resp.status_code != 200:
        return resp.status_code, resp.text
    return 200, _parse_report(resp.json()["choices"][0])


def verify_chat(url: str, messages: list[dict], reply: str, fp: Any, *,
                expect_greedy: Optional[bool] = None, max_tokens: int = 0,
                use_openai_client: bool = False) -> tuple[int, Any]:
    """Chat form: the conversation plus {"role": "assistant", "content": reply}."""
    msgs = list(messages) + [{"role": "assistant", "content": reply}]
    extra: dict = {"toploc_verification_fingerprint_to_validate": fp}
    if expect_greedy is not None:
        extra["toploc_verification_expect_greedy"] = expect_greedy
    if use_openai_client:
        resp = openai_client(url).chat.completions.create(model="default", messages=msgs,
                                                          max_tokens=max_tokens, extra_body=extra)
        return 200, _parse_report(resp.choices[0].message.model_dump())
    resp = post(url, "/v1/chat/completions", {"model": "default", "messages": msgs, "max_tokens": max_tokens,
                                               **extra})
    if resp.status_code != 200:
        return resp.status_code, resp.text
    return 200, _parse_report(resp.json()["choices"][0]["message"])


def verify_sample(url: str, sample: dict, form: str, *, via: str = "generate",
                  expect_greedy: Optional[bool] = None) -> dict:
    """Verify one sample in the given form ('tokens' or 'chat'); asserts HTTP 200."""
    if form == "chat":
        status, report = verify_chat(url, sample["messages"], sample["text"], sample["fingerprint"],
                                     expect_greedy=expect_greedy)
        if status == 400 and "re-tokenizes" in json.dumps(report):
            # the chat form cannot align a reply whose text re-tokenizes to another length
            return {"refused": json.dumps(report), "verified": None}
    else:
        status, report = verify_tokens(url, sample["input_ids"] + sample["output_ids"], sample["fingerprint"],
                                       via=via, expect_greedy=expect_greedy)
    assert status == 200, f"verification HTTP {status}: {report}"
    return report


def stats(report: dict) -> dict:
    """The headline numbers of a report (for printing)."""
    return {k: report.get(k) for k in ("verified", "fingerprint_verified", "exp_mismatches", "mant_err_mean",
                                       "mant_err_median", "greedy_consistent", "error")}


def summarize(reports: list[dict]) -> dict:
    """Detection statistics over reports of tampered inputs."""
    n = len(reports)
    fp_detected = sum(not r.get("fingerprint_verified", r.get("verified")) for r in reports)
    detected = sum(not r["verified"] for r in reports)
    exp = sorted(r.get("exp_mismatches") for r in reports if r.get("exp_mismatches") is not None)
    mean = sorted(r.get("mant_err_mean") for r in reports if r.get("mant_err_mean") is not None)
    return {
        "n": n,
        "detected": detected,
        "detection_rate": detected / n if n else None,
        "fingerprint_detected": fp_detected,
        "fingerprint_detection_rate": fp_detected / n if n else None,
        "exp_mismatches_min_median_max": [exp[0], exp[len(exp) // 2], exp[-1]] if exp else None,
        "mant_err_mean_min_median_max": [mean[0], mean[len(mean) // 2], mean[-1]] if mean else None,
    }


def assert_fingerprints_verify(verifier: str, metas: list[dict]) -> list[dict]:
    """Each response's fingerprint verifies in its exact-token form on `verifier`, covering exactly
    its returned tokens, and fails against the next response's ids. Returns the reports."""
    def own(meta: dict) -> tuple[int, dict]:
        return verify_tokens(verifier, meta["input_ids"] + meta["output_ids"], last_fp(meta))

    def other(pair: tuple[dict, dict]) -> tuple[int, dict]:
        meta, wrong = pair
        return verify_tokens(verifier, wrong["input_ids"] + wrong["output_ids"], last_fp(meta))

    reports = []
    for meta, (status, result) in zip(metas, pmap(own, metas)):
        assert status == 200, result
        assert result.get("verified") is True, (meta["output_ids"], result)
        assert result["response_tokens"] == len(meta["output_ids"]), result
        reports.append(result)
    pairs = list(zip(metas, metas[1:] + metas[:1]))
    for (meta, wrong), (status, result) in zip(pairs, pmap(other, pairs)):
        if meta["output_ids"] != wrong["output_ids"] or meta["input_ids"] != wrong["input_ids"]:
            assert status != 200 or result.get("verified") is False, result
    return reports
