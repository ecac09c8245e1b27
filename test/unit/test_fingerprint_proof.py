"""Batched TOPLOC proof building must be byte-identical to toploc 0.1.6 (used as the oracle)."""

from __future__ import annotations

import random

import pytest
import torch

import toploc
from toploc.C.csrc.poly import ProofPoly

from sglang_rl.fingerprint import (
    PRIME,
    build_chunk_proofs,
    interpolate,
    proof_num_bytes,
    select_topk,
)
from sglang_rl.fingerprint import proof as proof_module


def toploc_proof(chunk: torch.Tensor, topk: int) -> bytes:
    """toploc's proof of one [R, H] chunk (bf16), the reference for every comparison."""
    proofs = toploc.build_proofs_bytes(
        chunk.to(torch.bfloat16), decode_batching_size=chunk.shape[0], topk=topk, skip_prefill=True
    )
    assert len(proofs) == 1
    return proofs[0]


def modulus_of(proof: bytes) -> int:
    return int.from_bytes(proof[:2], "big")


@pytest.mark.parametrize("topk", [8, 64, 128])
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_random_chunks_match_toploc(rows: int, hidden: int, topk: int) -> None:
    generator = torch.Generator().manual_seed(rows * 100_003 + hidden * 7 + topk)
    chunks = torch.randn(3, rows, hidden, generator=generator).to(torch.bfloat16)
    expected = [toploc_proof(chunk, topk) for chunk in chunks]
    assert build_chunk_proofs(chunks, topk) == expected
    assert build_chunk_proofs(list(chunks), topk) == expected
    assert all(len(p) == proof_num_bytes(topk) for p in expected)


def test_fp32_input_is_rounded_to_bf16_first() -> None:
    generator = torch.Generator().manual_seed(1)
    chunks = torch.randn(4, 32, 576, generator=generator)
    expected = [toploc_proof(chunk.to(torch.bfloat16), 128) for chunk in chunks]
    assert build_chunk_proofs(chunks, 128) == expected


def test_mixed_chunk_sizes_keep_input_order() -> None:
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(75, 576, generator=generator).to(torch.bfloat16)
    chunks = list(rows.split(32)) + [rows[:5], rows[5:37]]
    expected = [toploc_proof(chunk, 64) for chunk in chunks]
    assert build_chunk_proofs(chunks, 64) == expected


def _tie_free_rows(n_rows: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 rows whose |x| are all distinct, so every top-k is the same set whatever the tie
    order of the top-k implementation."""
    exponents = torch.arange(-20, 21, dtype=torch.float32).repeat_interleave(128)
    mantissas = torch.arange(128, dtype=torch.float32).repeat(41)
    magnitudes = torch.ldexp(1 + mantissas / 128, exponents.to(torch.int32))
    picked = magnitudes[torch.randperm(magnitudes.numel(), generator=generator)[: n_rows * hidden]]
    signs = torch.randint(0, 2, picked.shape, generator=generator) * 2 - 1
    return (picked * signs).to(torch.bfloat16).view(n_rows, hidden)


def test_one_padded_call_for_mixed_sizes_matches_toploc() -> None:
    """The accelerators' path: chunks of many sizes in one padded top-k (tie-free values: the
    CPU's top-k may order ties differently in a longer row, as a GPU's does)."""
    generator = torch.Generator().manual_seed(2)
    chunks = [_tie_free_rows(n, 64, generator) for n in (32, 5, 32, 17, 1, 31, 2)]
    assert build_chunk_proofs(chunks, 64, ragged=True) == [toploc_proof(c, 64) for c in chunks]


def test_padding_is_never_selected() -> None:
    """A chunk of exactly topk elements, mostly zeros, padded beside long chunks: every one of
    its own elements is selected, none of the padding."""
    generator = torch.Generator().manual_seed(5)
    small = torch.zeros(1, 64, dtype=torch.bfloat16)
    small[0, [3, 40]] = torch.tensor([-2.0, 0.5], dtype=torch.bfloat16)
    chunks = [_tie_free_rows(32, 64, generator), small, _tie_free_rows(3, 64, generator)]
    assert build_chunk_proofs(chunks, 64, ragged=True) == [toploc_proof(c, 64) for c in chunks]


def _colliding_chunk(pairs: list[tuple[int, int]], seed: int) -> torch.Tensor:
    """A [32, 4096] chunk whose largest values sit at the given index pairs (131072 > 2 * PRIME)."""
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(32 * 4096, generator=generator)
    magnitude = 100.0
    for first, second in pairs:
        flat[first] = magnitude
        flat[second] = -magnitude * 0.75
        magnitude += 3.0
    return flat.view(32, 4096).to(torch.bfloat16)


@pytest.mark.parametrize("topk", [8, 64, 128])
def test_index_collisions_force_a_smaller_modulus(topk: int) -> None:
    pairs = [(11, 11 + PRIME), (500, 500 + PRIME - 1), (1234, 1234 + PRIME - 2)]
    chunks = torch.stack([_colliding_chunk(pairs, seed) for seed in range(3)])
    expected = [toploc_proof(chunk, topk) for chunk in chunks]
    assert all(modulus_of(p) <= PRIME - 3 for p in expected)
    assert build_chunk_proofs(chunks, topk) == expected


def test_many_collisions_cross_several_candidate_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    k = 128
    indices = []
    for i in range(k // 2):
        start = 1000 * i
        indices += [start, start + PRIME - i]
    x = torch.tensor([indices], dtype=torch.int64)
    y = torch.randint(0, 65536, (1, k), generator=torch.Generator().manual_seed(3))
    expected = ProofPoly.from_points(indices, y[0].tolist()).to_bytes()
    assert modulus_of(expected) <= PRIME - k // 2
    assert interpolate(x, y) == [expected]
    monkeypatch.setattr(proof_module, "_FIRST_BLOCKS", ())
    monkeypatch.setattr(proof_module, "_BLOCK", 7)
    assert interpolate(x, y) == [expected]
    monkeypatch.setattr(proof_module, "_BLOCK", 256)
    monkeypatch.setattr(proof_module, "_MAX_SEARCH_ELEMENTS", 3 * k)
    assert interpolate(x.repeat(2, 1), y.repeat(2, 1)) == [expected, expected]


def test_interpolate_batch_matches_toploc_from_points() -> None:
    generator = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    k = 32
    rows = [rng.sample(range(2**31 - 1), k) for _ in range(2)] + [rng.sample(range(200_000), k)]
    x = torch.tensor(rows, dtype=torch.int64)
    y = torch.randint(0, 65536, (3, k), generator=generator)
    y[0, :6] = torch.tensor([65535, 65497, 65500, 0, 65496, 1])
    expected = [ProofPoly.from_points(a.tolist(), b.tolist()).to_bytes() for a, b in zip(x, y)]
    assert interpolate(x, y) == expected


def test_topk_of_one() -> None:
    chunks = torch.randn(2, 1, 576).to(torch.bfloat16)
    assert build_chunk_proofs(chunks, 1) == [toploc_proof(chunk, 1) for chunk in chunks]


def test_select_topk_returns_bf16_bit_patterns() -> None:
    generator = torch.Generator().manual_seed(5)
    flat = torch.randn(3, 1000, generator=generator)
    indices, bits = select_topk(flat, 16)
    assert indices.dtype == torch.int64 and bits.dtype == torch.int32
    assert indices.shape == bits.shape == (3, 16)
    rounded = flat.to(torch.bfloat16)
    expected = rounded.gather(1, indices).view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(bits, expected)
    assert int(bits.min()) >= 0 and int(bits.max()) <= 0xFFFF
    assert torch.equal(indices, rounded.abs().topk(16, dim=1).indices)


def test_too_few_elements_raise() -> None:
    with pytest.raises(ValueError, match="fewer than topk"):
        build_chunk_proofs([torch.randn(1, 100)], 128)
    with pytest.raises(ValueError, match="fewer than topk"):
        build_chunk_proofs(torch.randn(2, 1, 100), 128)
    with pytest.raises(ValueError):
        select_topk(torch.randn(2, 10), 11)


def test_duplicate_or_out_of_range_indices_raise() -> None:
    bits = torch.ones(1, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="distinct"):
        interpolate(torch.tensor([[1, 5, 1]]), bits)
    with pytest.raises(ValueError, match="flat indices"):
        interpolate(torch.tensor([[1, 5, 2**31]]), bits)
    with pytest.raises(ValueError, match="16-bit"):
        interpolate(torch.tensor([[1, 5, 7]]), bits * 65536)


def test_empty_inputs() -> None:
    assert build_chunk_proofs([], 8) == []
    assert build_chunk_proofs(torch.zeros(0, 4, 8), 8) == []
    nothing = torch.zeros(0, 8, dtype=torch.int64)
    assert interpolate(nothing, nothing.to(torch.int32)) == []


@pytest.mark.parametrize("topk", [1, 2, 5, 64, 128, 129])
def test_matrix_path_matches_toploc(topk: int) -> None:
    """The GPU interpolation (expanded Lagrange form, float64 matmuls) gives toploc's bytes; it
    runs here on CPU tensors, the same ops a GPU server runs on the device."""
    generator = torch.Generator().manual_seed(topk)
    chunks = torch.randn(5, 32, 576, generator=generator).to(torch.bfloat16)
    indices, bits = select_topk(chunks.reshape(5, -1), topk)
    assert proof_module._matrix_proofs(indices, bits) == [toploc_proof(c, topk) for c in chunks]


def test_matrix_path_with_colliding_indices_and_batch_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = [(11, 11 + PRIME), (500, 500 + PRIME - 1), (1234, 1234 + PRIME - 2)]
    chunks = torch.stack([_colliding_chunk(pairs, seed) for seed in range(3)])
    expected = [toploc_proof(chunk, 128) for chunk in chunks]
    indices, bits = select_topk(chunks.reshape(3, -1), 128)
    monkeypatch.setattr(proof_module, "_LAGRANGE_MAX_ELEMENTS", 2 * 128 * 128)  # slices of 2 rows
    assert proof_module._matrix_proofs(indices, bits) == expected


def test_matrix_path_extreme_points() -> None:
    """Points at the field's edges (x near PRIME, y = 65535 > PRIME) through the matrix path."""
    rng = random.Random(6)
    k = 128
    x = torch.tensor([[PRIME - 1, 0, 1] + rng.sample(range(2, PRIME - 1), k - 3)], dtype=torch.int64)
    y = torch.tensor([[65535, 65497, 0] + [rng.randrange(65536) for _ in range(k - 3)]])
    expected = ProofPoly.from_points(x[0].tolist(), y[0].tolist()).to_bytes()
    assert proof_module._matrix_proofs(x, y) == [expected]


def _words_proofs(chunks: list[torch.Tensor], topk: int) -> list[bytes]:
    """`proof_words` over chunks padded to 32 rows (the padding holds huge values, which must
    never be picked), then `proofs_from_words`."""
    hidden = chunks[0].shape[1]
    padded = torch.full((len(chunks), 32, hidden), 1e4, dtype=torch.bfloat16)
    for i, chunk in enumerate(chunks):
        padded[i, : chunk.shape[0]] = chunk
    rows = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64)
    return proof_module.proofs_from_words(proof_module.proof_words(padded, rows, topk), topk)


@pytest.mark.parametrize("topk", [1, 16, 128])
def test_fixed_shape_words_match_toploc(topk: int) -> None:
    """The GPU servers' graph-replayed path: padded chunks of many row counts in one fixed
    sequence of ops give toploc's bytes (tie-free values: a padded row's top-k may order ties
    differently, as toploc's own GPU top-k may)."""
    generator = torch.Generator().manual_seed(topk)
    chunks = [_tie_free_rows(n, 64, generator) for n in (32, 5, 32, 17, 2, 31, 32)]
    assert _words_proofs(chunks, topk) == [toploc_proof(c, topk) for c in chunks]


def test_fixed_shape_words_use_a_smaller_modulus_among_the_candidates() -> None:
    pairs = [(11, 11 + PRIME), (500, 500 + PRIME - 1), (1234, 1234 + PRIME - 2)]
    chunks = [_colliding_chunk(pairs, seed) for seed in range(3)]
    expected = [toploc_proof(chunk, 128) for chunk in chunks]
    assert all(modulus_of(p) == PRIME - 3 for p in expected)
    words = proof_module.proof_words(torch.stack(chunks), torch.full((3,), 32), 128)
    assert words[:, 0].tolist() == [PRIME - 3] * 3  # found on the device, no host fallback
    assert proof_module.proofs_from_words(words, 128) == expected


def test_rows_without_a_candidate_modulus_are_proven_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose indices collide under every fixed candidate gets modulus 0 from the device
    and its proof from the host's full search; the other rows keep the device's."""
    pairs = [(11, 11 + PRIME), (500, 500 + PRIME - 1)]
    generator = torch.Generator().manual_seed(9)
    plain = torch.randn(32, 4096, generator=generator).to(torch.bfloat16)
    chunks = [_colliding_chunk(pairs, 1), plain]
    monkeypatch.setattr(proof_module, "FIXED_CANDIDATES", 2)
    words = proof_module.proof_words(torch.stack(chunks), torch.full((2,), 32), 128)
    assert words[0, 0] == 0 and words[1, 0] == PRIME
    assert proof_module.proofs_from_words(words, 128) == [toploc_proof(c, 128) for c in chunks]


def test_packing_refuses_a_proof_out_of_range() -> None:
    """The check that lets the server encode its own proofs without re-reading them: a zero
    modulus (no injective one was found) or a coefficient at the prime never leaves `_pack`."""
    moduli, coeffs = torch.tensor([PRIME, 300]), torch.tensor([[1, 2], [3, PRIME - 1]])
    assert len(proof_module._pack(moduli, coeffs)) == 2
    with pytest.raises(ValueError, match="out of range"):
        proof_module._pack(torch.tensor([PRIME, 0]), coeffs)
    with pytest.raises(ValueError, match="out of range"):
        proof_module._pack(moduli, torch.tensor([[1, 2], [3, PRIME]]))
    with pytest.raises(ValueError, match="out of range"):
        proof_module._pack(moduli, torch.tensor([[1, -1], [3, 4]]))  # would wrap to 65535 as u16
    with pytest.raises(ValueError, match="out of range"):
        proof_module._pack(torch.tensor([PRIME, 1]), coeffs)  # a modulus below k
