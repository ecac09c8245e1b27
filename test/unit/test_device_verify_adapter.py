"""The scheduler side of device verification (adapters/prefill_verification.py): requests take
their rows chunk by chunk from a prefill batch's rows, the batch's complete ones are checked in
one pass, and the finished report equals the host path's (toploc's verifier on host rows, the
token checks read from sglang-shaped log-probs by verification_report) for the same rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_rl.adapters.prefill_verification import DeviceChecks, PrefillVerification, TokenCheckSettings, check_batch
from sglang_rl.adapters.request_state import state_of
from sglang_rl.fingerprint import FingerprintError, Thresholds, build_fingerprint
from sglang_rl.fingerprint.calibration import ThresholdPolicy
from sglang_rl.verification_report import finalize_report

HIDDEN, VOCAB = 64, 1100
POLICY = ThresholdPolicy(Thresholds.for_topk(128), None, "test")


def sequence(seed: int, prompt: int, response: int) -> tuple[list[int], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (prompt + response,), generator=generator).tolist()
    return ids, 3 * torch.randn(prompt + response, HIDDEN, generator=generator)


def sglang_meta(rows: torch.Tensor, head: torch.Tensor, ids: list[int], start: int) -> dict:
    """What sglang returns for a verification's log-probs: input entries from the response start
    (the token's log-prob from the row before it), top-20 lists, the next token's top list."""
    logits = (rows @ head.T).float()
    lp = logits - logits.logsumexp(dim=1, keepdim=True)

    def top(i: int) -> list:
        ranked = sorted(zip(lp[i].tolist(), range(VOCAB)), key=lambda e: (-e[0], e[1]))[:20]
        return [(value, token, None) for value, token in ranked]

    entries = [(lp[p - 1, ids[p]].item(), ids[p], None) for p in range(start, len(ids))]
    return {"prompt_tokens": len(ids), "input_token_logprobs": entries,
            "input_top_logprobs": [top(p - 1) for p in range(start, len(ids))],
            "output_top_logprobs": [top(len(ids) - 1)]}


def fake_batch(reqs: list, prefixes: list[int], extends: list[int]) -> SimpleNamespace:
    return SimpleNamespace(reqs=reqs, prefix_lens=prefixes, extend_lens=extends,
                           forward_mode=SimpleNamespace(is_extend=lambda: True))


def test_chunked_batch_reports_equal_the_host_path() -> None:
    head = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7)) / HIDDEN**0.5
    checks = DeviceChecks(head, max_z=4.0)
    cases = [(0, 30, 70, True), (1, 12, 35, False), (2, 5, 40, False)]
    reqs, host, rows_of = [], [], []
    for seed, prompt, n, lists in cases:
        ids, rows = sequence(seed, prompt, n)
        fp = build_fingerprint(rows[prompt - 1: prompt - 1 + n].to(torch.bfloat16))
        noisy = rows + 1e-3 * torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed + 50))
        if seed == 2:
            noisy[prompt + 18: prompt + 22] *= 4  # tampered rows
        req = SimpleNamespace(origin_input_ids=ids, finished=lambda: True)
        state_of(req).verification = PrefillVerification(
            fp, prompt, POLICY, device=TokenCheckSettings(sampled=True, token_lists=lists), token_lists=lists)
        reqs.append(req)
        rows_of.append(noisy)
        reference = PrefillVerification(fp, prompt, POLICY, token_lists=lists)
        reference.add_rows(noisy)
        host.append((reference, sglang_meta(noisy, head, ids, prompt), lists))
    # two prefill steps: the requests' prompts split at 25 tokens (chunked prefill)
    for lo, hi in ((0, 25), (25, None)):
        parts = [rows[lo:hi] for rows in rows_of]
        check_batch(checks, fake_batch(reqs, [lo] * 3, [p.shape[0] for p in parts]), torch.cat(parts))
    fingerprint_verdicts = []
    for req, (reference, meta, lists) in zip(reqs, host):
        ids = req.origin_input_ids
        mine = finalize_report(state_of(req).verification.finish(len(ids), ids[-1]), {}, expect_sampled=True)
        theirs = finalize_report(reference.finish(len(ids), ids[-1]), meta, expect_sampled=True)
        assert mine.pop("mean_response_logprob") == pytest.approx(theirs.pop("mean_response_logprob"))
        assert abs(mine.pop("sampling_z") - theirs.pop("sampling_z")) < 2e-4
        assert mine == theirs
        assert ("response_token_logprobs" in mine) == lists
        fingerprint_verdicts.append(mine["fingerprint_verified"])
    assert fingerprint_verdicts == [True, True, False]


def test_rows_served_by_the_prefix_cache_are_an_error() -> None:
    ids, rows = sequence(3, 20, 40)
    fp = build_fingerprint(rows[19:59].to(torch.bfloat16))
    req = SimpleNamespace(origin_input_ids=ids)
    verification = PrefillVerification(fp, 20, POLICY, device=TokenCheckSettings())
    state_of(req).verification = verification
    head = torch.randn(VOCAB, HIDDEN)
    check_batch(DeviceChecks(head, 4.0), fake_batch([req], [30], [30]), rows[30:])  # 30 cached tokens
    with pytest.raises(FingerprintError, match="prefix cache"):
        verification.finish(len(ids))
