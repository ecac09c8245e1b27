"""Hidden-state rows under speculative decoding, on a real CPU server with NGRAM drafts.

A verify step computes rows for a whole draft tree and commits a run of tokens (the accepted
path, then the target's own next token); the last run of a request may go past its finish. The
rows delivered must be exactly those of the committed tokens, at their positions, equal to a plain
transformers forward of prompt + response, in every scope, with the final row, with several
requests batched together. NGRAM's draft trees have side branches, so this also covers the move of
the accepted rows to the front of each request's block (adapters/speculative.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from e2e_servers import Server, start_server
from hidden_states_fixtures import assert_serving, check_response, generate, hs_fields, report

# prompts whose greedy continuations repeat what came before, so n-gram drafts get accepted
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "def fib2(n):\n    if n < 2:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
]
# (format, mode, scope, last_n, final row)
CASES = [
    ("base64", True, "all", None, True),
    ("list", True, "all", None, False),
    ("base64", True, "response", None, True),
    ("base64", "last", "all", None, False),
    ("list", True, "last_n", 7, True),
]
MAX_NEW = 37  # not a multiple of any run length: the last run usually overshoots max_new_tokens


@pytest.fixture(scope="module")
def ngram_server(model_path: str) -> Iterator[Server]:
    server = start_server(model_path, "--enable-return-hidden-states", "--speculative-algorithm", "NGRAM",
                          log_name="hs-ngram")
    yield server
    server.stop()


def _one(url: str, prompt: str, case: tuple) -> dict:
    fmt, mode, scope, last_n, final = case
    return generate(url, prompt, MAX_NEW, fields=hs_fields(mode, fmt, scope, last_n, final))


def test_rows_follow_the_committed_tokens(ngram_server: Server, hf) -> None:
    """Every case of every prompt, all sent at once (batched verify steps), plus plain requests in
    the same batches; each response's rows against HF at its own input + output ids."""
    jobs = [(p, c) for p in PROMPTS for c in CASES]
    with ThreadPoolExecutor(len(jobs) + len(PROMPTS)) as pool:
        plain = [pool.submit(generate, ngram_server.url, p, MAX_NEW) for p in PROMPTS]
        futures = [pool.submit(_one, ngram_server.url, p, c) for p, c in jobs]
        outs = [f.result() for f in futures]
        plain_outs = [f.result() for f in plain]
    tokens = steps = 0
    worst = 0.0
    for (prompt, (fmt, mode, scope, last_n, final)), out in zip(jobs, outs):
        meta = out["meta_info"]
        what = f"{prompt[:20]!r} {fmt} {mode} {scope} final={final}"
        worst = max(worst, check_response(hf, meta, mode=mode, fmt=fmt, scope=scope, last_n=last_n,
                                          final=final, what=what))
        tokens += meta["completion_tokens"]
        steps += meta["spec_verify_ct"]
    for out in plain_outs:
        assert "hidden_states" not in out["meta_info"]
    report("ngram_rows", requests=len(jobs), tokens=tokens, verify_steps=steps,
           tokens_per_step=round(tokens / steps, 2), max_abs_diff=f"{worst:.2e}")
    # the point of the test: verify steps really committed runs of several tokens
    assert steps < tokens * 0.8, f"{tokens} tokens in {steps} verify steps: too few drafts accepted to test runs"
    assert_serving(ngram_server.url)


def test_same_tokens_as_without_hidden_states(ngram_server: Server) -> None:
    """Capturing rows (and the final row's extra step) does not change what is generated."""
    for prompt in PROMPTS:
        plain = generate(ngram_server.url, prompt, MAX_NEW)["meta_info"]
        rows = _one(ngram_server.url, prompt, CASES[0])["meta_info"]
        assert rows["output_ids"] == plain["output_ids"]
        assert rows["finish_reason"] == plain["finish_reason"]
