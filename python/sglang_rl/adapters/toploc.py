"""Scheduler side of TOPLOC: per-request fingerprint builders and verification of prefills.

Generation: the row that sampled output token j (the lm_head input of that step) is appended to
the request's builder; every full chunk of 32 rows goes to a background thread that builds the
toploc proofs for all chunks completed in that step at once, so the scheduler loop never waits on
top-k or interpolation. When the request finishes, the last partial chunk is added and the
fingerprint (all proofs, one container string) is posted to the response.

Verification: a prefill-only request carrying a fingerprint captures its prefill rows (FULL mode
for that request only); once its prefill is done, rows [L-1, L-1+n) - the rows that produced the
n response tokens - are checked against the proofs with toploc's verifier.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from sglang_rl.adapters import transport
from sglang_rl.fingerprint import (
    Fingerprint,
    FingerprintError,
    Thresholds,
    build_chunk_proofs,
    decode_fingerprint,
    encode_fingerprint,
    verify_rows,
)
from sglang_rl.request_options import RESPONSE_START_KEY

logger = logging.getLogger(__name__)

CHUNK_ROWS = 32
FINGERPRINTS_FIELD = "toploc_verification_fingerprints"
RESULT_FIELD = "toploc_verification_fingerprint_validation_result"

_executor: Optional[ThreadPoolExecutor] = None


def _proof_executor() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-rl-toploc")
    return _executor


def thresholds_from_server_args(server_args: Any) -> Thresholds:
    """The pass/fail bounds configured by the --toploc-verification-* flags."""
    base = Thresholds.for_topk(
        server_args.toploc_verification_topk,
        mant_err_mean=server_args.toploc_verification_max_mant_err_mean,
        mant_err_median=server_args.toploc_verification_max_mant_err_median,
    )
    if server_args.toploc_verification_max_exp_mismatches is None:
        return base
    return Thresholds(
        max_exp_mismatches=server_args.toploc_verification_max_exp_mismatches,
        max_mant_err_mean=base.max_mant_err_mean,
        max_mant_err_median=base.max_mant_err_median,
    )


class RowStore:
    """CPU chunk buffers of all generating requests in one tensor [slots, 32, H] (bf16), so that a
    scheduler step writes every request's row with a single indexed copy."""

    def __init__(self) -> None:
        self.data: Optional[torch.Tensor] = None
        self._free: list[int] = []

    def acquire(self, hidden_size: int) -> int:
        if self.data is None:
            self.data = torch.empty(64, CHUNK_ROWS, hidden_size, dtype=torch.bfloat16)
            self._free = list(range(63, -1, -1))
        if not self._free:
            old = self.data.shape[0]
            grown = torch.empty(2 * old, CHUNK_ROWS, hidden_size, dtype=torch.bfloat16)
            grown[:old].copy_(self.data)
            self.data = grown
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


_store = RowStore()


class FingerprintBuilder:
    """Rows of one generating request, turned into proofs chunk by chunk."""

    def __init__(self, topk: int) -> None:
        self.topk = topk
        self.rows_seen = 0
        self.slot: Optional[int] = None
        self.fill = 0
        self._proofs: list[tuple[Future, int]] = []
        self.done = False

    def attach(self, future: Future, index: int) -> None:
        """Record where the proof of this builder's next full chunk will come from."""
        self._proofs.append((future, index))

    def partial_chunk(self) -> Optional[torch.Tensor]:
        """A copy of the rows of the unfinished chunk (None if it is empty)."""
        if not self.fill:
            return None
        return _store.data[self.slot, : self.fill].clone()

    def finish(self, last_proof: Optional[bytes]) -> str:
        """Wait for pending proofs and return the fingerprint string; frees the row slot."""
        self.done = True
        proofs = [future.result()[index] for future, index in self._proofs]
        if last_proof is not None:
            proofs.append(last_proof)
        if self.slot is not None:
            _store.release(self.slot)
            self.slot = None
        fp = Fingerprint(topk=self.topk, chunk_size=CHUNK_ROWS, n_rows=self.rows_seen, proofs=tuple(proofs))
        return encode_fingerprint(fp)


def add_builder_rows(builders: list[FingerprintBuilder], rows: torch.Tensor, topk: int) -> None:
    """Append one row per builder (rows [m, H], CPU) with one indexed write; full chunks are
    copied out and their proofs built in one background job."""
    if not builders:
        return
    hidden = rows.shape[-1]
    for b in builders:
        if b.slot is None:
            b.slot = _store.acquire(hidden)
    slots = [b.slot for b in builders]
    fills = [b.fill for b in builders]
    _store.data[slots, fills] = rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16)
    full = []
    for b in builders:
        b.fill += 1
        b.rows_seen += 1
        if b.fill == CHUNK_ROWS:
            full.append(b)
            b.fill = 0
    if full:
        chunks = _store.data[[b.slot for b in full]].clone()
        future = _proof_executor().submit(build_chunk_proofs, chunks, topk)
        for index, b in enumerate(full):
            b.attach(future, index)


def finish_builders(items: list[tuple[FingerprintBuilder, Any]]) -> None:
    """Finalise the fingerprints of requests finishing in one output batch: their last partial
    chunks are proven together, then each fingerprint is posted to its response."""
    if not items:
        return
    partials = [(b, b.partial_chunk()) for b, _ in items]
    chunks = [c for _, c in partials if c is not None]
    built = iter(build_chunk_proofs(chunks, items[0][0].topk) if chunks else [])
    for (builder, req), (_, chunk) in zip(items, partials):
        last = next(built) if chunk is not None else None
        transport.post(req, **{FINGERPRINTS_FIELD: [builder.finish(last)]})


class PrefillVerification:
    """A prefill-only request that validates a fingerprint against its own prefill rows."""

    def __init__(self, fingerprint: Fingerprint, response_start: int, thresholds: Thresholds) -> None:
        self.fingerprint = fingerprint
        self.response_start = response_start
        self.thresholds = thresholds
        self.rows: list[torch.Tensor] = []
        self.done = False

    def add_rows(self, rows: torch.Tensor) -> None:
        self.rows.append(rows.to("cpu", copy=True))

    def finish(self, prompt_len: int) -> dict:
        """Verify the captured rows; returns the report dict posted to the response."""
        self.done = True
        n = self.fingerprint.n_rows
        start = self.response_start if self.response_start >= 0 else prompt_len - n
        captured = torch.cat(self.rows) if self.rows else torch.empty(0)
        self.rows = []
        first_captured = prompt_len - captured.shape[0]
        lo, hi = start - 1, start - 1 + n
        if start < 1 or hi > prompt_len:
            raise FingerprintError(
                f"the fingerprint covers {n} response tokens starting at position {start}, which does "
                f"not fit a prefill of {prompt_len} tokens"
            )
        if lo < first_captured:
            raise FingerprintError("the prefill rows of the response were not computed (prefix cache)")
        rows = captured[lo - first_captured : hi - first_captured]
        report = verify_rows(rows, self.fingerprint, self.thresholds).to_dict()
        report["response_start"] = start
        report["response_tokens"] = n
        return report


def state_for_request(options: dict, server_args: Any) -> Optional[object]:
    """The TOPLOC state a new scheduler request needs, or None."""
    if not getattr(server_args, "toploc_verification", False):
        return None
    topk = server_args.toploc_verification_topk
    fp_string = options.get("toploc_verification_fingerprint_to_validate")
    if fp_string is None:
        return FingerprintBuilder(topk)
    try:
        fp = decode_fingerprint(fp_string, expected_topk=topk)
    except FingerprintError as exc:
        return RejectedVerification(str(exc))
    start = int(options.get(RESPONSE_START_KEY, -1))
    return PrefillVerification(fp, start, thresholds_from_server_args(server_args))


class RejectedVerification:
    """A verification request whose fingerprint failed validation (normally refused earlier)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.done = False


def finish_verification(state: object, req: Any) -> None:
    """Post a finished verification request's report (called as its output is sent)."""
    if getattr(state, "done", True) or not req.finished():
        return
    if isinstance(state, PrefillVerification):
        try:
            report = state.finish(len(req.origin_input_ids))
        except FingerprintError as exc:
            report = {"error": str(exc), "verified": False}
        transport.post(req, **{RESULT_FIELD: report})
    elif isinstance(state, RejectedVerification):
        state.done = True
        transport.post(req, **{RESULT_FIELD: {"error": state.reason, "verified": False}})
