"""Hidden-state rows and TOPLOC fingerprints under speculative decoding, on a real CPU server with
NGRAM drafts (--toploc-verification and --enable-return-hidden-states together).

A verify step computes rows for a whole draft tree and commits a run of tokens (the accepted
path, then the target's own next token); the last run of a request may go past its finish. The
rows delivered must be exactly those of the committed tokens, at their positions, equal to a plain
transformers forward of prompt + response, in every scope, with the final row, with several
requests batched together. NGRAM's draft trees have side branches, so this also covers the move of
the accepted rows to the front of each request's block (adapters/speculative.py).

A fingerprint covers exactly the committed tokens of each step, in order: it verifies on a server
without speculative decoding (and a plain server's fingerprints verify here), its proofs equal
toploc's own proofs of the delivered rows, and it fails against another response's ids.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import toploc
import torch

from e2e_servers import Server, Spec, server_fixture
from hidden_states_fixtures import assert_serving, check_response, generate, hs_fields, report, rows_of
from toploc_helpers import assert_fingerprints_verify, decode, last_fp, pmap

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


NGRAM = Spec("hs-ngram", ("--enable-return-hidden-states", "--toploc-verification", "--speculative-algorithm", "NGRAM"))
ngram_server = server_fixture(NGRAM, scope="module")


def _one(url: str, prompt: str, case: tuple) -> dict:
    fmt, mode, scope, last_n, final = case
    return generate(url, prompt, MAX_NEW, fields=hs_fields(mode, fmt, scope, last_n, final))


def test_rows_follow_the_committed_tokens(ngram_server: Server, toploc_server: Server, hf) -> None:
    """Every case, each on one of the prompts (every prompt has some), all sent at once (batched
    verify steps), plus plain requests in the same batches; each response's rows against HF at its
    own input + output ids."""
    jobs = [(PROMPTS[i % len(PROMPTS)], c) for i, c in enumerate(CASES)]
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
        assert not {"hidden_states", "hidden_states_rows"} & set(out["meta_info"])
    # rows, the final row's extra step and speculative runs together: every fingerprint verifies
    assert_fingerprints_verify(toploc_server.url, [o["meta_info"] for o in outs + plain_outs])
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


def _mixed(url: str) -> list[dict]:
    """Greedy and sampled requests sent together, one of them with n=2."""
    jobs = [(p, 0.0, 1) for p in PROMPTS] + [(p, 0.8, 1) for p in PROMPTS[:2]] + [(PROMPTS[0], 0.8, 2)]

    def one(job: tuple) -> list[dict]:
        prompt, temperature, n = job
        out = generate(url, prompt, MAX_NEW, temperature=temperature, n=n)
        return [o["meta_info"] for o in (out if isinstance(out, list) else [out])]

    return [meta for metas in pmap(one, jobs) for meta in metas]


def test_ngram_fingerprints_verify_on_a_plain_server(ngram_server: Server, toploc_server: Server) -> None:
    """The verifier needs no speculative decoding: runs of committed tokens give the same
    fingerprint as one token per step, within toploc's bounds of a prefill recomputation."""
    metas = _mixed(ngram_server.url)
    tokens = sum(m["completion_tokens"] for m in metas)
    steps = sum(m["spec_verify_ct"] for m in metas)
    assert steps < tokens * 0.8, f"{tokens} tokens in {steps} verify steps: too few drafts accepted"
    reports = assert_fingerprints_verify(toploc_server.url, metas)
    report("ngram_fingerprints", responses=len(metas), tokens=tokens, verify_steps=steps,
           worst_exp_mismatches=max(r["worst_exp_mismatches"] for r in reports))


def test_plain_fingerprints_verify_on_the_ngram_server(ngram_server: Server, toploc_server: Server) -> None:
    """The other way round: a speculative server verifies a plain server's fingerprints."""
    assert_fingerprints_verify(ngram_server.url, _mixed(toploc_server.url))
    assert_serving(ngram_server.url)


def test_proofs_equal_toploc_of_the_delivered_rows(ngram_server: Server) -> None:
    """The rows a response delivers are the rows its fingerprint was built from: toploc's own
    proofs of rows L-1 .. L+n-2 (the rows that produced the n returned tokens) equal the
    fingerprint's, byte for byte, although the last verify step went past max_new_tokens."""
    outs = pmap(lambda p: generate(ngram_server.url, p, MAX_NEW, fields=hs_fields(True, "base64", "all")),
                PROMPTS)
    for out in outs:
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] < meta["completion_tokens"], meta
        rows, positions = rows_of(meta, "base64")
        start, n = len(meta["input_ids"]) - 1, len(meta["output_ids"])
        assert positions[start : start + n] == list(range(start, start + n))
        expected = toploc.build_proofs_bytes(rows[start : start + n].to(torch.bfloat16), decode_batching_size=32,
                                             topk=128, skip_prefill=True)
        fp = decode(last_fp(meta))
        assert fp.n_rows == n
        assert list(fp.proofs) == expected


def test_every_pair_of_the_interaction_matrix_under_ngram(ngram_server: Server, hf) -> None:
    """The interaction matrix (test_interaction_matrix.py) on this server: every pair of request
    features in flight at once under NGRAM speculative decoding, each answer checked against its
    own contracts and its fingerprint against its own ids and another request's."""
    from test_interaction_matrix import PAIRS, check_pair, send_all

    # k-CBS runs beams of plain decode steps: refused under speculative decoding
    refused = {frozenset(p): "k-CBS is not supported with speculative decoding" for p in PAIRS if "kcbs" in p}
    failures = []
    for names, (status, result) in send_all(ngram_server.url).items():
        try:
            check_pair(names, status, result, ngram_server.url, hf, refused)
        except AssertionError as exc:
            failures.append(f"{'+'.join(names)}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)
    assert_serving(ngram_server.url)
