"""Verification of a fingerprint against recomputed activation rows, through toploc's C++ path.

Only toploc's C++ verifier (2-D tensor with ``skip_prefill=True``) reduces the verifier's top-k
indices by each proof's modulus; its Python path does not, and fails honest proofs whose modulus
search went below 65497. The C++ path in turn crashes the process on malformed proofs or on
chunks with fewer than topk elements, which ``Fingerprint`` and ``verify_rows`` rule out first.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sglang_rl.fingerprint.codec import Fingerprint, FingerprintError
from sglang_rl_client.calibration import REFERENCE_TOPK, Thresholds  # noqa: F401 - shared with the client

NOTHING_MATCHED = float(2**64)
"""toploc's mantissa error when no top-k exponent matched (finite, so JSON can carry it)."""


@dataclass(frozen=True)
class ChunkResult:
    """toploc's verdict on one chunk: lower is closer to the proof."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float

    def within(self, thresholds: Thresholds) -> bool:
        """Whether this chunk satisfies all three bounds."""
        return (
            self.exp_mismatches <= thresholds.max_exp_mismatches
            and self.mant_err_mean <= thresholds.max_mant_err_mean
            and self.mant_err_median <= thresholds.max_mant_err_median
        )


@dataclass(frozen=True)
class VerificationReport:
    """Per-chunk results, the worst value of each statistic and the overall verdict."""

    chunks: tuple[ChunkResult, ...]
    thresholds: Thresholds
    worst_exp_mismatches: int
    worst_mant_err_mean: float
    worst_mant_err_median: float
    verified: bool
    short_chunk_thresholds: Thresholds | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (plain ints, floats and bools; every float finite). The short-chunk
        bounds appear only when they were given."""
        extra = {}
        if self.short_chunk_thresholds is not None:
            extra["short_chunk_thresholds"] = asdict(self.short_chunk_thresholds)
        return {
            "verified": self.verified,
            "num_chunks": len(self.chunks),
            "worst_exp_mismatches": self.worst_exp_mismatches,
            "worst_mant_err_mean": self.worst_mant_err_mean,
            "worst_mant_err_median": self.worst_mant_err_median,
            "thresholds": asdict(self.thresholds),
            "chunks": [asdict(chunk) for chunk in self.chunks],
            **extra,
        }


def _finite(value: float) -> float:
    """The value as a float, with NaN or infinity replaced by the nothing-matched sentinel."""
    value = float(value)
    return value if math.isfinite(value) else NOTHING_MATCHED


def verify_rows(
    rows: torch.Tensor,
    fp: Fingerprint,
    thresholds: Thresholds | None = None,
    short_chunk_thresholds: Thresholds | None = None,
) -> VerificationReport:
    """Check recomputed activation rows [n_rows, H] against a decoded fingerprint.

    Rows are rounded to bf16 (proof values are bf16) and moved to the CPU. Raises
    FingerprintError when the rows do not fit the fingerprint (row count, or a chunk smaller than
    topk). ``thresholds`` defaults to ``Thresholds.for_topk(fp.topk)``; ``short_chunk_thresholds``
    (e.g. from a calibration file) replace them for a final chunk of fewer than chunk_size rows.
    """
    import toploc

    if thresholds is None:
        thresholds = Thresholds.for_topk(fp.topk)
    if rows.dim() != 2:
        raise FingerprintError(f"rows must be a 2-D [n_rows, hidden] tensor, got {rows.shape}")
    n_rows, hidden = rows.shape
    if n_rows != fp.n_rows:
        raise FingerprintError(f"fingerprint covers {fp.n_rows} rows, got {n_rows} rows to verify")
    smallest_rows = min(n_rows - (fp.num_chunks - 1) * fp.chunk_size, fp.chunk_size)
    if smallest_rows * hidden < fp.topk:
        raise FingerprintError(
            f"a chunk of {smallest_rows} rows x {hidden} holds {smallest_rows * hidden} elements, "
            f"fewer than topk={fp.topk}"
        )
    data = rows.detach().to(dtype=torch.bfloat16).to("cpu").contiguous()
    results = toploc.verify_proofs_bytes(
        data,
        list(fp.proofs),
        decode_batching_size=fp.chunk_size,
        topk=fp.topk,
        skip_prefill=True,
    )
    chunks = tuple(
        ChunkResult(
            exp_mismatches=int(result.exp_mismatches),
            mant_err_mean=_finite(result.mant_err_mean),
            mant_err_median=_finite(result.mant_err_median),
        )
        for result in results
    )
    if len(chunks) != fp.num_chunks:
        raise FingerprintError(f"toploc returned {len(chunks)} results for {fp.num_chunks} proofs")
    bounds = [thresholds] * len(chunks)
    if short_chunk_thresholds is not None and n_rows % fp.chunk_size:
        bounds[-1] = short_chunk_thresholds
    return VerificationReport(
        chunks=chunks,
        thresholds=thresholds,
        worst_exp_mismatches=max(chunk.exp_mismatches for chunk in chunks),
        worst_mant_err_mean=max(chunk.mant_err_mean for chunk in chunks),
        worst_mant_err_median=max(chunk.mant_err_median for chunk in chunks),
        verified=all(chunk.within(bound) for chunk, bound in zip(chunks, bounds)),
        short_chunk_thresholds=short_chunk_thresholds,
    )
