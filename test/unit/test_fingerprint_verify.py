"""Verification through toploc's C++ path: honest rows pass, other data fails, bad shapes raise."""

from __future__ import annotations

import json

import pytest
import torch

import toploc

from sglang_rl.fingerprint import (
    PRIME,
    Fingerprint,
    FingerprintError,
    Thresholds,
    decode_fingerprint,
    encode_fingerprint,
    verify_rows,
)
from sglang_rl.fingerprint.codec import build_fingerprint
from sglang_rl.fingerprint.verify import NOTHING_MATCHED


def fake_hidden_states(tokens: torch.Tensor, hidden: int = 576, seed: int = 0) -> torch.Tensor:
    """Prompt-like activations: a fixed random embedding + projection + RMS norm of token ids."""
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(1000, hidden, generator=generator)
    projection = torch.randn(hidden, hidden, generator=generator) / hidden**0.5
    h = embedding[tokens]
    running_mean = h.cumsum(0) / torch.arange(1, len(tokens) + 1).unsqueeze(1)
    h = h + torch.tanh(h @ projection) + 0.1 * running_mean
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def round_trip(rows: torch.Tensor, topk: int = 128, chunk_size: int = 32) -> Fingerprint:
    fp = build_fingerprint(rows, topk=topk, chunk_size=chunk_size)
    return decode_fingerprint(encode_fingerprint(fp), expected_topk=topk)


def test_thresholds_scale_with_topk() -> None:
    assert Thresholds.for_topk(128) == Thresholds(38, 10.0, 8.0)
    assert Thresholds.for_topk(64).max_exp_mismatches == 19
    assert Thresholds.for_topk(8).max_exp_mismatches == 2
    assert Thresholds.for_topk(1).max_exp_mismatches == 1
    assert Thresholds.for_topk(256, exp_mismatches_at_128=10).max_exp_mismatches == 20
    assert Thresholds.for_topk(128, mant_err_mean=2, mant_err_median=1) == Thresholds(38, 2.0, 1.0)


def test_honest_rows_verify() -> None:
    tokens = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(1))
    rows = fake_hidden_states(tokens).to(torch.bfloat16)
    fp = round_trip(rows)
    report = verify_rows(rows, fp)
    assert report.verified
    assert len(report.chunks) == 3
    assert report.worst_exp_mismatches == 0
    assert report.worst_mant_err_mean == 0.0 and report.worst_mant_err_median == 0.0
    direct = toploc.verify_proofs_bytes(
        rows, list(fp.proofs), decode_batching_size=32, topk=128, skip_prefill=True
    )
    assert [r.exp_mismatches for r in direct] == [0, 0, 0]
    assert [r.mant_err_mean for r in direct] == [0.0, 0.0, 0.0]


def test_fp32_rows_equal_to_bf16_values_verify() -> None:
    rows = torch.randn(40, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    fp = round_trip(rows, topk=64, chunk_size=16)
    report = verify_rows(rows.float(), fp)
    assert report.verified and report.worst_exp_mismatches == 0


def test_fp32_recompute_noise_passes() -> None:
    tokens = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(3))
    exact = fake_hidden_states(tokens)
    fp = round_trip(exact.to(torch.bfloat16))
    noise = torch.randn(exact.shape, generator=torch.Generator().manual_seed(4))
    noisy = exact * (1 + 1e-3 * noise)
    report = verify_rows(noisy, fp)
    assert report.verified
    assert report.worst_exp_mismatches <= 10


def test_low_modulus_chunk_verifies() -> None:
    flat = torch.randn(32 * 4096, generator=torch.Generator().manual_seed(5))
    flat[7], flat[7 + PRIME] = 50.0, -60.0
    rows = flat.view(32, 4096).to(torch.bfloat16)
    fp = round_trip(rows)
    assert int.from_bytes(fp.proofs[0][:2], "big") < PRIME
    report = verify_rows(rows, fp)
    assert report.verified and report.worst_exp_mismatches == 0


def test_other_random_rows_fail() -> None:
    rows = torch.randn(64, 576, generator=torch.Generator().manual_seed(6))
    other = torch.randn(64, 576, generator=torch.Generator().manual_seed(7))
    report = verify_rows(other, round_trip(rows))
    assert not report.verified
    assert all(chunk.exp_mismatches > 38 for chunk in report.chunks)


def test_different_prompt_fails() -> None:
    generator = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 1000, (48,), generator=generator)
    other_tokens = tokens.clone()
    other_tokens[:16] = torch.randint(0, 1000, (16,), generator=generator)
    fp = round_trip(fake_hidden_states(tokens), chunk_size=16)
    report = verify_rows(fake_hidden_states(other_tokens), fp)
    assert not report.verified
    assert report.chunks[0].exp_mismatches > 38


def test_different_weights_fail() -> None:
    tokens = torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(9))
    fp = round_trip(fake_hidden_states(tokens, seed=0))
    report = verify_rows(fake_hidden_states(tokens, seed=1), fp)
    assert not report.verified


def test_nothing_matched_report_is_json_safe() -> None:
    rows = torch.randn(32, 576, generator=torch.Generator().manual_seed(10))
    fp = round_trip(rows)
    report = verify_rows(rows * 1024, fp)
    assert not report.verified
    assert report.worst_exp_mismatches == 128
    assert report.worst_mant_err_mean == NOTHING_MATCHED == 2.0**64
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["verified"] is False
    assert data["chunks"][0] == {
        "exp_mismatches": 128,
        "mant_err_mean": NOTHING_MATCHED,
        "mant_err_median": NOTHING_MATCHED,
    }
    assert data["thresholds"] == {
        "max_exp_mismatches": 38,
        "max_mant_err_mean": 10.0,
        "max_mant_err_median": 8.0,
    }


def test_custom_thresholds_decide() -> None:
    rows = torch.randn(32, 576, generator=torch.Generator().manual_seed(11))
    fp = round_trip(rows)
    shifted = rows.to(torch.bfloat16).view(torch.int16)
    shifted = (shifted + 3).view(torch.bfloat16)
    loose = verify_rows(shifted, fp, Thresholds(38, 10.0, 8.0))
    strict = verify_rows(shifted, fp, Thresholds(38, 1.0, 1.0))
    assert loose.verified and not strict.verified
    assert loose.worst_mant_err_median == 3.0


def test_row_count_mismatch_raises() -> None:
    rows = torch.randn(40, 576)
    fp = round_trip(rows)
    with pytest.raises(FingerprintError, match="covers 40 rows, got 39"):
        verify_rows(rows[:39], fp)
    with pytest.raises(FingerprintError, match="2-D"):
        verify_rows(rows.view(-1), fp)


def test_chunk_smaller_than_topk_raises() -> None:
    fp = round_trip(torch.randn(33, 576))
    with pytest.raises(FingerprintError, match="1 rows x 64 holds 64 elements, fewer than topk"):
        verify_rows(torch.randn(33, 64), fp)
