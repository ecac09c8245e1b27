"""Grammar-constrained decoding (regex, JSON schema, json_object, EBNF) on the CPU servers.

sglang's default grammar backend, xgrammar, pins its token bitmask and masks logits with GPU
kernels; the CPU stand-in's own sglang plugin (scripts/cpu_shims/sgl_kernel/sglang_plugin.py)
makes both work on CPU. Before that, the first constrained request killed the scheduler. Each
constrained output must match its grammar; an invalid grammar gets a 400 and the server keeps
serving; a constrained request batched with an unconstrained one leaves the latter unchanged.
"""

from __future__ import annotations

import json
import re

import pytest
import requests

from toploc_helpers import pmap, post

REGEX = r"(yes|no),[0-9]{3}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _check_schema(value) -> None:
    try:
        import jsonschema
    except ImportError:  # not a dependency of the test environment: check by hand
        assert isinstance(value, dict) and set(value) == {"name", "age"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    else:
        jsonschema.validate(value, SCHEMA)


def _generate(url: str, params: dict, text: str = "Is the sky blue? Answer:") -> dict:
    resp = post(url, "/generate", {"text": text, "sampling_params": {"temperature": 0, **params}})
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()


def _chat(url: str, content: str, response_format: dict, max_tokens: int = 32) -> dict:
    resp = post(url, "/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "response_format": response_format})
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()["choices"][0]


@pytest.mark.parametrize("fixture", ["toploc_server", "plain_server"])
def test_regex_output_matches(request, fixture: str) -> None:
    out = _generate(request.getfixturevalue(fixture).url, {"max_new_tokens": 16, "regex": REGEX})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    assert re.fullmatch(REGEX, out["text"]), out["text"]


def test_generate_json_schema_and_ebnf(toploc_server) -> None:
    out = _generate(toploc_server.url, {"max_new_tokens": 40, "json_schema": json.dumps(SCHEMA)}, "Name:")
    _check_schema(json.loads(out["text"]))
    out = _generate(toploc_server.url, {"max_new_tokens": 8, "ebnf": 'root ::= "yes" | "no"'})
    assert out["text"] in ("yes", "no")


def test_chat_response_format_json_schema(toploc_server) -> None:
    choice = _chat(toploc_server.url, "Give a person's name and age as JSON.",
                   {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}, 40)
    assert choice["finish_reason"] == "stop"
    _check_schema(json.loads(choice["message"]["content"]))


def test_chat_response_format_json_object(toploc_server) -> None:
    choice = _chat(toploc_server.url, 'Output a JSON object with one key "ok" whose value is true.',
                   {"type": "json_object"})
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_unconstrained_neighbour_unchanged(plain_server) -> None:
    plain = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    alone = post(plain_server.url, "/generate", plain).json()["text"]
    constrained = {"text": "Is the sky blue? Answer:",
                   "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": REGEX}}
    outs = pmap(lambda body: post(plain_server.url, "/generate", body).json()["text"],
                [constrained, plain, constrained, plain])
    assert outs[1] == outs[3] == alone
    assert re.fullmatch(REGEX, outs[0]) and re.fullmatch(REGEX, outs[2])


def test_invalid_grammars_refused_and_server_keeps_serving(plain_server) -> None:
    url = plain_server.url
    for params in ({"regex": "(unclosed["}, {"json_schema": "{not json"},
                   {"json_schema": json.dumps({"type": "nonsense"})}, {"ebnf": "root ::= ("}):
        resp = post(url, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
        assert resp.status_code == 400 and "grammar" in resp.text, (params, resp.status_code, resp.text[:300])
    resp = post(url, "/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}})
    assert resp.status_code == 400, resp.text[:300]
    # sampled, with a grammar that leaves no allowed token ("yes" then end, but at least 6 tokens):
    # the torch sampler's multinomial raised on that row and killed the scheduler
    _generate(url, {"max_new_tokens": 8, "min_new_tokens": 6, "temperature": 1.0, "regex": "yes"})
    assert plain_server.alive()
    assert _generate(url, {"max_new_tokens": 4, "ignore_eos": True})["meta_info"]["completion_tokens"] == 4
    assert requests.get(url + "/health_generate", timeout=120).status_code == 200


@pytest.mark.parametrize("params", [
    {"regex": ["yes", "no"]}, {"json_schema": {"type": "object"}}, {"ebnf": 5},
    {"regex": "\x00a"}, {"json_schema": json.dumps({"type": "string", "pattern": "\x00a"})},
], ids=["regex-list", "schema-dict", "ebnf-int", "regex-nul", "schema-nul"])
def test_grammars_that_kill_sglang_are_refused(plain_server, params: dict) -> None:
    """A grammar that is not a string, or holds a NUL, kills sglang's scheduler on any device (an
    unhashable cache key; xgrammar crashes on NUL): the plugin answers 400 and keeps serving."""
    resp = post(plain_server.url, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    assert next(iter(params)) in resp.text, resp.text[:300]
    assert _generate(plain_server.url, {"max_new_tokens": 2, "ignore_eos": True})["meta_info"]["completion_tokens"] == 2


def test_regex_with_a_space(plain_server) -> None:
    """Tokens that start with a space are allowed (the default model's tokenizer decodes with
    ByteLevel, which xgrammar recognises)."""
    out = _generate(plain_server.url, {"max_new_tokens": 16, "regex": r"(yes|no), [0-9]{3}"})
    assert re.fullmatch(r"(yes|no), [0-9]{3}", out["text"]), out


def test_constrained_outputs_carry_fingerprints_that_verify(toploc_server) -> None:
    """Grammar and TOPLOC together: a constrained rollout is fingerprinted like any other, and its
    fingerprint verifies (the rows do not depend on which token the mask let through)."""
    from toploc_helpers import assert_fingerprints_verify

    metas = []
    for text, params in (("Is the sky blue? Answer:", {"regex": REGEX, "max_new_tokens": 16}),
                         ("Name:", {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 40})):
        resp = post(toploc_server.url, "/generate", {
            "text": text, "sampling_params": {"temperature": 0, **params},
            "return_input_ids": True, "return_output_ids": True})
        assert resp.status_code == 200, resp.text[:500]
        metas.append(resp.json()["meta_info"])
    assert_fingerprints_verify(toploc_server.url, metas)
