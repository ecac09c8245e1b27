"""Fingerprint verification on the rows' own device: toploc's statistics from a few tensor ops.

toploc's C++ verifier (``verify_proofs_bytes`` with ``skip_prefill=True``) takes, per chunk of
``chunk_size`` rows, the top-k flat indices of |x| over the bf16 chunk, reduces them by the
proof's modulus, evaluates the proof polynomial over GF(65497) there and compares the result's
bf16 exponent (bits 7-14) and mantissa (bits 0-6) with the verifier's own values: exponent
mismatches are counted, and the mean and upper median (element ``count // 2`` of the sorted
errors) of the mantissa differences where exponents agree are returned, 2**64 for both when none
agrees. Here the same statistics come from batched torch ops over every chunk of several
requests at once, on whatever device holds the rows: only the proofs ([chunks, 1 + k] words) go
to the device and only [chunks, 3] statistics come back, where toploc copies every row to the
host and runs a thread pool per call.

Ties in |x| at the k-th place are broken by the device's top-k: on the CPU that is the top-k
toploc itself calls (so the statistics are toploc's exactly); a GPU's top-k may pick another of
the tied indices, which adds an exponent mismatch for each index picked differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sglang_rl.fingerprint.codec import Fingerprint, FingerprintError
from sglang_rl.fingerprint.interpolation import PRIME
from sglang_rl.fingerprint.verify import (
    FAIL_FACTOR,
    NOTHING_MATCHED,
    ChunkResult,
    Thresholds,
    VerificationReport,
    report_from_chunks,
)

_MAX_SELECT_ELEMENTS = 2**28
"""Chunk elements one top-k call covers at most (512 MiB of bf16): larger batches go in slices."""
_UNMATCHED = 1 << 20
"""Mantissa error given to an exponent mismatch so that sorting puts it after every real error."""


def to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host data on `device` without waiting there: a copy from pageable memory would first wait
    for the stream's queued work (the forward), so an accelerator gets it from pinned memory."""
    tensor = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def check_rows(rows: torch.Tensor, fp: Fingerprint) -> None:
    """Raise FingerprintError when `rows` [n, H] cannot be verified against `fp` (toploc would
    crash or verify fewer chunks): wrong shape or row count, or a chunk of fewer than topk
    elements."""
    if rows.dim() != 2:
        raise FingerprintError(f"rows must be a 2-D [n_rows, hidden] tensor, got {tuple(rows.shape)}")
    n_rows, hidden = rows.shape
    if n_rows != fp.n_rows:
        raise FingerprintError(f"fingerprint covers {fp.n_rows} rows, got {n_rows} rows to verify")
    if len(fp.proofs) != fp.num_chunks:
        raise FingerprintError(f"fingerprint holds {len(fp.proofs)} proofs for {fp.num_chunks} chunks")
    smallest = min(n_rows - (fp.num_chunks - 1) * fp.chunk_size, fp.chunk_size)
    if smallest * hidden < fp.topk:
        raise FingerprintError(
            f"a chunk of {smallest} rows x {hidden} holds {smallest * hidden} elements, fewer than topk={fp.topk}")


def proof_words(fps: Sequence[Fingerprint], device: torch.device) -> torch.Tensor:
    """Every proof of `fps` (one topk), in order, as int64 words [chunks, 1 + k] on `device`:
    the modulus, then the coefficients in ascending degree."""
    topk = fps[0].topk
    raw = b"".join(proof for fp in fps for proof in fp.proofs)
    words = np.frombuffer(raw, dtype=">u2").astype(np.int64).reshape(-1, 1 + topk)
    return to_device(words, device)


def _chunk_views(rows: torch.Tensor, fp: Fingerprint) -> list[torch.Tensor]:
    """The request's chunks as flat bf16 rows: the full chunks as one [q, R*H] view, then the
    final short chunk, if any, as [1, r*H]."""
    data = rows.detach().to(torch.bfloat16)
    full, size = divmod(fp.n_rows, fp.chunk_size)
    parts = []
    if full:
        parts.append(data[: full * fp.chunk_size].reshape(full, -1))
    if size:
        parts.append(data[full * fp.chunk_size:].reshape(1, -1))
    return parts


def _select(flat: torch.Tensor, topk: int, lengths: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k flat indices of |x| per row of bf16 `flat` [B, N] (int64) and the bf16 bit
    patterns there (int64, 0..65535); with `lengths`, elements past lengths[b] are padding,
    ranked below every real |x|."""
    magnitude = flat.abs()
    if lengths is not None:
        positions = torch.arange(flat.shape[1], device=flat.device).unsqueeze(0)
        magnitude.masked_fill_(positions >= lengths.unsqueeze(1), -1.0)
    indices = magnitude.topk(topk, dim=1).indices
    bits = flat.gather(1, indices).view(torch.int16).to(torch.int64) & 0xFFFF
    return indices, bits


def _sliced_select(flat: torch.Tensor, topk: int, lengths: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_select` in slices of at most _MAX_SELECT_ELEMENTS elements (bounded scratch memory)."""
    step = max(1, _MAX_SELECT_ELEMENTS // max(1, flat.shape[1]))
    if flat.shape[0] <= step:
        return _select(flat, topk, lengths)
    parts = [_select(flat[i: i + step], topk, None if lengths is None else lengths[i: i + step])
             for i in range(0, flat.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def select_chunks(items: Sequence[tuple[torch.Tensor, Fingerprint]], topk: int, padded: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k indices and bit patterns [chunks, k] of every chunk of every item, in order. With
    `padded` (the default on accelerators) all chunks share one call, short ones padded; else
    (the CPU's default) chunks of one element count share a call: toploc's own top-k, so its
    tie-breaking."""
    views = [view for rows, fp in items for view in _chunk_views(rows, fp)]
    device = views[0].device
    counts = [view.shape[0] for view in views]
    if padded is None:
        padded = device.type != "cpu"
    if padded and len({view.shape[1] for view in views}) > 1:
        width = max(view.shape[1] for view in views)
        flat = torch.cat([torch.nn.functional.pad(view, (0, width - view.shape[1])) for view in views])
        lengths = to_device(torch.tensor([view.shape[1] for view in views for _ in range(view.shape[0])],
                                         dtype=torch.int64), device)
        return _sliced_select(flat, topk, lengths)
    groups: dict[int, list[int]] = {}
    for position, view in enumerate(views):
        groups.setdefault(view.shape[1], []).append(position)
    starts = np.concatenate([[0], np.cumsum(counts)])
    indices = torch.empty(int(starts[-1]), topk, dtype=torch.int64, device=device)
    bits = torch.empty_like(indices)
    for positions in groups.values():
        picked = _sliced_select(torch.cat([views[p] for p in positions]), topk)
        rows = to_device(torch.cat([torch.arange(starts[p], starts[p + 1]) for p in positions]), device)
        indices[rows], bits[rows] = picked
    return indices, bits


def evaluate(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Polynomials [B, k] (ascending degree, entries < PRIME) at points [B, m] (< PRIME), mod
    PRIME, by Horner's rule: every intermediate stays below 2**33."""
    y = coeffs[:, -1:].expand_as(x).clone()
    for degree in range(coeffs.shape[1] - 2, -1, -1):
        y.mul_(x).add_(coeffs[:, degree: degree + 1]).remainder_(PRIME)
    return y


def chunk_statistics(indices: torch.Tensor, bits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """toploc's statistics per chunk as float64 [chunks, 3]: exponent mismatches, mantissa error
    mean and median (2**64 both when no exponent matched). `indices`, `bits`: the verifier's
    top-k [chunks, k]; `words`: the proofs (`proof_words`)."""
    moduli, coeffs = words[:, :1], words[:, 1:]
    claimed = evaluate(coeffs, indices % moduli)
    mismatch = ((claimed >> 7) & 0xFF) != ((bits >> 7) & 0xFF)
    errors = ((claimed & 0x7F) - (bits & 0x7F)).abs().masked_fill_(mismatch, _UNMATCHED)
    matched = (~mismatch).sum(dim=1)
    ordered = errors.sort(dim=1).values
    total = ordered.masked_fill(ordered == _UNMATCHED, 0).sum(dim=1)
    median = ordered.gather(1, (matched // 2).unsqueeze(1)).squeeze(1)
    none = matched == 0
    mean = torch.where(none, NOTHING_MATCHED, total.double() / matched.clamp(min=1).double())
    median = torch.where(none, NOTHING_MATCHED, median.double())
    return torch.stack([mismatch.sum(dim=1).double(), mean, median], dim=1)


@dataclass
class PendingStatistics:
    """Per-chunk statistics of a batch, still on their device (copied to pinned host memory
    without waiting, where the device allows); `results` waits for them."""

    stats: torch.Tensor
    chunk_counts: list[int]
    ready: torch.cuda.Event | None = None
    _results: list | None = None

    @classmethod
    def start(cls, stats: torch.Tensor, chunk_counts: list[int]) -> "PendingStatistics":
        if stats.device.type != "cuda":
            return cls(stats.cpu(), chunk_counts)
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        host.copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, chunk_counts, event)

    def done(self) -> bool:
        """Whether `results` would return without waiting."""
        return self.ready is None or self.ready.query()

    def results(self) -> list[tuple[ChunkResult, ...]]:
        """Per item, its chunks' toploc statistics (read once; later calls return the same)."""
        if self._results is not None:
            return self._results
        if self.ready is not None:
            self.ready.synchronize()
        rows = self.stats.tolist()
        out, start = [], 0
        for count in self.chunk_counts:
            out.append(tuple(ChunkResult(int(e), float(mean), float(median))
                             for e, mean, median in rows[start: start + count]))
            start += count
        self._results = out
        return out


def verify_batch(items: Sequence[tuple[torch.Tensor, Fingerprint]], padded: bool | None = None
                 ) -> PendingStatistics:
    """Start verifying several requests' response rows ([n_i, H], one device) against their
    decoded fingerprints (one topk), in one batched pass on that device (`padded`: see
    `select_chunks`). Raises FingerprintError for rows that do not fit their fingerprint."""
    if not items:
        return PendingStatistics(torch.empty(0, 3, dtype=torch.float64), [])
    topk = items[0][1].topk
    for rows, fp in items:
        check_rows(rows, fp)
        if fp.topk != topk:
            raise FingerprintError(f"one batch verifies one topk: got {fp.topk} and {topk}")
    device = items[0][0].device
    words = proof_words([fp for _, fp in items], device)
    indices, bits = select_chunks(items, topk, padded)
    return PendingStatistics.start(chunk_statistics(indices, bits, words), [fp.num_chunks for _, fp in items])


def verify_rows_on_device(rows: torch.Tensor, fp: Fingerprint, thresholds: Thresholds | None = None,
                          short_chunk_thresholds: Thresholds | None = None,
                          fail_factor: float = FAIL_FACTOR) -> VerificationReport:
    """`verify.verify_rows` computed on the rows' device (one request)."""
    (chunks,) = verify_batch([(rows, fp)]).results()
    return report_from_chunks(chunks, fp, thresholds, short_chunk_thresholds, fail_factor)
