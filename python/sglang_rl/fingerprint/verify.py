"""Verification of a fingerprint against recomputed activation rows, through toploc's C++ path.

Only toploc's C++ verifier (2-D tensor with ``skip_prefill=True``) reduces the verifier's top-k
indices by each proof's modulus; its Python path does not, and fails honest proofs whose modulus
search went below 65497. The C++ path in turn crashes the process on malformed proofs or on
chunks with fewer than topk elements, which ``Fingerprint`` and ``verify_rows`` rule out first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sglang_rl.fingerprint.codec import Fingerprint, FingerprintError
from sglang_rl_client.bands import FAIL, PASS, SUSPECT
from sglang_rl_client.calibration import FAIL_FACTOR, REFERENCE_TOPK, Thresholds, scaled  # noqa: F401 - shared

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

    def excess(self, thresholds: Thresholds) -> tuple[str, float, float] | None:
        """The first statistic above its bound, as (name, value, bound), or None."""
        for name, bound in (("exp_mismatches", thresholds.max_exp_mismatches),
                            ("mant_err_mean", thresholds.max_mant_err_mean),
                            ("mant_err_median", thresholds.max_mant_err_median)):
            if getattr(self, name) > bound:
                return name, getattr(self, name), bound
        return None


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
    fail_factor: float = FAIL_FACTOR
    verdict: str = PASS
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (plain ints, floats and bools; every float finite). The short-chunk
        bounds appear only when they were given."""
        extra: dict[str, Any] = {}
        if self.short_chunk_thresholds is not None:
            extra["short_chunk_thresholds"] = asdict(self.short_chunk_thresholds)
            extra["short_chunk_fail_thresholds"] = asdict(scaled(self.short_chunk_thresholds, self.fail_factor))
        if self.reason is not None:
            extra["fingerprint_reason"] = self.reason
        return {
            "verified": self.verified,
            "num_chunks": len(self.chunks),
            "worst_exp_mismatches": self.worst_exp_mismatches,
            "worst_mant_err_mean": self.worst_mant_err_mean,
            "worst_mant_err_median": self.worst_mant_err_median,
            "thresholds": asdict(self.thresholds),
            "chunks": [asdict(chunk) for chunk in self.chunks],
            "fingerprint_verdict": self.verdict,
            "fail_thresholds": asdict(scaled(self.thresholds, self.fail_factor)),
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
    fail_factor: float = FAIL_FACTOR,
) -> VerificationReport:
    """Check recomputed activation rows [n_rows, H] against a decoded fingerprint.

    Rows are rounded to bf16 (proof values are bf16) and moved to the CPU. Raises
    FingerprintError when the rows do not fit the fingerprint (row count, or a chunk smaller than
    topk). ``thresholds`` defaults to ``Thresholds.for_topk(fp.topk)``; ``short_chunk_thresholds``
    (e.g. from a calibration file) replace them for a final chunk of fewer than chunk_size rows.
    The band: pass within the bounds, fail beyond ``fail_factor`` times them, suspect between.
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
    return report_from_chunks(chunks, fp, thresholds, short_chunk_thresholds, fail_factor)


def report_from_chunks(chunks: Sequence[ChunkResult], fp: Fingerprint, thresholds: Thresholds | None = None,
                       short_chunk_thresholds: Thresholds | None = None,
                       fail_factor: float = FAIL_FACTOR) -> VerificationReport:
    """The verification report of one fingerprint from its chunks' statistics (`verify_rows`'s
    bounds and bands)."""
    if thresholds is None:
        thresholds = Thresholds.for_topk(fp.topk)
    chunks = tuple(chunks)
    bounds = [thresholds] * len(chunks)
    if short_chunk_thresholds is not None and fp.n_rows % fp.chunk_size:
        bounds[-1] = short_chunk_thresholds
    verdict, reason = fingerprint_band(chunks, bounds, fail_factor)
    return VerificationReport(
        chunks=chunks,
        thresholds=thresholds,
        worst_exp_mismatches=max(chunk.exp_mismatches for chunk in chunks),
        worst_mant_err_mean=max(chunk.mant_err_mean for chunk in chunks),
        worst_mant_err_median=max(chunk.mant_err_median for chunk in chunks),
        verified=all(chunk.within(bound) for chunk, bound in zip(chunks, bounds)),
        short_chunk_thresholds=short_chunk_thresholds,
        fail_factor=fail_factor,
        verdict=verdict,
        reason=reason,
    )


def fingerprint_band(chunks: Sequence[ChunkResult], bounds: Sequence[Thresholds],
                     fail_factor: float) -> tuple[str, str | None]:
    """The band of a fingerprint from its chunks and their pass bounds, and why (the first chunk
    of the worst band: its statistic, value and bound); None when it passes."""
    band, reason = PASS, None
    for index, (chunk, bound) in enumerate(zip(chunks, bounds)):
        over = chunk.excess(scaled(bound, fail_factor))
        if over is not None:
            name, value, limit = over
            return FAIL, f"chunk {index}: {name} {value:g} above the fail bound {limit:g}"
        over = chunk.excess(bound)
        if over is not None and band == PASS:
            name, value, limit = over
            band, reason = SUSPECT, f"chunk {index}: {name} {value:g} above the pass bound {limit:g}"
    return band, reason
