"""k-CBS serving behaviour on a real CPU server: mixed batches, bad input, KV pool, aborts.

- mixed batches: k-CBS requests (two of them identical, so their beams share radix-cache
  prefixes), ordinary greedy requests, a chat completion and a streaming request, sent alone and
  then all at once: each gets the same result both ways;
- bad input: every invalid k-CBS request (k < 1, k > 32, T < 1, T > 1024, non-integer k/T, n > 1,
  stream=true, kcbs_* fields without kcbs_enabled), on /generate (top level and inside
  sampling_params), /v1/completions and /v1/chat/completions, gets HTTP 400 naming the reason,
  while honest requests sent concurrently succeed and the server stays healthy;
- KV pool: usage (see kcbs_helpers.pool: used = pool - free - evictable cache) returns to its
  starting value after a burst of k-CBS requests, after a client disconnects from a running
  k-CBS request (timeout, connection closed), and after POST /abort_request; and the server
  stops working on an abandoned search (no prefill token or decode row computed after it ends);
- radix cache off: candidates equal the transformers reference and the pool returns to its start.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from kcbs_helpers import (
    CHAT_PROMPTS,
    assert_candidates_match,
    flush_cache,
    generate,
    greedy_body,
    kcbs_body,
    oracle,
    pmap,
    pool,
    post,
    prompt_ids,
    reference,
    server_log_tail,
    shared_server,
    stream_generate,
    wait_idle,
    work_done,
)


@pytest.fixture(scope="module")
def server(plain_server):
    """The k-CBS server shared with test_kcbs_oracle.py (the suite's plain server)."""
    return shared_server()


@pytest.fixture(scope="module")
def tok(model_path):
    return oracle(model_path)["tokenizer"]


# ------------------------------------------------------------------------------------------
# mixed batches


def _mixed_jobs(tok) -> dict:
    return {
        "kcbs_chat": ("kcbs", kcbs_body(prompt_ids(tok, "say_hi"), 4, 6, False)),
        "kcbs_chat_twin": ("kcbs", kcbs_body(prompt_ids(tok, "say_hi"), 4, 6, False)),
        "kcbs_count": ("kcbs", kcbs_body(prompt_ids(tok, "count"), 2, 6, True)),
        "kcbs_wide": ("kcbs", kcbs_body(prompt_ids(tok, "fox"), 8, 3, True)),
        "kcbs_default_T": ("kcbs", kcbs_body(prompt_ids(tok, "two_plus_two"), 3, None, False, max_new_tokens=5)),
        "greedy_text": ("greedy", greedy_body(prompt_ids(tok, "capital"), 6)),
        "greedy_chat": ("greedy", greedy_body(prompt_ids(tok, "two_plus_two"), 8)),
        "stream": ("stream", greedy_body(prompt_ids(tok, "fox"), 6)),
        "chat_api": ("chat", {"model": "default", "messages": [{"role": "user", "content": CHAT_PROMPTS["animal"]}],
                              "max_tokens": 6, "temperature": 0}),
    }


def _run_job(url: str, job: tuple) -> dict:
    kind, body = job
    if kind == "stream":
        return stream_generate(url, body)
    if kind == "chat":
        resp = post(url, "/v1/chat/completions", body)
        assert resp.status_code == 200, resp.text
        return resp.json()
    return generate(url, body)


def _compare(name: str, kind: str, alone: dict, mixed: dict) -> None:
    if kind == "kcbs":
        assert_candidates_match(mixed["meta_info"]["kcbs_candidates"], alone["meta_info"]["kcbs_candidates"], name,
                                got_name="mixed", want_name="alone")
        assert mixed["output_ids"] == alone["output_ids"] and mixed["text"] == alone["text"], name
    elif kind == "chat":
        a, m = alone["choices"][0], mixed["choices"][0]
        assert m["message"]["content"] == a["message"]["content"] and m["finish_reason"] == a["finish_reason"], name
        assert "kcbs_candidates" not in m["message"], name
    else:
        assert mixed["output_ids"] == alone["output_ids"] and mixed["text"] == alone["text"], name
        assert mixed["meta_info"]["finish_reason"] == alone["meta_info"]["finish_reason"], name
        assert "kcbs_candidates" not in mixed["meta_info"], name


def test_mixed_batch_matches_alone(server, tok):
    """Each request alone (on an empty radix cache, one after the other), then all at once (on an
    empty cache again): the same results."""
    jobs = _mixed_jobs(tok)
    flush_cache(server.url)
    t0 = time.time()
    alone = {name: _run_job(server.url, job) for name, job in jobs.items()}
    flush_cache(server.url)
    t1 = time.time()
    mixed = dict(zip(jobs, pmap(lambda j: _run_job(server.url, j), jobs.values(), workers=len(jobs))))
    print(f"\n[kcbs-mixed] alone {t1 - t0:.1f}s, mixed {time.time() - t1:.1f}s", flush=True)
    assert mixed["stream"]["_events"] > 1  # it really streamed
    # the default T is max_new_tokens
    assert max(len(c["token_ids"]) for c in alone["kcbs_default_T"]["meta_info"]["kcbs_candidates"]) <= 5
    errors = []
    for name, (kind, _) in jobs.items():
        try:
            _compare(name, kind, alone[name], mixed[name])
        except AssertionError as exc:
            errors.append(str(exc).split("\nassert")[0])
    # the two identical searches, run side by side, agree with each other too
    try:
        assert_candidates_match(mixed["kcbs_chat_twin"]["meta_info"]["kcbs_candidates"],
                                mixed["kcbs_chat"]["meta_info"]["kcbs_candidates"], "twins",
                                got_name="twin", want_name="first")
    except AssertionError as exc:
        errors.append(str(exc).split("\nassert")[0])
    assert not errors, f"{len(errors)} of {len(jobs)} requests differ in the mixed batch:\n" + "\n".join(errors)


# ------------------------------------------------------------------------------------------
# bad input

_KCBS = {"kcbs_enabled": True}
_GEN = {"text": "Hello there", "sampling_params": {"max_new_tokens": 4}}
_COMP = {"model": "default", "prompt": "Hello there", "max_tokens": 4}
_CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


def _gen_sp(**fields) -> dict:
    return {"text": "Hello there", "sampling_params": {"max_new_tokens": 4, **fields}}


# name -> (path, body, substrings the error message must contain)
BAD = {
    "generate-k0": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 0}, ["kcbs_beam_width", "between 1 and 32"]),
    "generate-k-1": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": -1}, ["kcbs_beam_width", "between 1 and 32"]),
    "generate-k33": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 33}, ["kcbs_beam_width", "between 1 and 32"]),
    "generate-T0": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 2, "kcbs_steps": 0}, ["kcbs_steps", "between 1 and 1024"]),
    "generate-T1025": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 2, "kcbs_steps": 1025}, ["kcbs_steps", "between 1 and 1024"]),
    "generate-k2.5": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 2.5}, ["kcbs_beam_width", "integer"]),
    "generate-k-string": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": "2"}, ["kcbs_beam_width", "integer"]),
    "generate-k-bool": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": True}, ["kcbs_beam_width", "integer"]),
    "generate-T-string": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 2, "kcbs_steps": "4"}, ["kcbs_steps", "integer"]),
    "generate-T4.5": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 2, "kcbs_steps": 4.5}, ["kcbs_steps", "integer"]),
    "generate-no-k-no-top_k": ("/generate", {**_GEN, **_KCBS}, ["kcbs_beam_width"]),
    "generate-n2": ("/generate", {"text": "Hello there", "sampling_params": {"max_new_tokens": 4, "n": 2},
                                  **_KCBS, "kcbs_beam_width": 2}, ["n > 1"]),
    "generate-stream": ("/generate", {**_GEN, **_KCBS, "kcbs_beam_width": 2, "stream": True}, ["stream"]),
    "generate-k-without-enabled": ("/generate", {**_GEN, "kcbs_beam_width": 2}, ["kcbs_beam_width", "without kcbs_enabled"]),
    "generate-T-without-enabled": ("/generate", {**_GEN, "kcbs_steps": 2}, ["kcbs_steps", "without kcbs_enabled"]),
    "generate-prune-without-enabled": ("/generate", {**_GEN, "kcbs_final_prune": False}, ["kcbs_final_prune", "without kcbs_enabled"]),
    "generate-enabled-false-with-k": ("/generate", {**_GEN, "kcbs_enabled": False, "kcbs_beam_width": 2}, ["without kcbs_enabled"]),
    "sampling_params-k33": ("/generate", _gen_sp(kcbs_enabled=True, kcbs_beam_width=33), ["kcbs_beam_width", "between 1 and 32"]),
    "sampling_params-k1.5": ("/generate", _gen_sp(kcbs_enabled=True, kcbs_beam_width=1.5), ["kcbs_beam_width", "integer"]),
    "sampling_params-T0": ("/generate", _gen_sp(kcbs_enabled=True, kcbs_beam_width=2, kcbs_steps=0), ["kcbs_steps", "between 1 and 1024"]),
    "sampling_params-T-without-enabled": ("/generate", _gen_sp(kcbs_steps=3), ["kcbs_steps", "without kcbs_enabled"]),
    "completions-k0": ("/v1/completions", {**_COMP, **_KCBS, "kcbs_beam_width": 0}, ["kcbs_beam_width", "between 1 and 32"]),
    "completions-T2000": ("/v1/completions", {**_COMP, **_KCBS, "kcbs_beam_width": 2, "kcbs_steps": 2000}, ["kcbs_steps", "between 1 and 1024"]),
    "completions-k-string": ("/v1/completions", {**_COMP, **_KCBS, "kcbs_beam_width": "2"}, ["kcbs_beam_width", "integer"]),
    "completions-n2": ("/v1/completions", {**_COMP, **_KCBS, "kcbs_beam_width": 2, "n": 2}, ["n > 1"]),
    "completions-stream": ("/v1/completions", {**_COMP, **_KCBS, "kcbs_beam_width": 2, "stream": True}, ["stream"]),
    "completions-k-without-enabled": ("/v1/completions", {**_COMP, "kcbs_beam_width": 2}, ["without kcbs_enabled"]),
    "chat-k33": ("/v1/chat/completions", {**_CHAT, **_KCBS, "kcbs_beam_width": 33}, ["kcbs_beam_width", "between 1 and 32"]),
    "chat-T1.5": ("/v1/chat/completions", {**_CHAT, **_KCBS, "kcbs_beam_width": 2, "kcbs_steps": 1.5}, ["kcbs_steps", "integer"]),
    "chat-n2": ("/v1/chat/completions", {**_CHAT, **_KCBS, "kcbs_beam_width": 2, "n": 2}, ["n > 1"]),
    "chat-stream": ("/v1/chat/completions", {**_CHAT, **_KCBS, "kcbs_beam_width": 2, "stream": True}, ["stream"]),
    "chat-prune-without-enabled": ("/v1/chat/completions", {**_CHAT, "kcbs_final_prune": True}, ["without kcbs_enabled"]),
}


@pytest.fixture(scope="module")
def bad_results(server, tok):
    """Every bad request, fired concurrently with honest k-CBS and greedy requests."""
    # two k-CBS requests (not an ordinary one: k-CBS next to ordinary requests is the subject of
    # test_mixed_batch_matches_alone; here the bad requests are what shares the server)
    honest = {
        "honest_kcbs": ("kcbs", kcbs_body(prompt_ids(tok, "ice"), 4, 4, True)),
        "honest_kcbs_2": ("kcbs", kcbs_body(prompt_ids(tok, "sky"), 2, 6, False)),
    }
    flush_cache(server.url)
    alone = {name: _run_job(server.url, job) for name, job in honest.items()}
    flush_cache(server.url)

    def one(item):
        name, spec = item
        if name in honest:
            return _run_job(server.url, spec)
        path, body, _ = spec
        resp = post(server.url, path, body, timeout=300)
        return {"status": resp.status_code, "text": resp.text}

    items = list(honest.items()) + list(BAD.items())
    results = dict(zip([n for n, _ in items], pmap(one, items, workers=12)))
    return {"alone": alone, "results": results, "honest": honest}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_400_with_reason(server, bad_results, name):
    result = bad_results["results"][name]
    _, _, reasons = BAD[name]
    assert result["status"] == 400, f"{name}: HTTP {result['status']} {result['text'][:400]}"
    for reason in reasons:
        assert reason in result["text"], f"{name}: {reason!r} not in {result['text'][:400]}"


def test_honest_requests_survive_bad_input(server, bad_results):
    for name, (kind, _) in bad_results["honest"].items():
        _compare(name, kind, bad_results["alone"][name], bad_results["results"][name])
    assert server.alive()
    assert requests.get(server.url + "/health_generate", timeout=300).status_code == 200
    out = generate(server.url, greedy_body([504, 3575, 282, 4649, 314], 4))
    assert len(out["output_ids"]) == 4


# ------------------------------------------------------------------------------------------
# KV pool


def _baseline(url: str) -> int:
    reached, snap, trace = wait_idle(url, timeout=240)
    assert reached, f"server not idle before the test: {trace[-10:]}"
    return snap["num_used_tokens"]


def test_kv_usage_returns_after_kcbs_burst(server, tok):
    """A burst of wide/long k-CBS requests (k up to 32, final_prune off: up to 1024 candidates)
    next to greedy ones; while it runs the pool is in use, afterwards usage is back to start."""
    base = _baseline(server.url)
    bodies = [
        kcbs_body(prompt_ids(tok, "fox"), 32, 3, False),
        kcbs_body(prompt_ids(tok, "numpy"), 16, 4, True),
        kcbs_body(prompt_ids(tok, "five"), 8, 8, False),
        kcbs_body(prompt_ids(tok, "count"), 5, 10, True),
        greedy_body(prompt_ids(tok, "roses"), 12),
        greedy_body(prompt_ids(tok, "bread"), 12),
    ]
    seen: list[int] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(pool(server.url)["num_used_tokens"])
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outs = pmap(lambda b: generate(server.url, b), bodies)
    finally:
        done.set()
        watcher.join()
    assert len(outs[0]["meta_info"]["kcbs_candidates"]) > 32  # final_prune off kept more than k
    assert max(seen) > base, f"the observable never saw the pool in use: {seen}"
    reached, snap, trace = wait_idle(server.url, timeout=60, baseline=base)
    assert reached, f"KV usage did not return to {base}: {trace[-10:]}"
    assert server.alive(), server_log_tail(server)


def _runaway(trace: list, since: float) -> int:
    """Rows (prefill tokens + decode rows) computed after `since` (by the trace of wait_idle)."""
    after = [t for t in trace if t[0] >= since]
    return (after[-1][3] - after[0][3]) if len(after) > 1 else 0


LONG_SEARCH = 800  # steps of the abandoned searches (k=8): long enough to be mid-way when cut


def _settle(server, base: int, timeout: float) -> tuple[bool, dict, int]:
    """After an abort: wait up to `timeout` s for the KV pool to return to `base` (else let an
    abandoned search run out, up to 240 s, and still require the pool back); returns whether it
    came back in time, the last snapshot, and the rows computed after the abort."""
    # a scheduler that sleeps on idle publishes a current snapshot only once something wakes it:
    # poll once and give its idle iteration a moment, so that rows computed before now are not
    # counted as computed after it
    pool(server.url)
    time.sleep(1.0)
    settle_from = time.time()
    reached, snap, trace = wait_idle(server.url, timeout=timeout, baseline=base)
    work_after_abort = _runaway(trace, settle_from)
    if not reached:
        reached_late, snap, late_trace = wait_idle(server.url, timeout=240, baseline=base)
        trace += late_trace
        assert reached_late, f"KV usage never returned to {base}: {trace[-10:]}"
    assert server.alive(), server_log_tail(server)
    return reached, snap, work_after_abort


def test_kv_and_work_after_client_disconnect(server, tok):
    """A client gives up on a running k-CBS request (read timeout: the connection is closed; the
    server notices within its 4 s disconnect poll and aborts the rid). Afterwards the pool
    usage is back to its start value, and the server stops working on the abandoned search
    (no prefill token or decode row is computed from 12 s after the disconnect on)."""
    base = _baseline(server.url)
    start_work = work_done(pool(server.url))
    body = kcbs_body(prompt_ids(tok, "count"), 8, LONG_SEARCH, True)
    t0 = time.time()
    with pytest.raises(requests.exceptions.ReadTimeout):
        post(server.url, "/generate", body, timeout=3)
    # the scheduler has had 12 s to see the disconnect (4 s poll) and drop the search
    time.sleep(max(0.0, t0 + 12 - time.time()))
    reached, snap, work_after_abort = _settle(server, base, timeout=15)
    total = work_done(snap) - start_work
    print(f"\n[kcbs-abort] disconnect: {total} rows in all, {work_after_abort} computed "
          f"more than 12 s after the client left; pool back to {snap['num_used_tokens']}", flush=True)
    assert reached and work_after_abort == 0 and total < 8 * (LONG_SEARCH - 1), (
        f"the k-CBS search kept running after its client disconnected: {work_after_abort} rows "
        f"computed from 12 s after the disconnect on, {total} in all (the whole search is "
        f"about {8 * (LONG_SEARCH - 1)})"
    )


def test_kv_and_work_after_abort_request(server, tok):
    """POST /abort_request with the rid of a running k-CBS request: the request ends (without
    candidates), the pool usage returns to its start value and the search stops."""
    base = _baseline(server.url)
    start_work = work_done(pool(server.url))
    rid = f"kcbs-abort-{time.time_ns()}"
    body = {**kcbs_body(prompt_ids(tok, "count"), 8, LONG_SEARCH, True), "rid": rid}
    result: dict = {}

    def run():
        try:
            resp = post(server.url, "/generate", body, timeout=300)
            result["status"] = resp.status_code
            result["text"] = resp.text
            result["after_s"] = round(time.time() - t_abort, 1)
        except requests.RequestException as exc:
            result["error"] = repr(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(3)
    t_abort = time.time()
    assert post(server.url, "/abort_request", {"rid": rid}, timeout=60).status_code == 200
    thread.join(20)
    ended = not thread.is_alive()
    reached, snap, work_after_abort = _settle(server, base, timeout=10)
    total = work_done(snap) - start_work
    thread.join(30)
    print(f"\n[kcbs-abort] /abort_request: request ended within 20 s: {ended}; finally "
          f"{str(result)[:160]}; {work_after_abort} rows computed from 20 s after the "
          f"abort on, {total} in all", flush=True)
    assert requests.get(server.url + "/health_generate", timeout=300).status_code == 200
    summary = {k: (v[:200] if isinstance(v, str) else v) for k, v in result.items()}
    assert ended, f"the aborted k-CBS request did not end within 20 s of /abort_request; finally: {summary}"
    assert "kcbs_candidates" not in result.get("text", ""), f"aborted request returned candidates: {summary}"
    assert reached and work_after_abort == 0 and total < 8 * (LONG_SEARCH - 1), (
        f"the k-CBS search kept running after /abort_request: {work_after_abort} rows "
        f"computed from 20 s after the abort on, {total} in all (the whole search is about "
        f"{8 * (LONG_SEARCH - 1)})"
    )


# ------------------------------------------------------------------------------------------
# radix cache off


def test_radix_cache_off_gives_the_reference_candidates(hs_noradix_server, tok, random_model_path):
    """k-CBS on a server without the radix cache: each beam prefills the prompt itself, so its
    rows hold its own prompt slots next to the forked beam positions. Candidates equal the
    transformers reference and the KV pool returns to its start value (every slot freed once)."""
    url = hs_noradix_server.url
    base = _baseline(url)
    cases = [("capital", 3, 5, True), ("count", 2, 8, False), ("fox", 4, 4, True)]
    outs = pmap(lambda c: generate(url, kcbs_body(prompt_ids(tok, c[0]), c[1], c[2], c[3])), cases)
    for (name, k, steps, prune), out in zip(cases, outs):
        want = reference(random_model_path, prompt_ids(tok, name), k, steps, prune)
        assert_candidates_match(out["meta_info"]["kcbs_candidates"], want, f"no radix cache: {name}")
    reached, _, trace = wait_idle(url, timeout=60, baseline=base)
    assert reached, f"KV usage did not return to {base}: {trace[-10:]}"
