"""Fingerprints to and from toploc's own proof lists, checked against toploc itself: proofs built
by toploc become fingerprints the plugin's verifier accepts, fingerprints become proof lists
toploc's verifier accepts, and the client's pure-Python decoder is the plugin's."""

from __future__ import annotations

import base64
import random
import struct

import pytest
import torch

import toploc

import sglang_rl_client.fingerprint as client_fp
from sglang_rl.fingerprint import (
    PRIME,
    FingerprintError,
    Thresholds,
    decode_fingerprint,
    encode_fingerprint,
    from_toploc_proofs,
    proof_num_bytes,
    to_toploc_proofs,
    verify_rows,
)
from sglang_rl.fingerprint.codec import build_fingerprint

CASES = [(1, 16), (31, 128), (32, 128), (33, 16), (70, 128), (100, 64)]


def rows_of(n: int, hidden: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def toploc_verifies(rows: torch.Tensor, proofs: list[str], topk: int) -> list:
    return toploc.verify_proofs_base64(rows, proofs, decode_batching_size=32, topk=topk, skip_prefill=True)


@pytest.mark.parametrize("n, topk", CASES)
def test_toploc_proofs_become_fingerprints_both_verifiers_accept(n: int, topk: int) -> None:
    rows = rows_of(n, seed=n)
    # toploc's decode-step usage: one activation row per generated token, 32 per proof
    proofs = toploc.build_proofs_base64(list(rows), decode_batching_size=32, topk=topk, skip_prefill=True)
    assert len(proofs) == -(-n // 32)
    fp = from_toploc_proofs(proofs, n_rows=n)
    assert (fp.topk, fp.chunk_size, fp.n_rows) == (topk, 32, n)
    text = encode_fingerprint(fp)
    report = verify_rows(rows, decode_fingerprint(text, expected_topk=topk), Thresholds(0, 0.0, 0.0))
    assert report.verified and report.worst_exp_mismatches == 0
    back = to_toploc_proofs(text)
    assert back == proofs
    assert all(r.exp_mismatches == 0 and r.mant_err_mean == 0 for r in toploc_verifies(rows, back, topk))
    # the same proofs as bytes or as toploc's ProofPoly objects give the same fingerprint
    as_bytes = toploc.build_proofs_bytes(list(rows), decode_batching_size=32, topk=topk, skip_prefill=True)
    polys = toploc.build_proofs(list(rows), decode_batching_size=32, topk=topk, skip_prefill=True)
    assert from_toploc_proofs(as_bytes, n) == fp == from_toploc_proofs(polys, n)
    assert client_fp.from_toploc_proofs(proofs, n) == fp  # the client's conversion, without toploc


@pytest.mark.parametrize("n, topk", CASES[::2])
def test_plugin_fingerprints_become_proof_lists_toploc_accepts(n: int, topk: int) -> None:
    rows = rows_of(n, seed=100 + n)
    fp = build_fingerprint(rows, topk=topk)
    proofs = to_toploc_proofs(fp)
    assert proofs == [base64.b64encode(p).decode() for p in fp.proofs]
    assert all(r.exp_mismatches == 0 for r in toploc_verifies(rows, proofs, topk))
    other = rows_of(n, seed=200 + n)  # other activations: toploc rejects them
    assert all(r.exp_mismatches > Thresholds.for_topk(topk).max_exp_mismatches
               for r in toploc_verifies(other, proofs, topk))
    assert not verify_rows(other, from_toploc_proofs(proofs, n)).verified


def test_conversions_refuse_what_toploc_would_crash_on() -> None:
    rows = rows_of(40)
    proofs = toploc.build_proofs_base64(list(rows), decode_batching_size=32, topk=16, skip_prefill=True)
    null = [p.to_base64() for p in [toploc.ProofPoly.null(16)] * 2]  # what toploc writes when building fails
    with pytest.raises(FingerprintError, match="proof 0 has modulus 0"):
        from_toploc_proofs(null, 40)
    with pytest.raises(FingerprintError, match="40 rows in chunks of 32 need 2 proofs, got 1"):
        from_toploc_proofs(proofs[:1], 40)
    with pytest.raises(FingerprintError, match="need 1 proofs, got 2"):
        from_toploc_proofs(proofs, 32)
    with pytest.raises(FingerprintError, match="proof 1 has 34 bytes, expected 258"):
        from_toploc_proofs([to_toploc_proofs(build_fingerprint(rows[:32]))[0], proofs[1]], 40)
    with pytest.raises(FingerprintError, match="proof 1 is not valid base64"):
        from_toploc_proofs([proofs[0], "not base64!"], 40)
    with pytest.raises(FingerprintError, match="the proof list is empty"):
        from_toploc_proofs([], 40)
    with pytest.raises(FingerprintError, match="must be a list of toploc proofs"):
        from_toploc_proofs(proofs[0], 40)


def test_client_and_plugin_share_one_decoder_and_agree_on_many_fingerprints() -> None:
    """The plugin re-exports the client's pure-Python container code (one implementation); its
    constants match the proof builder's, and random valid and corrupted strings decode alike."""
    assert decode_fingerprint is client_fp.decode_fingerprint
    assert client_fp.PRIME == PRIME and client_fp.proof_num_bytes(128) == proof_num_bytes(128) == 258
    rng = random.Random(3)
    decoded = refused = 0
    for i in range(300):
        topk, chunk, n = rng.choice((4, 16, 128)), rng.choice((1, 7, 32)), rng.randint(1, 80)
        proofs = [struct.pack(f">{topk + 1}H", rng.randint(topk, PRIME), *(rng.randrange(PRIME) for _ in range(topk)))
                  for _ in range(-(-n // chunk))]  # valid moduli and coefficients
        raw = bytearray(struct.pack(">2sBBHI", b"TL", 1, chunk, topk, n) + b"".join(proofs))
        if i % 3 == 0:  # a flipped bit in the header or the first proof's modulus
            raw[rng.randrange(12)] ^= 1 << rng.randrange(8)
        text = base64.b64encode(bytes(raw)).decode()
        try:
            fp = client_fp.decode_fingerprint(text)
        except FingerprintError:
            refused += 1
            continue
        decoded += 1
        assert encode_fingerprint(fp) == text and client_fp.to_toploc_proofs(text) == to_toploc_proofs(fp)
    assert decoded > 150 and refused > 50
