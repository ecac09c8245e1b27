"""Returned hidden-state rows equal a float32 transformers forward, for every scope, mode and wire
format, with the radix cache on and off and with chunked prefill (64-token chunks).

Every check compares the *positions* the server names with the positions the request must get
(written out independently in hidden_states_fixtures.expected_positions) and each row with
`model.model(input_ids + output_ids).last_hidden_state` at that position.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

from hidden_states_fixtures import (
    TIMEOUT,
    LONG_PROMPT,
    SHORT_PROMPT,
    check_response,
    generate,
    hs_fields,
    report,
    rows_of,
)

# (format, mode, scope, last_n, final): both formats x both modes x every scope; final row on for
# half of them such that every (scope, mode) and every (format, scope) has it on and off.
MATRIX = [
    (fmt, mode, scope, 7 if scope == "last_n" else None, (fmt == "base64") != (mode == "last"))
    for fmt, mode, scope in itertools.product(("list", "base64"), (True, "last"), ("all", "response", "last_n"))
]
# defaults: no format (list), no scope (all); last_n larger than what exists; last_n=1
EXTRA = [
    (None, True, "response", None, False),
    (None, True, None, None, True),
    ("base64", True, "last_n", 10_000, True),
    ("list", True, "last_n", 1, False),
]


MEDIUM_PROMPT = "A list of rivers: the red river, the blue river, the green river and the quiet river. " \
                "Each one flows past an old mill, and the"


def _run_matrix(url: str, random_hf, prompt: str, max_new_tokens: int, cases: list, label: str) -> None:
    def one(case):
        fmt, mode, scope, last_n, final = case
        out = generate(url, prompt, max_new_tokens, ignore_eos=True, fields=hs_fields(mode, fmt, scope, last_n, final))
        assert len(out["meta_info"]["output_ids"]) == max_new_tokens
        return case, out

    with ThreadPoolExecutor(len(cases)) as pool:  # all in flight: they share prefill and decode batches
        results = list(pool.map(one, cases))
    diffs = {}
    for (fmt, mode, scope, last_n, final), out in results:
        what = f"{label} format={fmt} mode={mode} scope={scope} last_n={last_n} final={final}"
        diffs[what] = check_response(random_hf, out["meta_info"], mode=mode, fmt=fmt, scope=scope, last_n=last_n,
                                     final=final, what=what)
    report(f"{label}: {len(diffs)} requests, max |diff| per request", **{k: f"{v:.1e}" for k, v in diffs.items()})


def test_every_scope_mode_and_format_radix_cache_and_chunked_prefill(hs_server, random_hf) -> None:
    """Radix cache on, 64-token chunks, a ~240-token prompt (4 chunks). A plain request first puts
    the prompt in the cache, so scope all / last_n must recompute what they need from it."""
    warm = generate(hs_server.url, LONG_PROMPT, 6)
    assert len(warm["meta_info"]["input_ids"]) > 3 * 64, len(warm["meta_info"]["input_ids"])
    _run_matrix(hs_server.url, random_hf, LONG_PROMPT, 6, MATRIX + EXTRA, "radix+chunked")


def test_every_scope_mode_and_format_without_radix_cache(hs_noradix_server, random_hf) -> None:
    """Every prompt row is computed afresh here (no cache, one chunk): a prompt of ~40 tokens."""
    _run_matrix(hs_noradix_server.url, random_hf, MEDIUM_PROMPT, 6, MATRIX + EXTRA, "no-radix")


def test_repeated_prompt_still_has_every_prompt_row(hs_server, random_hf) -> None:
    """The same prompt again and again on the radix-cache server: the cache is really hit by plain
    requests, and every hidden-state request still gets all the rows its scope names."""
    url = hs_server.url
    prompt = "Radix cache check: the quick brown fox jumps over the lazy dog while the cat sleeps on the mat."
    generate(url, prompt, 4)
    again = generate(url, prompt, 4)
    prompt_len = len(again["meta_info"]["input_ids"])
    assert again["meta_info"]["cached_tokens"] >= prompt_len - 1, again["meta_info"]["cached_tokens"]

    sequence = [
        ("base64", True, "all", None, False),
        ("list", True, "all", None, True),
        ("base64", True, "all", None, False),   # the request before it cached everything again
        ("base64", True, "last_n", 3, False),
        ("list", True, "last_n", prompt_len + 2, False),  # reaches into the prompt
        ("base64", "last", "all", None, False),
        ("list", True, "response", None, True),
    ]
    cached = []
    for fmt, mode, scope, last_n, final in sequence:
        out = generate(url, prompt, 4, ignore_eos=True, fields=hs_fields(mode, fmt, scope, last_n, final))
        meta = out["meta_info"]
        cached.append(meta["cached_tokens"])
        check_response(random_hf, meta, mode=mode, fmt=fmt, scope=scope, last_n=last_n, final=final,
                       what=f"repeat {fmt} {mode} {scope} {last_n} {final}")
        if scope == "all" and mode is True:
            rows, pos = rows_of(meta, fmt)
            assert pos[: prompt_len] == list(range(prompt_len)), pos

    # an extension of the cached prompt: prefix in the cache, rows of all of it still wanted
    out = generate(url, prompt + " Then the dog wakes up.", 4, ignore_eos=True, fields=hs_fields(True, "base64", "all"))
    check_response(random_hf, out["meta_info"], mode=True, fmt="base64", scope="all", what="extended prompt")
    report("radix repeats", prompt_len=prompt_len, plain_cached_tokens=again["meta_info"]["cached_tokens"],
           hs_cached_tokens=cached)


def test_chunked_prefill_with_a_cached_prefix(hs_server, random_hf) -> None:
    """A cached prefix followed by an uncached part that itself spans several 64-token chunks."""
    url = hs_server.url
    generate(url, LONG_PROMPT, 4)
    # last_n=150: the cache may serve only the first L-150 tokens; 150 rows over 3 chunks
    out = generate(url, LONG_PROMPT, 4, ignore_eos=True, fields=hs_fields(True, "base64", "last_n", 150, True))
    check_response(random_hf, out["meta_info"], mode=True, fmt="base64", scope="last_n", last_n=150, final=True,
                   what="chunked last_n=150")
    # a new suffix of ~90 tokens after the cached ~240: the suffix is prefilled in 2 chunks
    suffix = " " + " ".join(f"Note {i}: every chunk boundary must keep its rows in order." for i in range(7))
    for fmt, scope, last_n in (("list", "all", None), ("base64", "last_n", 120), ("base64", "response", None)):
        out = generate(url, LONG_PROMPT + suffix, 3, ignore_eos=True, fields=hs_fields(True, fmt, scope, last_n))
        meta = out["meta_info"]
        assert len(meta["input_ids"]) > 300, len(meta["input_ids"])
        check_response(random_hf, meta, mode=True, fmt=fmt, scope=scope, last_n=last_n, what=f"chunked suffix {scope}")


def test_single_output_token(hs_server, hs_noradix_server, random_hf) -> None:
    """max_new_tokens=1: the only rows come from the prefill (and the final-row step)."""
    cases = (("base64", True, "response", False), ("list", True, "response", False), ("base64", "last", "all", False),
             ("list", True, "all", True), ("base64", "last", "response", True), ("list", "last", "response", False))
    jobs = [(server, case) for server in (hs_server, hs_noradix_server) for case in cases]

    def one(job):
        server, (fmt, mode, scope, final) = job
        return generate(server.url, SHORT_PROMPT, 1, fields=hs_fields(mode, fmt, scope, None, final))

    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(one, jobs))
    for (server, (fmt, mode, scope, final)), out in zip(jobs, outs):
        meta = out["meta_info"]
        assert len(meta["output_ids"]) == 1
        check_response(random_hf, meta, mode=mode, fmt=fmt, scope=scope, final=final,
                       what=f"{server.key}: 1 token {fmt} {mode} {scope} final={final}")


N_ROWS = 32


def test_list_and_base64_are_identical_and_payload_sizes(hs_noradix_server, random_hf) -> None:
    """The same N_ROWS-token generation in both formats: bit-identical rows; sizes printed."""
    url = hs_noradix_server.url
    outs, bodies = {}, {}
    for fmt in ("list", "base64"):
        body = {"text": SHORT_PROMPT, "sampling_params": {"max_new_tokens": N_ROWS, "temperature": 0, "ignore_eos": True},
                "return_input_ids": True, "return_output_ids": True,
                **hs_fields(True, fmt, "response", None, True)}
        resp = requests.post(url + "/generate", json=body, timeout=TIMEOUT)
        assert resp.status_code == 200, resp.text[:1000]
        outs[fmt], bodies[fmt] = resp.json(), resp.content
    assert outs["list"]["meta_info"]["output_ids"] == outs["base64"]["meta_info"]["output_ids"]
    rows_l, pos_l = rows_of(outs["list"]["meta_info"], "list")
    rows_b, pos_b = rows_of(outs["base64"]["meta_info"], "base64")
    assert pos_l == pos_b and len(pos_l) == N_ROWS, (len(pos_l), len(pos_b))
    assert torch.equal(rows_l, rows_b), (rows_l - rows_b).abs().max()
    check_response(random_hf, outs["base64"]["meta_info"], mode=True, fmt="base64", scope="response", final=True,
                   what=f"{N_ROWS}-token base64")
    field_l = len(json.dumps(outs["list"]["meta_info"]["hidden_states_rows"]))
    field_b = len(json.dumps(outs["base64"]["meta_info"]["hidden_states_rows"]))
    report(f"payload sizes for {N_ROWS} rows x {random_hf.hidden} float32 (scope response + final row)",
           list_field_bytes=field_l, base64_field_bytes=field_b,
           list_http_body_bytes=len(bodies["list"]), base64_http_body_bytes=len(bodies["base64"]),
           raw_bytes=N_ROWS * random_hf.hidden * 4, list_over_base64=round(field_l / field_b, 2))
    assert field_b < field_l


def test_prefill_only_request(hs_server, random_hf) -> None:
    """max_new_tokens=0 (a prefill-only request, e.g. rows of an existing prompt+response): answers
    in time, and every row is right. The prefill fed every token, so the row of the last position
    L-1 exists too and counts as the final row: positions 0..L-1, with or without
    return_final_hidden_state."""
    url = hs_server.url
    prompt = "Prefill only: one two three four five six seven eight nine ten."
    generate(url, prompt, 2)  # cached
    problems = []
    for fmt, mode, scope, last_n, final in (("base64", True, "all", None, False),
                                            ("list", True, "last_n", 3, False),
                                            ("base64", "last", "all", None, True)):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_input_ids": True,
                "return_output_ids": True, **hs_fields(mode, fmt, scope, last_n, final)}
        what = f"max_new_tokens=0 {fmt} {mode} {scope} last_n={last_n} final={final}"
        try:
            resp = requests.post(url + "/generate", json=body, timeout=60)
        except requests.Timeout:
            problems.append(f"{what}: no answer within 60 s")
            continue
        if resp.status_code != 200:
            problems.append(f"{what}: HTTP {resp.status_code} {resp.text[:300]}")
            continue
        meta = resp.json()["meta_info"]
        if "hidden_states_error" in meta:
            problems.append(f"{what}: {meta['hidden_states_error']}")
            continue
        try:
            check_response(random_hf, meta, mode=mode, fmt=fmt, scope=scope, last_n=last_n, final=True, what=what)
        except AssertionError as exc:
            problems.append(str(exc))
    assert not problems, "\n".join(problems)
