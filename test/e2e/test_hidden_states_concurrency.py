"""Concurrent mixed requests (10-12 at once): each hidden-state request gets exactly its own rows.

The requests differ in prompt (short, chat-templated, ~240 tokens spanning 4 prefill chunks, one
that shares the long prompt's cached prefix), output length, scope, mode, format and final row, so
they land in shared prefill / decode batches and finish at different steps. Interleaved are plain
requests (must carry no rows), an OpenAI chat request with rows and, on the TOPLOC server, TOPLOC
verification requests (prefill-only, FULL capture) that must still verify.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from hidden_states_fixtures import (
    TIMEOUT,
    LONG_PROMPT,
    SHORT_PROMPT,
    check_response,
    generate,
    hs_fields,
    report,
    stop_token,
)

RESULT_FIELD = "toploc_verification_fingerprint_validation_result"

pytestmark = pytest.mark.uses_servers("hs_server", "hs_noradix_server")  # through request.getfixturevalue


def _jobs(chat_prompt: str, chat_stop: int, verify: list[dict]) -> list[dict]:
    medium = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    shared = LONG_PROMPT + " Also list three rivers you know:"
    # every scope, mode, format and final-row setting; prompts of 1 and 4 chunks, a cached prefix, a
    # matched stop token (in EOS's place: the random-weight model never reaches its EOS)
    hs = [
        (SHORT_PROMPT, 9, "base64", True, "all", None, True),
        (LONG_PROMPT, 5, "list", True, "all", None, False),
        (medium, 8, "base64", True, "response", None, False),
        (chat_prompt, 16, "base64", True, "response", None, True),   # stops on chat_stop
        (shared, 6, "list", "last", "all", None, True),
        (medium, 3, "list", True, "last_n", 2, False),
        (SHORT_PROMPT, 6, "base64", True, "last_n", 30, True),     # last_n beyond the sequence
    ]
    jobs = [{"kind": "hs", "prompt": p, "max": n, "fmt": f, "mode": m, "scope": s, "last_n": k, "final": fin,
             "stop": chat_stop if p == chat_prompt else None}
            for p, n, f, m, s, k, fin in hs]
    plain = [(SHORT_PROMPT, 7), (medium, 5)]
    jobs += [{"kind": "plain", "prompt": p, "max": n} for p, n in plain]
    jobs.append({"kind": "chat", "max": 6, "fmt": "list", "mode": "last", "scope": "all", "last_n": None,
                 "final": True})
    jobs += [{"kind": "verify", **v} for v in verify]
    return jobs


def _run(url: str, job: dict) -> dict:
    kind = job["kind"]
    if kind == "hs":
        stop = {} if job["stop"] is None else {"stop_token_ids": [job["stop"]]}
        return generate(url, job["prompt"], job["max"],
                        fields=hs_fields(job["mode"], job["fmt"], job["scope"], job["last_n"], job["final"]), **stop)
    if kind == "plain":
        return generate(url, job["prompt"], job["max"])
    if kind == "chat":
        body = {"model": "default", "messages": [{"role": "user", "content": "Name a fruit."}],
                "max_tokens": job["max"], "temperature": 0, "return_input_ids": True, "return_output_ids": True,
                **hs_fields(job["mode"], job["fmt"], job["scope"], job["last_n"], job["final"])}
        resp = requests.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert resp.status_code == 200, resp.text[:1000]
        return resp.json()
    body = {"input_ids": job["ids"], "sampling_params": {"max_new_tokens": 0},
            "toploc_verification_fingerprint_to_validate": job["fp"]}
    resp = requests.post(url + "/generate", json=body, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text[:1000]
    return resp.json()


@pytest.mark.parametrize("which", ["radix_chunked_toploc", "noradix"])
def test_concurrent_mixed_requests(request, random_hf, which: str) -> None:
    server = request.getfixturevalue("hs_server" if which != "noradix" else "hs_noradix_server")
    url = server.url
    chat_prompt = random_hf.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2? Answer with a number only."}], tokenize=False,
        add_generation_prompt=True)
    verify = []
    if which != "noradix":
        # honest fingerprints to verify concurrently with everything else
        with ThreadPoolExecutor(2) as pool:
            metas = [out["meta_info"] for out in pool.map(
                lambda p: generate(url, p, 8), ("The history of the printing press begins", "1, 1, 2, 3, 5, 8,"))]
        verify = [{"ids": meta["input_ids"] + meta["output_ids"], "fp": meta["toploc_verification_fingerprints"][-1]}
                  for meta in metas]
    jobs = _jobs(chat_prompt, stop_token(url, chat_prompt, 16), verify)
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: _run(url, job), jobs))

    def length(out: dict) -> int:
        fields = out["choices"][0]["message"] if "choices" in out else out["meta_info"]
        return len(fields.get("input_ids") or ()) + len(fields.get("output_ids") or ())

    # longest first: a shorter greedy sequence is a prefix of a longer one, whose HF rows it reuses
    order = sorted(range(len(jobs)), key=lambda i: -length(outs[i]))
    kinds: dict[str, int] = {}
    for i in order:
        job, out = jobs[i], outs[i]
        kinds[job["kind"]] = kinds.get(job["kind"], 0) + 1
        what = f"{which} job {i} {job['kind']} " + " ".join(
            f"{k}={job[k]}" for k in ("max", "fmt", "mode", "scope", "last_n", "final") if k in job)
        if job["kind"] == "hs":
            if job["stop"] is not None:
                assert out["meta_info"]["finish_reason"].get("matched") == job["stop"], (what, out["meta_info"])
            check_response(random_hf, out["meta_info"], mode=job["mode"], fmt=job["fmt"], scope=job["scope"],
                           last_n=job["last_n"], final=job["final"], what=what)
        elif job["kind"] == "chat":
            check_response(random_hf, out["choices"][0]["message"], mode=job["mode"], fmt=job["fmt"],
                           scope=job["scope"], last_n=job["last_n"], final=job["final"], what=what)
        elif job["kind"] == "plain":
            meta = out["meta_info"]
            assert not {"hidden_states", "hidden_states_rows", "hidden_states_positions"} & set(meta), what
            assert len(meta["output_ids"]) >= 1, what
        else:
            report_ = json.loads(out["meta_info"][RESULT_FIELD])
            assert report_["verified"] is True, f"{what}: {report_}"
    report(f"concurrent {which}", **kinds)
