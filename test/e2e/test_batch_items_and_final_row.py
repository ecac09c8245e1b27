"""Two ways honest work was rejected, on the server that has TOPLOC and hidden states together.

1. `return_final_hidden_state` runs one extra decode step so the last token gets its row; the
   fingerprint must still cover exactly the returned `output_ids`, not the hidden extra token.
2. A batch request carries per-item fields (a list of `sampling_params`, or a list at the top
   level): each item must get its own fingerprint to verify, its own row options, its own id
   options, its own k-CBS setting. Before the fix every item got the last item's fields.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_servers import Server
from hidden_states_fixtures import check_response, generate, hs_fields, post

PROMPTS = [
    ("A short note on bees, number 3:", 6),
    ("Tell me about cats.", 3),
    ("One, two, three, four,", 9),
    ("The capital of France", 4),
]


def _verdicts(resp) -> list[dict]:
    assert resp.status_code == 200, resp.text[:2000]
    return [json.loads(item["meta_info"]["toploc_verification_fingerprint_validation_result"])
            for item in resp.json()]


@pytest.fixture(scope="module")
def samples(hs_server: Server) -> list[dict]:
    """Honest greedy generations of PROMPTS (ids + fingerprint), lengths all different."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: generate(hs_server.url, p[0], p[1], ignore_eos=True), PROMPTS))
    got = []
    for out in outs:
        meta = out["meta_info"]
        got.append({"ids": meta["input_ids"] + meta["output_ids"], "n_out": len(meta["output_ids"]),
                    "fp": meta["toploc_verification_fingerprints"][-1]})
    assert len({s["n_out"] for s in got}) == len(got)
    return got


@pytest.mark.parametrize("fmt", ["base64", "list"])
def test_final_row_does_not_enter_the_fingerprint(hs_server: Server, random_hf, fmt: str) -> None:
    out = generate(hs_server.url, PROMPTS[0][0], PROMPTS[0][1],
                   fields=hs_fields(True, fmt, "all", None, True))
    meta = out["meta_info"]
    check_response(random_hf, meta, mode=True, fmt=fmt, scope="all", final=True, what="final row + TOPLOC")
    resp = post(hs_server.url, "/generate", {
        "input_ids": meta["input_ids"] + meta["output_ids"], "sampling_params": {"max_new_tokens": 0},
        "toploc_verification_fingerprint_to_validate": meta["toploc_verification_fingerprints"][-1]})
    assert resp.status_code == 200, resp.text
    report = json.loads(resp.json()["meta_info"]["toploc_verification_fingerprint_validation_result"])
    assert report["response_tokens"] == len(meta["output_ids"]), report
    assert report["verified"] and report["worst_exp_mismatches"] == 0, report


def test_batch_verification_in_sampling_params_list(hs_server: Server, samples: list[dict]) -> None:
    resp = post(hs_server.url, "/generate", {
        "input_ids": [s["ids"] for s in samples],
        "sampling_params": [{"max_new_tokens": 0, "toploc_verification_fingerprint_to_validate": s["fp"]}
                            for s in samples]})
    reports = _verdicts(resp)
    assert [r["verified"] for r in reports] == [True] * len(samples), reports
    assert [r["response_tokens"] for r in reports] == [s["n_out"] for s in samples]


def test_batch_verification_top_level_list(hs_server: Server, samples: list[dict]) -> None:
    resp = post(hs_server.url, "/generate", {
        "input_ids": [s["ids"] for s in samples], "sampling_params": {"max_new_tokens": 0},
        "toploc_verification_fingerprint_to_validate": [s["fp"] for s in samples]})
    assert [r["verified"] for r in _verdicts(resp)] == [True] * len(samples)


def test_batch_verification_swapped_fingerprints_fail(hs_server: Server, samples: list[dict]) -> None:
    """Each item is judged against its own fingerprint: rotate them and none may pass."""
    fps = [s["fp"] for s in samples]
    rotated = fps[1:] + fps[:1]
    items = [(s["ids"], fp) for s, fp in zip(samples, rotated)]
    resp = post(hs_server.url, "/generate", {
        "input_ids": [ids for ids, _ in items],
        "sampling_params": [{"max_new_tokens": 0, "toploc_verification_fingerprint_to_validate": fp}
                            for _, fp in items]})
    if resp.status_code == 400:
        # a fingerprint longer than its item's prefill is refused for the whole batch, with a reason
        assert "fingerprint covers" in resp.text, resp.text
        return
    assert not any(r["verified"] for r in _verdicts(resp))


def test_batch_mixed_items_each_get_their_own_fields(hs_server: Server, random_hf, samples: list[dict]) -> None:
    """One batch: a verification, a base64 rows request with the final row, a plain request that
    asks for nothing, an expect-greedy verification and a k-CBS request."""
    items = [
        ({"input_ids": samples[0]["ids"]},
         {"max_new_tokens": 0, "toploc_verification_fingerprint_to_validate": samples[0]["fp"]}),
        ({"text": PROMPTS[1][0]},
         {"max_new_tokens": 6, "temperature": 0, "return_output_ids": True, "return_input_ids": True,
          "hidden_states_format": "base64", "hidden_states_scope": "response",
          "return_final_hidden_state": True}),
        ({"text": PROMPTS[2][0]}, {"max_new_tokens": 7, "temperature": 0}),
        ({"input_ids": samples[3]["ids"]},
         {"max_new_tokens": 0, "toploc_verification_fingerprint_to_validate": samples[3]["fp"],
          "toploc_verification_expect_greedy": True}),
        ({"text": PROMPTS[0][0]},
         {"max_new_tokens": 3, "kcbs_enabled": True, "kcbs_beam_width": 3}),
    ]
    # /generate batches are of one input kind: send everything as token ids
    tok = random_hf.tokenizer
    ids = [it[0].get("input_ids") or tok(it[0]["text"])["input_ids"] for it in items]
    resp = post(hs_server.url, "/generate", {
        "input_ids": ids, "sampling_params": [p for _, p in items],
        "return_hidden_states": [False, True, False, False, False]})
    assert resp.status_code == 200, resp.text[:2000]
    out = resp.json()
    verify, rows, plain, greedy, kcbs = (o["meta_info"] for o in out)
    report = json.loads(verify["toploc_verification_fingerprint_validation_result"])
    assert report["verified"] and report["response_tokens"] == samples[0]["n_out"], report
    greedy_report = json.loads(greedy["toploc_verification_fingerprint_validation_result"])
    assert greedy_report["verified"] and greedy_report["greedy_consistent"] is True, greedy_report
    check_response(random_hf, rows, mode=True, fmt="base64", scope="response", final=True, what="batch item 1")
    assert len(rows["output_ids"]) == 6
    for meta in (verify, plain, greedy, kcbs):
        assert not {"hidden_states", "hidden_states_rows", "output_ids"} & set(meta), sorted(meta)
    assert "toploc_verification_fingerprint_validation_result" not in plain
    assert "kcbs_candidates" not in plain and "kcbs_candidates" not in rows
    assert len(kcbs["kcbs_candidates"]) == 3, kcbs
    assert all(len(c["token_ids"]) <= 3 for c in kcbs["kcbs_candidates"])
    assert "input_logprobs" not in verify and "prompt_token_ids" not in out[2]


@pytest.mark.parametrize("body, reason", [
    ({"sampling_params": [{"max_new_tokens": 2}]}, "sampling_params is a list of 1 entries"),
    ({"sampling_params": {"max_new_tokens": 2}, "return_output_ids": [True]}, "return_output_ids is a list of 1"),
    ({"sampling_params": [{"max_new_tokens": 2, "return_output_ids": False}] * 2, "return_output_ids": True},
     "given both at the top level"),
    ({"sampling_params": {"max_new_tokens": 2}, "return_output_ids": [True, "yes"]}, "must be true or false"),
    ({"sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2, "kcbs_enabled": True, "kcbs_beam_width": 2}],
      "return_hidden_states": True, "hidden_states_format": "base64"}, "k-CBS returns candidates, not hidden-state rows"),
])
def test_batch_field_refusals(hs_server: Server, body: dict, reason: str) -> None:
    resp = post(hs_server.url, "/generate", {"text": ["Hello", "Hi there"], **body})
    assert resp.status_code == 400, resp.text
    assert reason in resp.text, resp.text
    assert generate(hs_server.url, "Still serving?", 2)["meta_info"]["output_ids"]
