"""Hidden states through every HTTP entry point: OpenAI chat and completions (plain, n=2,
streamed), streamed /generate and batched /generate; and no rows where none were asked for."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from hidden_states_fixtures import (
    HANG_TIMEOUT,
    TIMEOUT,
    SHORT_PROMPT,
    check_response,
    generate,
    hs_fields,
    report,
)

CHAT = [{"role": "user", "content": "Name three colours."}]


def _post(url: str, path: str, body: dict, stream: bool = False) -> requests.Response:
    resp = requests.post(url + path, json=body, timeout=TIMEOUT, stream=stream)
    assert resp.status_code == 200, resp.text[:2000]
    return resp


def _events(resp: requests.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: {")]


def _ids() -> dict:
    return {"return_input_ids": True, "return_output_ids": True}


def test_openai_chat_and_completions(hs_server, random_hf) -> None:
    url = hs_server.url
    cases = [
        ("chat", "list", True, "response", None, True),
        ("chat", "base64", True, "all", None, False),
        ("chat", "base64", "last", "response", None, True),
        ("completions", "base64", True, "last_n", 5, False),
        ("completions", "list", "last", "all", None, False),
        ("completions", "list", True, "all", None, True),
    ]

    def send(case):
        endpoint, fmt, mode, scope, last_n, final = case
        fields = {**hs_fields(mode, fmt, scope, last_n, final), **_ids()}
        if endpoint == "chat":
            body = {"model": "default", "messages": CHAT, "max_tokens": 12, "temperature": 0, **fields}
            return _post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
        body = {"model": "default", "prompt": SHORT_PROMPT, "max_tokens": 10, "temperature": 0, **fields}
        return _post(url, "/v1/completions", body).json()["choices"][0]

    with ThreadPoolExecutor(len(cases)) as pool:
        targets = list(pool.map(send, cases))
    diffs = {}
    for (endpoint, fmt, mode, scope, last_n, final), target in zip(cases, targets):
        what = f"{endpoint} {fmt} {mode} {scope} {last_n} final={final}"
        diffs[what] = check_response(random_hf, target, mode=mode, fmt=fmt, scope=scope, last_n=last_n, final=final,
                                     what=what)
    report("openai", **{k: f"{v:.1e}" for k, v in diffs.items()})


def test_openai_n2_sampling_each_choice_gets_its_own_rows(hs_server, random_hf) -> None:
    url = hs_server.url
    fields = {**hs_fields(True, "base64", "all"), **_ids()}
    completions = {"model": "default", "prompt": SHORT_PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 2, **fields}
    chat = {"model": "default", "messages": CHAT, "max_tokens": 8, "temperature": 1.0, "n": 2,
            **{**fields, **hs_fields("last", "list", "response")}}
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(_post, url, "/v1/completions", completions),
                pool.submit(_post, url, "/v1/chat/completions", chat)]
        choices = done[0].result().json()["choices"]
        messages = [c["message"] for c in done[1].result().json()["choices"]]
    assert len(choices) == 2 and len(messages) == 2
    for i, target in enumerate(choices):
        check_response(random_hf, target, mode=True, fmt="base64", scope="all", what=f"completions n=2 choice {i}")
    for i, target in enumerate(messages):
        check_response(random_hf, target, mode="last", fmt="list", scope="response", what=f"chat n=2 choice {i}")
    report("n=2 outputs", completions=[c["output_ids"] for c in choices], chat=[m["output_ids"] for m in messages])


def test_parallel_sampling_with_the_final_row(hs_server, random_hf) -> None:
    """n=2 with return_final_hidden_state (sglang first sends a prefill-only request to cache the
    shared prompt; it carries the same fields)."""
    body = {"text": SHORT_PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "n": 2}, **_ids(),
            **hs_fields(True, "base64", "response", None, True)}
    try:
        resp = requests.post(hs_server.url + "/generate", json=body, timeout=HANG_TIMEOUT)
    except requests.Timeout:
        pytest.fail(f"/generate n=2 with return_final_hidden_state: no answer within {HANG_TIMEOUT} s")
    assert resp.status_code == 200, resp.text[:1000]
    outs = resp.json()
    assert len(outs) == 2
    for i, out in enumerate(outs):
        check_response(random_hf, out["meta_info"], mode=True, fmt="base64", scope="response", final=True,
                       what=f"n=2 final item {i}")


def test_streamed_generate_chat_and_completions(hs_server, random_hf) -> None:
    url = hs_server.url
    generate_body = {"text": SHORT_PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                     **_ids(), **hs_fields(True, "list", "all", None, True)}
    chat_body = {"model": "default", "messages": CHAT, "max_tokens": 12, "temperature": 0, "stream": True,
                 **_ids(), **hs_fields(True, "base64", "response", None, True)}
    completions_body = {"model": "default", "prompt": SHORT_PROMPT, "max_tokens": 8, "temperature": 0, "stream": True,
                        **_ids(), **hs_fields("last", "base64", "all")}
    streams = (("/generate", generate_body), ("/v1/chat/completions", chat_body), ("/v1/completions", completions_body))
    with ThreadPoolExecutor(len(streams)) as pool:  # the three streams at once, read to their ends
        events, chat_events, completions_events = pool.map(lambda s: _events(_post(url, *s, stream=True)), streams)

    assert events and events[-1]["meta_info"]["finish_reason"] is not None
    assert not any("hidden_states_rows" in e["meta_info"] for e in events[:-1]), "rows before the last event"
    check_response(random_hf, events[-1]["meta_info"], mode=True, fmt="list", scope="all", final=True,
                   what="streamed /generate")

    finals = [c for e in chat_events for c in e["choices"] if c.get("finish_reason")]
    assert len(finals) == 1, finals
    check_response(random_hf, finals[0]["delta"], mode=True, fmt="base64", scope="response", final=True,
                   what="streamed chat")

    finals = [c for e in completions_events for c in e["choices"] if c.get("finish_reason")]
    assert len(finals) == 1, finals
    check_response(random_hf, finals[0], mode="last", fmt="base64", scope="all", what="streamed completions")


def test_batched_generate(hs_server, random_hf) -> None:
    """/generate with a list of prompts: each output carries its own rows."""
    texts = [SHORT_PROMPT, "One two three", "A short poem about the sea:"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, **_ids(),
            **hs_fields(True, "base64", "response", None, True)}
    outs = _post(hs_server.url, "/generate", body).json()
    assert len(outs) == len(texts)
    for i, out in enumerate(outs):
        check_response(random_hf, out["meta_info"], mode=True, fmt="base64", scope="response", final=True,
                       what=f"batch item {i}")


def test_no_rows_unless_asked(hs_server) -> None:
    """Plain requests and requests whose return_hidden_states is false carry no rows (and the
    upstream field alone still takes upstream's path)."""
    url = hs_server.url
    for fields in ({}, {"return_hidden_states": False, "hidden_states_format": "base64",
                        "hidden_states_scope": "last_n", "hidden_states_last_n": 3}):
        meta = generate(url, SHORT_PROMPT, 4, fields=fields)["meta_info"]
        assert not {"hidden_states", "hidden_states_rows", "hidden_states_positions"} & set(meta), sorted(meta)
    upstream = generate(url, SHORT_PROMPT, 4, fields={"return_hidden_states": True})["meta_info"]
    assert isinstance(upstream.get("hidden_states"), list), sorted(upstream)
    assert not {"hidden_states_rows", "hidden_states_positions"} & set(upstream), sorted(upstream)
    body = {"model": "default", "messages": CHAT, "max_tokens": 4, **_ids()}
    message = _post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert not {"hidden_states", "hidden_states_rows"} & set(message), sorted(message)
