"""Batched TOPLOC proof building, byte-identical to ``toploc`` 0.1.6.

A TOPLOC proof of a chunk of activations is the polynomial over GF(65497) that maps each of the
chunk's top-k flat indices (by magnitude, reduced by an "injective modulus") to the bf16 bit
pattern of the value stored there. toploc builds proofs one chunk at a time; here the top-k
selection runs as one batched call on the activations' device, and so does the interpolation:
on the CPU the Newton form vectorised over all proofs in numpy, on a GPU an expanded Lagrange
form in a few dozen batched kernels (exact float64 matmuls), so fingerprinting many sequences
costs a few tensor ops instead of a Python loop per chunk, and only the coefficients leave the
GPU.

Serialised proof layout (toploc's ``ProofPoly.to_bytes``): the modulus as u16 big-endian, then the
k polynomial coefficients in ascending degree, each as u16 big-endian (2 + 2k bytes).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from sglang_rl.fingerprint.interpolation import PRIME, lagrange_coefficients, newton_coefficients

MAX_FLAT_INDEX = 2**31 - 1
"""toploc stores flat indices as C ints: a chunk may hold at most this many elements."""

_FIRST_BLOCKS = (1, 16)
_BLOCK = 256
_MAX_SEARCH_ELEMENTS = 2**22


def proof_num_bytes(topk: int) -> int:
    """Size of one serialised proof: u16 modulus plus ``topk`` u16 coefficients."""
    return 2 + 2 * topk


def select_topk(flat: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of |x| per row of ``flat`` [B, N] on its own device, after rounding to bfloat16.

    Rounding first matters: proof values are bf16 bit patterns and the ranking must be the one
    toploc computes on the bf16 tensor. Returns (indices int64 [B, k], bf16 bit patterns as
    int32 [B, k] in 0..65535), both on ``flat``'s device.
    """
    if flat.dim() != 2:
        raise ValueError(f"select_topk expects a 2-D [batch, elements] tensor, got {flat.shape}")
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")
    if flat.shape[1] < topk:
        raise ValueError(f"each row needs at least topk={topk} elements, got {flat.shape[1]}")
    values = flat.to(torch.bfloat16)
    return _ranked_bits(values, values.abs(), topk)


def _ranked_bits(values: torch.Tensor, magnitude: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the `topk` largest `magnitude` per row, and the bf16 bit patterns of `values`
    there (int32 in 0..65535)."""
    indices = magnitude.topk(topk, dim=1).indices
    bits = values.gather(1, indices).view(torch.int16).to(torch.int32) & 0xFFFF
    return indices, bits


def select_topk_ragged(chunks: Sequence[torch.Tensor], topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_topk`` over chunks of different sizes (on one device) in one call: each chunk's
    values, flattened and padded to the longest, with the padding ranked below every real |x|, so
    it is never picked from a chunk of at least ``topk`` elements (the caller checks that). On a
    GPU one call costs what one chunk size's call does, where grouping by size would cost one
    kernel chain per size (a batch's final chunks come in many sizes)."""
    flat = [chunk.reshape(-1).to(torch.bfloat16) for chunk in chunks]
    values = torch.nn.utils.rnn.pad_sequence(flat, batch_first=True)
    lengths = torch.tensor([f.numel() for f in flat], dtype=torch.int64).to(values.device, non_blocking=True)
    return _ranked_bits_within(values, lengths, topk)


@functools.lru_cache(maxsize=16)
def _positions(elements: int, device: torch.device) -> torch.Tensor:
    return torch.arange(elements, device=device)


def _ranked_bits_within(values: torch.Tensor, lengths: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ranked_bits` of bf16 rows [B, N] whose first `lengths[b]` elements are real: the padding
    after them is ranked below every real |x| (-1), so it is never picked from a row of at least
    `topk` real elements."""
    magnitude = values.abs()
    padding = _positions(values.shape[1], values.device).unsqueeze(0) >= lengths.unsqueeze(1)
    magnitude.masked_fill_(padding, -1.0)
    return _ranked_bits(values, magnitude, topk)


def _injective_moduli(indices: torch.Tensor) -> torch.Tensor:
    """Largest m <= PRIME per row such that the row's indices are pairwise distinct mod m.

    Candidates are tried in descending blocks (first 65497 alone, since almost every row stops
    there), each block tested for all still-open rows at once by sorting the residues; blocks
    shrink so that one block's residues stay within _MAX_SEARCH_ELEMENTS.
    """
    batch, k = indices.shape
    device = indices.device
    moduli = torch.zeros(batch, dtype=torch.int64, device=device)
    open_rows = torch.arange(batch, device=device)
    top = PRIME
    block_sizes = list(_FIRST_BLOCKS)
    while open_rows.numel() and top >= 1:
        wanted = block_sizes.pop(0) if block_sizes else _BLOCK
        size = min(wanted, top, max(1, _MAX_SEARCH_ELEMENTS // (open_rows.numel() * k)))
        candidates = torch.arange(top, top - size, -1, dtype=torch.int64, device=device)
        found, chosen = _first_injective(indices[open_rows], candidates)
        moduli[open_rows[found]] = chosen[found]
        open_rows = open_rows[~found]
        top -= size
    if open_rows.numel():
        raise ValueError("no injective modulus <= 65497 exists for these top-k indices")
    return moduli


def _first_injective(indices: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `indices` [B, k]: whether some candidate modulus keeps the row's indices
    pairwise distinct, and the first such candidate (in `candidates`' order; meaningless where
    none does). Residues under every candidate are sorted at once: fixed shapes, no wait."""
    residues = indices.unsqueeze(1) % candidates.view(1, -1, 1)
    ordered = residues.sort(dim=2).values
    injective = (ordered[..., 1:] != ordered[..., :-1]).all(dim=2)
    return injective.any(dim=1), candidates[injective.to(torch.int8).argmax(dim=1)]


_LAGRANGE_MAX_ELEMENTS = 2**24
"""Batch slice of the matrix path: at most this many [k, k] power-table entries at once."""


def _pack(moduli: torch.Tensor | np.ndarray, coeffs: torch.Tensor | np.ndarray) -> list[bytes]:
    """toploc's byte layout: u16 big-endian modulus, then the coefficients (CPU integer inputs).
    Every proof is checked here, in one pass over the job, as the fingerprint decoder checks an
    untrusted one (a modulus in [k, PRIME], coefficients below PRIME): the server's own
    fingerprints are then encoded without re-reading each proof in Python. In numpy: a job's
    handful of whole-array operations cost the serving thread a few microseconds each, where
    torch's CPU dispatch costs several times that."""
    moduli, coeffs = np.asarray(moduli), np.asarray(coeffs)
    batch, k = coeffs.shape
    if batch and not (k <= moduli.min() and moduli.max() <= PRIME and 0 <= coeffs.min() and coeffs.max() < PRIME):
        raise ValueError("a proof came out with a modulus or a coefficient out of range")
    words = np.empty((batch, 1 + k), dtype=">u2")
    words[:, 0] = moduli
    words[:, 1:] = coeffs
    raw = words.tobytes()
    width = proof_num_bytes(k)
    return [raw[row * width : (row + 1) * width] for row in range(batch)]


def proofs_from_selection(indices: torch.Tensor, value_bits: torch.Tensor) -> list[bytes]:
    """Proofs of a trusted top-k selection (``select_topk``'s output) on its own device: on a GPU
    the modulus search and the interpolation run there, and only the coefficients come back; on
    the CPU the Newton form in numpy is the faster one."""
    if indices.device.type == "cpu":
        return _interpolate_checked(indices, value_bits, check=False)
    return _matrix_proofs(indices, value_bits)


def _matrix_proofs(indices: torch.Tensor, value_bits: torch.Tensor) -> list[bytes]:
    """Proofs through ``lagrange_coefficients`` on the inputs' device (any device)."""
    batch, k = indices.shape
    if batch == 0:
        return []
    x = indices.to(torch.int64)
    moduli = _injective_moduli(x)
    residues = x % moduli.unsqueeze(1)
    values = value_bits.to(torch.int64) % PRIME
    rows = max(1, _LAGRANGE_MAX_ELEMENTS // (k * k))
    coeffs = torch.cat([lagrange_coefficients(residues[i : i + rows], values[i : i + rows])
                        for i in range(0, batch, rows)])
    return _pack(moduli.cpu(), coeffs.cpu())


FIXED_CANDIDATES = 17
"""Moduli tried by `proof_words` (65497 down to 65481): a chunk whose top-k indices collide under
all of them is proven on the host instead (`proofs_from_words`); with 128 indices below 2**22
a collision under one candidate takes two indices exactly m apart, so this is very rare."""


def proof_words(chunks: torch.Tensor, rows: torch.Tensor, topk: int) -> torch.Tensor:
    """Proofs of padded chunks as int64 words, in a fixed sequence of tensor ops that never waits
    on the device (no data-dependent shapes), so one CUDA graph can replay it.

    ``chunks`` [B, R, H]: chunk b is its first ``rows[b]`` rows ([B] int64, 1..R; the rest is
    padding, ranked below every real |x|, so flat indices are those of the chunk alone). Returns
    [B, 1 + 3k]: the injective modulus (0 where none of the FIXED_CANDIDATES fits), the k
    coefficients, then the top-k indices and bf16 bit patterns that `proofs_from_words` needs
    for such a row."""
    flat = chunks.reshape(chunks.shape[0], -1).to(torch.bfloat16)
    indices, bits = _ranked_bits_within(flat, rows * chunks.shape[-1], topk)
    found, chosen = _first_injective(indices, PRIME - _positions(FIXED_CANDIDATES, flat.device))
    moduli = torch.where(found, chosen, 0)
    usable = torch.where(moduli > 0, moduli, PRIME)
    coeffs = lagrange_coefficients(indices % usable.unsqueeze(1), bits.to(torch.int64) % PRIME)
    return torch.cat([moduli.unsqueeze(1), coeffs, indices, bits.to(torch.int64)], dim=1)


def proofs_from_words(words: torch.Tensor, topk: int) -> list[bytes]:
    """toploc proofs from `proof_words` output on the host; a row without a fixed-candidate
    modulus is proven here from its indices and values, with the full modulus search."""
    host = words.numpy()
    moduli, coeffs = host[:, 0], host[:, 1 : 1 + topk]
    missing = np.flatnonzero(moduli == 0)
    if missing.size:
        moduli, coeffs = moduli.copy(), coeffs.copy()  # `words` may be a buffer its prover reuses
        indices = torch.from_numpy(host[missing, 1 + topk : 1 + 2 * topk])
        bits = torch.from_numpy(host[missing, 1 + 2 * topk :])
        found = _injective_moduli(indices)
        moduli[missing] = found.numpy()
        coeffs[missing] = newton_coefficients(indices % found.unsqueeze(1), bits % PRIME).numpy()
    return _pack(moduli, coeffs)


def interpolate(indices: torch.Tensor, value_bits: torch.Tensor) -> list[bytes]:
    """Serialised toploc proofs for rows of top-k flat indices and their bf16 bit patterns.

    ``indices`` [B, k] (distinct non-negative per row, < 2**31) and ``value_bits`` [B, k]
    (0..65535) on the CPU. Returns B byte strings of 2 + 2k bytes in toploc's layout.
    """
    if indices.dim() != 2 or indices.shape != value_bits.shape:
        raise ValueError(
            f"indices and value_bits must be equal 2-D shapes, got {tuple(indices.shape)} "
            f"and {tuple(value_bits.shape)}"
        )
    return _interpolate_checked(indices, value_bits, check=True)


def _interpolate_checked(indices: torch.Tensor, value_bits: torch.Tensor, check: bool) -> list[bytes]:
    batch, k = indices.shape
    if batch == 0:
        return []
    if k == 0:
        raise ValueError("topk must be at least 1")
    x = indices.to("cpu", torch.int64)
    y = value_bits.to("cpu", torch.int64)
    if check:
        if int(x.min()) < 0 or int(x.max()) > MAX_FLAT_INDEX:
            raise ValueError(f"flat indices must lie in 0..{MAX_FLAT_INDEX}")
        if int(y.min()) < 0 or int(y.max()) > 0xFFFF:
            raise ValueError("value_bits must be 16-bit patterns in 0..65535")
        ordered = x.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise ValueError("indices must be distinct within each row")
    moduli = _injective_moduli(x)
    return _pack(moduli, newton_coefficients(x % moduli.unsqueeze(1), y % PRIME))


def build_chunk_proofs(chunks: Sequence[torch.Tensor] | torch.Tensor, topk: int,
                       ragged: bool | None = None) -> list[bytes]:
    """toploc proofs for chunks of activation rows, one proof per chunk, in input order.

    ``chunks`` is a list of [r_i, H] tensors or one [B, R, H] tensor; each proof equals
    ``toploc.build_proofs_bytes(chunk, decode_batching_size=r_i, topk=topk, skip_prefill=True)``.
    Chunks with the same element count share one ``select_topk`` call on their device; with
    ``ragged`` (the default on accelerators) all chunks of a device share one
    ``select_topk_ragged`` call. The CPU keeps the per-size calls: there they cost per element,
    not per call, and ties in |x| are broken exactly as toploc's CPU top-k breaks them.
    """
    if isinstance(chunks, torch.Tensor):
        if chunks.dim() < 2:
            raise ValueError(f"a chunk batch tensor needs at least 2 dims, got {chunks.shape}")
        if chunks.shape[0] == 0:
            return []
        flat = chunks.reshape(chunks.shape[0], -1)
        if flat.shape[1] < topk:
            raise ValueError(f"each chunk has {flat.shape[1]} elements, fewer than topk={topk}")
        if flat.shape[1] - 1 > MAX_FLAT_INDEX:
            raise ValueError("chunks have more than 2**31 elements")
        return proofs_from_selection(*select_topk(flat, topk))
    chunk_list = list(chunks)
    groups: dict[tuple[int, torch.device], list[int]] = defaultdict(list)
    for position, chunk in enumerate(chunk_list):
        if chunk.numel() < topk:
            raise ValueError(
                f"chunk {position} has {chunk.numel()} elements, fewer than topk={topk}"
            )
        if chunk.numel() - 1 > MAX_FLAT_INDEX:
            raise ValueError(f"chunk {position} has more than 2**31 elements")
        one_call = ragged if ragged is not None else chunk.device.type != "cpu"
        groups[(0 if one_call else chunk.numel(), chunk.device)].append(position)
    proofs: list[bytes] = [b""] * len(chunk_list)
    for (size, _), positions in groups.items():
        if size == 0:
            selection = select_topk_ragged([chunk_list[p] for p in positions], topk)
        else:
            selection = select_topk(torch.stack([chunk_list[p].reshape(-1) for p in positions]), topk)
        for position, proof in zip(positions, proofs_from_selection(*selection)):
            proofs[position] = proof
    return proofs
