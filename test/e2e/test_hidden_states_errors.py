"""Bad hidden-state requests get HTTP 400 with the reason, on every endpoint, and the server keeps
serving; a server started without --enable-return-hidden-states refuses hidden states."""

from __future__ import annotations

import pytest
import requests

from hidden_states_fixtures import (
    TIMEOUT,
    SHORT_PROMPT,
    check_response,
    generate,
    hs_fields,
    report,
)

# (fields, words the error message must contain)
BAD = [
    ({"return_hidden_states": True, "hidden_states_format": "xml"}, ["hidden_states_format", "xml"]),
    ({"return_hidden_states": True, "hidden_states_format": "BASE64"}, ["hidden_states_format"]),
    ({"return_hidden_states": True, "hidden_states_format": 3}, ["hidden_states_format"]),
    ({"return_hidden_states": True, "hidden_states_scope": "prompt"}, ["hidden_states_scope", "prompt"]),
    ({"return_hidden_states": True, "hidden_states_scope": "last_n", "hidden_states_last_n": -2},
     ["hidden_states_last_n", "positive"]),
    ({"return_hidden_states": True, "hidden_states_scope": "last_n", "hidden_states_last_n": 0},
     ["hidden_states_last_n", "positive"]),
    ({"return_hidden_states": True, "hidden_states_scope": "last_n", "hidden_states_last_n": 2.5},
     ["hidden_states_last_n", "integer"]),
    ({"return_hidden_states": True, "hidden_states_scope": "last_n", "hidden_states_last_n": "3"},
     ["hidden_states_last_n", "integer"]),
    ({"return_hidden_states": True, "hidden_states_scope": "last_n", "hidden_states_last_n": True},
     ["hidden_states_last_n", "integer"]),
    ({"return_hidden_states": True, "hidden_states_last_n": 3}, ["hidden_states_last_n", "last_n"]),
    ({"return_hidden_states": True, "hidden_states_scope": "all", "hidden_states_last_n": 3},
     ["hidden_states_last_n", "last_n"]),
    ({"return_hidden_states": True, "hidden_states_scope": "last_n"}, ["requires hidden_states_last_n"]),
    ({"return_hidden_states": True, "hidden_states_format": "tensor"}, ["tensor", "Engine"]),
    ({"return_hidden_states": "last", "hidden_states_format": "tensor", "hidden_states_scope": "response"},
     ["tensor"]),
    ({"return_hidden_states": "first", "hidden_states_format": "base64"}, ["return_hidden_states"]),
    ({"return_hidden_states": True, "return_final_hidden_state": "yes"}, ["return_final_hidden_state"]),
    # validated even while hidden states are off: a typo must not wait for the day they are on
    ({"hidden_states_format": "xml"}, ["hidden_states_format"]),
]


def _send(url: str, endpoint: str, fields: dict) -> requests.Response:
    if endpoint == "generate":
        body = {"text": SHORT_PROMPT, "sampling_params": {"max_new_tokens": 4}, **fields}
        return requests.post(url + "/generate", json=body, timeout=TIMEOUT)
    if endpoint == "chat":
        body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
        return requests.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    body = {"model": "default", "prompt": SHORT_PROMPT, "max_tokens": 4, **fields}
    return requests.post(url + "/v1/completions", json=body, timeout=TIMEOUT)


def _message(resp: requests.Response) -> str:
    body = resp.json()
    if isinstance(body.get("error"), dict):
        return body["error"].get("message", "")
    return body.get("message", "") or str(body)


@pytest.mark.parametrize("endpoint", ["generate", "chat", "completions"])
def test_bad_fields_are_400_with_the_reason(hs_server, random_hf, endpoint: str) -> None:
    url = hs_server.url
    problems = []
    for fields, words in BAD:
        resp = _send(url, endpoint, fields)
        if resp.status_code != 400:
            problems.append(f"{fields}: HTTP {resp.status_code} {resp.text[:300]}")
            continue
        message = _message(resp)
        missing = [w for w in words if w not in message]
        if missing:
            problems.append(f"{fields}: message {message!r} lacks {missing}")
    assert not problems, "\n".join(problems)
    # still serving, hidden states included
    out = generate(url, SHORT_PROMPT, 5, fields=hs_fields(True, "base64", "all", None, True))
    check_response(random_hf, out["meta_info"], mode=True, fmt="base64", scope="all", final=True, what="after 400s")


def test_server_without_the_flag_refuses(refusal_server) -> None:
    """The plugin, no --enable-return-hidden-states."""
    url = refusal_server.url
    refusals = {}
    for endpoint in ("generate", "chat", "completions"):
        for fields in (hs_fields(True, "base64"), hs_fields("last", "list", "response"),
                       hs_fields(True, None, "last_n", 2), hs_fields(True, None, None, None, True)):
            resp = _send(url, endpoint, fields)
            assert resp.status_code == 400, (endpoint, fields, resp.status_code, resp.text[:300])
            message = _message(resp)
            assert "--enable-return-hidden-states" in message, message
            refusals[endpoint] = message
    # upstream's own field alone is refused by sglang itself
    resp = _send(url, "generate", {"return_hidden_states": True})
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    refusals["upstream return_hidden_states"] = _message(resp)
    # and it keeps serving
    out = generate(url, SHORT_PROMPT, 4)
    assert out["meta_info"]["output_ids"]
    report("refusals", **refusals)
