"""return_final_hidden_state: the last generated token's row (which plain decoding never computes)
equals the HF forward over prompt + full response at its last position, whether generation stopped
on a matched token or by max_tokens, and asking for it changes nothing else in the response.

The servers serve the suite's random-weight model, which never greedily reaches its EOS; a matched
stop token takes EOS's place: sglang ends a request on the model's EOS and on a `stop_token_ids`
entry in one check (`Req.check_finished`: both set `matched_eos`, finish type "stop" with the
matched id). The stop token is one the model's own greedy continuation reaches after its first
token, so the response has several tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from hidden_states_fixtures import (
    TIMEOUT,
    SHORT_PROMPT,
    check_response,
    finish_type,
    generate,
    hs_fields,
    report,
    rows_of,
    stop_token,
)

pytestmark = pytest.mark.uses_servers("hs_server", "hs_noradix_server")  # through request.getfixturevalue

QUESTION = "What is 2+2? Answer with a number only."

# (format, mode, scope): every scope, both modes, both formats
FINAL_CASES = [
    ("base64", True, "response"),
    ("list", True, "all"),
    ("base64", "last", "all"),
    ("list", True, "last_n"),
    ("base64", "last", "response"),
]

SAME_KEYS = ("output_ids", "completion_tokens", "prompt_tokens", "finish_reason")


def _servers(request, which: str):
    return request.getfixturevalue("hs_server" if which == "radix" else "hs_noradix_server")


@pytest.mark.parametrize("which", ["radix", "noradix"])
@pytest.mark.parametrize("stop", ["matched_token", "max_tokens"])
def test_final_row_matches_hf_and_changes_nothing_else(request, random_hf, which: str, stop: str) -> None:
    url = _servers(request, which).url
    prompt, max_new, sampling = SHORT_PROMPT, 12, {}
    if stop == "matched_token":
        matched = stop_token(url, prompt, max_new)
        sampling = {"stop_token_ids": [matched]}
    # every variant in flight at once: they share the server's batches (one decode step serves all)
    variants = [(fmt, mode, scope, 4 if scope == "last_n" else None, final)
                for fmt, mode, scope in FINAL_CASES for final in (True, False)]
    with ThreadPoolExecutor(len(variants) + 1) as pool:
        plain_job = pool.submit(generate, url, prompt, max_new, **sampling)
        outs = list(pool.map(lambda v: generate(url, prompt, max_new, fields=hs_fields(v[1], v[0], v[2], v[3], v[4]),
                                                **sampling), variants))
        plain = plain_job.result()
    pmeta = plain["meta_info"]
    if stop == "matched_token":
        assert finish_type(pmeta["finish_reason"]) == "stop" and pmeta["finish_reason"].get("matched") == matched, \
            pmeta["finish_reason"]
        assert pmeta["output_ids"][-1] == matched and len(pmeta["output_ids"]) < max_new
    else:
        assert finish_type(pmeta["finish_reason"]) == "length" and len(pmeta["output_ids"]) == max_new, \
            pmeta["finish_reason"]

    diffs = {}
    for (fmt, mode, scope, last_n, final), out in zip(variants, outs):
        meta = out["meta_info"]
        what = f"{which} {stop} {fmt} {mode} {scope} final={final}"
        assert out["text"] == plain["text"], f"{what}: text {out['text']!r} != {plain['text']!r}"
        for key in SAME_KEYS:
            assert meta[key] == pmeta[key], f"{what}: {key} {meta[key]!r} != {pmeta[key]!r}"
        diffs[what] = check_response(random_hf, meta, mode=mode, fmt=fmt, scope=scope, last_n=last_n, final=final,
                                     what=what)
        rows, pos = rows_of(meta, fmt)
        total = len(meta["input_ids"]) + len(meta["output_ids"])
        assert pos[-1] == (total - 1 if final else total - 2), (what, pos[-1], total)
    report(f"final row {which} {stop}", n_output=len(pmeta["output_ids"]),
           **{k: f"{v:.1e}" for k, v in diffs.items()})


def test_final_row_through_openai_changes_nothing_else(hs_server, random_hf) -> None:
    url = hs_server.url
    messages = [{"role": "user", "content": QUESTION}]
    prompt = random_hf.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = {"return_input_ids": True, "return_output_ids": True}
    base = {"model": "default", "messages": messages, "max_tokens": 24, "temperature": 0,
            "stop_token_ids": [stop_token(url, prompt, 24)], **ids}
    bodies = (base, {**base, **hs_fields("last", "base64", "response", None, True)})
    with ThreadPoolExecutor(2) as pool:
        plain, with_final = pool.map(
            lambda body: requests.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json(), bodies)
    p, f = plain["choices"][0], with_final["choices"][0]
    assert f["message"]["content"] == p["message"]["content"]
    assert f["finish_reason"] == p["finish_reason"] == "stop"
    assert f["message"]["output_ids"] == p["message"]["output_ids"]
    assert with_final["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    check_response(random_hf, f["message"], mode="last", fmt="base64", scope="response", final=True, what="chat final")


@pytest.mark.parametrize("kind", ["stop_str", "stop_token"])
def test_final_row_with_stop_strings_and_stop_tokens(hs_server, random_hf, kind: str) -> None:
    """Stopped by a string (the text of a token SHORT_PROMPT's greedy continuation reaches) or by
    that token."""
    url = hs_server.url
    token = stop_token(url, SHORT_PROMPT, 16)
    stop = {"stop": [random_hf.tokenizer.decode([token])]} if kind == "stop_str" else {"stop_token_ids": [token]}
    with ThreadPoolExecutor(2) as pool:
        plain, out = pool.map(lambda fields: generate(url, SHORT_PROMPT, 16, fields=fields, **stop),
                              (None, hs_fields(True, "base64", "all", None, True)))
    assert finish_type(plain["meta_info"]["finish_reason"]) == "stop", plain["meta_info"]["finish_reason"]
    assert out["text"] == plain["text"]
    for key in SAME_KEYS:
        assert out["meta_info"][key] == plain["meta_info"][key], key
    check_response(random_hf, out["meta_info"], mode=True, fmt="base64", scope="all", final=True, what=f"stop {stop}")
