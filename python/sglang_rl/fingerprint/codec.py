"""The fingerprint container: TOPLOC proofs of a sequence's activation rows, as one string.

The format, its strict decoder and the conversion to and from toploc's proof lists are pure
Python and live in the client package (``sglang_rl_client.fingerprint``), which operators install
without torch; this module re-exports them and adds what needs torch or toploc: building a
fingerprint from activation rows, and reading toploc's ``ProofPoly`` objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sglang_rl.fingerprint.proof import build_chunk_proofs
from sglang_rl_client.fingerprint import (  # noqa: F401 - the plugin's names for the shared format
    DEFAULT_CHUNK_SIZE,
    DEFAULT_TOPK,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_CHUNK_SIZE,
    MAX_ROWS,
    MAX_TOPK,
    Fingerprint,
    FingerprintError,
    decode_fingerprint,
    encode_built_proofs,
    encode_fingerprint,
    to_toploc_proofs,
)
from sglang_rl_client.fingerprint import from_toploc_proofs as _from_toploc_serialised


def from_toploc_proofs(
    proofs: Sequence[Any], n_rows: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Fingerprint:
    """A fingerprint from toploc's proofs of a response's rows, built with ``skip_prefill=True``
    and ``decode_batching_size=chunk_size``: what ``toploc.build_proofs`` (``ProofPoly``
    objects), ``build_proofs_bytes`` or ``build_proofs_base64`` returned. ``n_rows``: the rows
    (tokens) they cover."""
    if isinstance(proofs, Sequence) and not isinstance(proofs, (str, bytes)):
        proofs = [p.to_bytes() if hasattr(p, "to_bytes") else p for p in proofs]
    return _from_toploc_serialised(proofs, n_rows, chunk_size)


def build_fingerprint(
    rows: torch.Tensor, topk: int = DEFAULT_TOPK, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Fingerprint:
    """Fingerprint the activation rows [n_rows, H] of one sequence, chunk_size rows per proof."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be a 2-D [n_rows, hidden] tensor, got {tuple(rows.shape)}")
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}, got {chunk_size}")
    proofs = build_chunk_proofs(list(rows.split(chunk_size)), topk)
    return Fingerprint(topk=topk, chunk_size=chunk_size, n_rows=rows.shape[0], proofs=tuple(proofs))
