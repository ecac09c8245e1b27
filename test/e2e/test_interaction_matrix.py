"""Every pair of request features, generated from one table, on the server that has them all
(TOPLOC on, hidden states on, radix cache on, 64-token chunked prefill), with streams whose
client hangs up after the first chunk in the same batches.

A feature is a row of FEATURES: the request fields it adds, and the check of its own contract on
each returned choice. A pair is sent as one /v1/chat/completions request (/v1/completions for the
"completions" feature), and all pairs are in
flight at once, so they share batches. A pair that UNSUPPORTED lists must get a 400 that names
the reason; every other pair must get a 200 in which every choice passes the checks of both
features. TOPLOC is on for every request: each fingerprint must verify against its own ids and
fail against another request's. A new feature adds one row here, not N tests.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, NamedTuple

import pytest

from e2e_servers import Server
from hidden_states_fixtures import check_response, post
from toploc_helpers import FP_FIELD, sse_events, verify_tokens

MAX_TOKENS = 6


class Feature(NamedTuple):
    fields: dict
    check: Callable[[Any, dict], None]


def _rows(mode: Any, fmt: str, scope: str, final: bool, last_n: Any = None) -> Feature:
    def check(random_hf, choice: dict) -> None:
        check_response(random_hf, choice, mode=mode, fmt=fmt, scope=scope, last_n=last_n, final=final,
                       what=f"rows {mode} {fmt} {scope}")

    fields = {"return_hidden_states": mode, "hidden_states_format": fmt, "hidden_states_scope": scope,
              "return_final_hidden_state": final}
    if last_n is not None:
        fields["hidden_states_last_n"] = last_n
    return Feature(fields, check)


def _kcbs_check(random_hf, choice: dict) -> None:
    candidates = choice["kcbs_candidates"]
    assert 1 <= len(candidates) <= 2
    logprobs = [c["logprob"] for c in candidates]
    assert logprobs == sorted(logprobs, reverse=True)
    assert choice["output_ids"] == candidates[0]["token_ids"]


def _no_check(random_hf, choice: dict) -> None:
    assert choice["output_ids"], choice


FEATURES: dict[str, Feature] = {
    "rows-base64-all-final": _rows(True, "base64", "all", True),
    "rows-list-response": _rows(True, "list", "response", False),
    "rows-last": _rows("last", "list", "all", False),
    "rows-base64-last_n-final": _rows(True, "base64", "last_n", True, last_n=5),
    "kcbs": Feature({"kcbs_enabled": True, "kcbs_beam_width": 2, "kcbs_steps": 3}, _kcbs_check),
    "stream": Feature({"stream": True}, _no_check),
    "n2": Feature({"n": 2, "temperature": 0.8}, _no_check),
    "completions": Feature({}, _no_check),  # /v1/completions instead of chat (see _send)
    # a streamed request whose client goes away after the first chunk: it is aborted in the
    # same batches as every other pair, which must still get their own, complete answers
    "disconnect": Feature({"stream": True}, _no_check),
}
# pairs that must be refused, with a piece of the reason
UNSUPPORTED = {
    frozenset({"kcbs", "stream"}): "streaming",
    frozenset({"kcbs", "n2"}): "n > 1",
    frozenset({"kcbs", "disconnect"}): "streaming",
    **{frozenset({"kcbs", r}): "not hidden-state rows" for r in FEATURES if r.startswith("rows")},
}
# the row variants are alternatives of one feature (one request has one row format), not a pair
PAIRS = [(a, b) for a, b in itertools.combinations(FEATURES, 2)
         if not (a.startswith("rows") and b.startswith("rows"))] + [(f,) for f in FEATURES]
PROMPT = [{"role": "user", "content": "Name three colors of the rainbow."}]
DISCONNECTED = 499  # the client closed the stream (nginx's code for it)


def _send(url: str, names: tuple) -> tuple[int, Any]:
    body: dict = {"model": "default", "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "return_input_ids": True, "return_output_ids": True}
    for name in names:
        body.update(FEATURES[name].fields)
    chat = "completions" not in names
    if not chat:
        body["prompt"] = body.pop("messages")[0]["content"]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = post(url, path, body, stream=bool(body.get("stream")))
    if resp.status_code != 200:
        return resp.status_code, resp.text
    if "disconnect" in names:
        next(line for line in resp.iter_lines() if line)  # the first chunk, then hang up
        resp.close()
        return DISCONNECTED, None
    if not body.get("stream"):
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        return 200, [c["message"] if chat else c for c in choices]
    finals: dict[int, dict] = {}
    for event in sse_events(resp):
        assert "error" not in event, event
        for c in event.get("choices", []):
            if c.get("finish_reason") is not None:
                finals[c["index"]] = (c.get("delta") or {}) if chat else c
    return 200, [finals[i] for i in sorted(finals)]


@pytest.fixture(scope="module")
def answers(hs_server: Server) -> dict:
    return send_all(hs_server.url)


def _assert_idle(url: str) -> None:
    """After the aborted streams: nothing left running or waiting, and no KV token held."""
    import time

    import requests

    deadline = time.time() + 60
    while True:
        load = requests.get(f"{url}/v1/loads", params={"include": "core"}, timeout=30).json()["loads"][0]
        busy = load["num_running_reqs"] or load["num_waiting_reqs"] or load["num_used_tokens"]
        if not busy or time.time() > deadline:
            break
        time.sleep(0.5)
    assert not busy, load


@pytest.fixture(scope="module")
def verify(answers: dict, hs_server: Server) -> Callable:
    """`verify_tokens` for check_pair, its answers sent beforehand all at once (every fingerprint of
    `answers` against its own ids and against `other_ids`); anything else is sent when asked."""
    from concurrent.futures import ThreadPoolExecutor

    asks = [(ids, choice[FP_FIELD][-1]) for status, result in answers.values() if status == 200
            for choice in result if choice.get(FP_FIELD)
            for ids in (list(choice["input_ids"]) + list(choice["output_ids"]), other_ids(choice))]
    with ThreadPoolExecutor(max(len(asks), 1)) as pool:
        known = dict(zip([_key(*ask) for ask in asks], pool.map(lambda ask: verify_tokens(hs_server.url, *ask), asks)))
    return lambda url, ids, fp: known.get(_key(ids, fp)) or verify_tokens(url, ids, fp)


def _key(ids: list, fp: Any) -> tuple:
    return tuple(ids), json.dumps(fp, sort_keys=True)


@pytest.mark.parametrize("names", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_pair(names: tuple, answers: dict, verify: Callable, hs_server: Server, random_hf) -> None:
    check_pair(names, *answers[names], hs_server.url, random_hf, verify=verify)


def send_all(url: str) -> dict:
    """Every pair sent at once to the server at `url`; (status, choices or text) per pair."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PAIRS)) as pool:
        result = dict(zip(PAIRS, pool.map(lambda p: _send(url, p), PAIRS)))
    _assert_idle(url)
    return result


def check_pair(names: tuple, status: int, result: Any, url: str, random_hf, refused: dict | None = None,
               verify: Callable = verify_tokens) -> None:
    """One pair's answer against the contracts of both its features, its fingerprint against its
    own ids and another request's (verified on the server at `url` by `verify`, verify_tokens'
    signature). `refused` adds the pairs a particular server refuses (pair -> a piece of the
    reason; either reason may come first)."""
    reasons = [r for r in (UNSUPPORTED.get(frozenset(names)), (refused or {}).get(frozenset(names))) if r]
    if reasons:
        assert status == 400 and any(r in result for r in reasons), (status, str(result)[:500])
        return
    if "disconnect" in names:
        assert status == DISCONNECTED, str(result)[:1000]
        return
    assert status == 200, str(result)[:1000]
    assert len(result) == (2 if "n2" in names else 1)
    for choice in result:
        for name in names:
            FEATURES[name].check(random_hf, choice)
        if "kcbs" in names:
            assert FP_FIELD not in choice  # candidates come from beams: no single fingerprint
            continue
        ids = list(choice["input_ids"]) + list(choice["output_ids"])
        fp = choice[FP_FIELD][-1]
        code, report = verify(url, ids, fp)
        assert code == 200 and report["verified"], report
        code, report = verify(url, other_ids(choice), fp)
        assert code == 400 or not report["verified"], report


def other_ids(choice: dict) -> list:
    """Another request's ids: another token at every fingerprinted row's position, from the last
    prompt token on (the output tokens alone would not do for a one-token reply: its only row is the
    prompt's). The servers' random-weight model has rows that depend on their own token far more
    than on the context, so a changed context alone would pass its bounds."""
    ids = list(choice["input_ids"]) + list(choice["output_ids"])
    n_prompt = len(choice["input_ids"])
    return ids[:n_prompt - 1] + [(t + 1) % 49152 for t in ids[n_prompt - 1:]]
