"""return_final_hidden_state: the last generated token's row (which plain decoding never computes)
equals the HF forward over prompt + full response at its last position, whether generation stopped
by EOS or by max_tokens, and asking for it changes nothing else in the response."""

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
)

pytestmark = pytest.mark.uses_servers("hs_server", "hs_noradix_server")  # through request.getfixturevalue

EOS_ID = 2  # <|im_end|>, generation_config.eos_token_id of SmolLM2-Instruct
EOS_QUESTION = "What is 2+2? Answer with a number only."  # greedy: "2 + 2 = 4" then <|im_end|>

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
@pytest.mark.parametrize("stop", ["eos", "max_tokens"])
def test_final_row_matches_hf_and_changes_nothing_else(request, hf, which: str, stop: str) -> None:
    url = _servers(request, which).url
    if stop == "eos":
        prompt = hf.tokenizer.apply_chat_template([{"role": "user", "content": EOS_QUESTION}], tokenize=False,
                                                  add_generation_prompt=True)
        max_new = 24
    else:
        prompt, max_new = SHORT_PROMPT, 12
    # every variant in flight at once: they share the server's batches (one decode step serves all)
    variants = [(fmt, mode, scope, 4 if scope == "last_n" else None, final)
                for fmt, mode, scope in FINAL_CASES for final in (True, False)]
    with ThreadPoolExecutor(len(variants) + 1) as pool:
        plain_job = pool.submit(generate, url, prompt, max_new)
        outs = list(pool.map(lambda v: generate(url, prompt, max_new, fields=hs_fields(v[1], v[0], v[2], v[3], v[4])),
                             variants))
        plain = plain_job.result()
    pmeta = plain["meta_info"]
    if stop == "eos":
        assert finish_type(pmeta["finish_reason"]) == "stop" and pmeta["finish_reason"].get("matched") == EOS_ID, \
            pmeta["finish_reason"]
        assert pmeta["output_ids"][-1] == EOS_ID and len(pmeta["output_ids"]) < max_new
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
        diffs[what] = check_response(hf, meta, mode=mode, fmt=fmt, scope=scope, last_n=last_n, final=final,
                                     what=what)
        rows, pos = rows_of(meta, fmt)
        total = len(meta["input_ids"]) + len(meta["output_ids"])
        assert pos[-1] == (total - 1 if final else total - 2), (what, pos[-1], total)
    report(f"final row {which} {stop}", n_output=len(pmeta["output_ids"]),
           **{k: f"{v:.1e}" for k, v in diffs.items()})


def test_final_row_through_openai_changes_nothing_else(hs_server, hf) -> None:
    url = hs_server.url
    messages = [{"role": "user", "content": EOS_QUESTION}]
    ids = {"return_input_ids": True, "return_output_ids": True}
    base = {"model": "default", "messages": messages, "max_tokens": 24, "temperature": 0, **ids}
    bodies = (base, {**base, **hs_fields("last", "base64", "response", None, True)})
    with ThreadPoolExecutor(2) as pool:
        plain, with_final = pool.map(
            lambda body: requests.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json(), bodies)
    p, f = plain["choices"][0], with_final["choices"][0]
    assert f["message"]["content"] == p["message"]["content"]
    assert f["finish_reason"] == p["finish_reason"] == "stop"
    assert f["message"]["output_ids"] == p["message"]["output_ids"]
    assert with_final["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    check_response(hf, f["message"], mode="last", fmt="base64", scope="response", final=True, what="chat final")


@pytest.mark.parametrize("stop", [{"stop": [" answer"]}, {"stop_token_ids": [504]}], ids=["stop_str", "stop_token"])
def test_final_row_with_stop_strings_and_stop_tokens(hs_server, hf, stop: dict) -> None:
    """SHORT_PROMPT greedily continues " Paris.\\n\\nThe answer is ..."; token 504 is "The"."""
    url = hs_server.url
    with ThreadPoolExecutor(2) as pool:
        plain, out = pool.map(lambda fields: generate(url, SHORT_PROMPT, 16, fields=fields, **stop),
                              (None, hs_fields(True, "base64", "all", None, True)))
    assert finish_type(plain["meta_info"]["finish_reason"]) == "stop", plain["meta_info"]["finish_reason"]
    assert out["text"] == plain["text"]
    for key in SAME_KEYS:
        assert out["meta_info"][key] == plain["meta_info"][key], key
    check_response(hf, out["meta_info"], mode=True, fmt="base64", scope="all", final=True, what=f"stop {stop}")
