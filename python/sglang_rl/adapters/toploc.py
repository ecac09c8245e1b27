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


class FingerprintBuilder:
    """Rows of one generating request, turned into proofs chunk by chunk."""

    def __init__(self, topk: int) -> None:
        self.topk = topk
        self.rows_seen = 0
        self._buffer: Optional[torch.Tensor] = None
        self._fill = 0
        self._proofs: list[tuple[Future, int]] = []
        self.done = False

    def add_rows(self, rows: torch.Tensor, ready: list[torch.Tensor]) -> None:
        """Append rows [m, H]; full chunks are appended to `ready` and owned by the caller."""
        for row in rows:
            if self._buffer is None:
                self._buffer = torch.empty(CHUNK_ROWS, row.shape[-1], dtype=torch.bfloat16)
            self._buffer[self._fill].copy_(row)
            self._fill += 1
            self.rows_seen += 1
            if self._fill == CHUNK_ROWS:
                ready.append(self._buffer)
                self._buffer = None
                self._fill = 0

    def attach(self, future: Future, index: int) -> None:
        """Record where the proof of this builder's next full chunk will come from."""
        self._proofs.append((future, index))

    def finish(self) -> str:
        """Build the last partial chunk, wait for pending proofs, return the fingerprint string."""
        self.done = True
        proofs = [future.result()[index] for future, index in self._proofs]
        if self._fill:
            proofs.extend(build_chunk_proofs([self._buffer[: self._fill]], self.topk))
        self._buffer = None
        fp = Fingerprint(topk=self.topk, chunk_size=CHUNK_ROWS, n_rows=self.rows_seen, proofs=tuple(proofs))
        return encode_fingerprint(fp)


def submit_chunks(owners: list[FingerprintBuilder], chunks: list[torch.Tensor], topk: int) -> None:
    """Build the proofs of all chunks completed in one scheduler step in one background job."""
    if not chunks:
        return
    future = _proof_executor().submit(build_chunk_proofs, chunks, topk)
    for index, owner in enumerate(owners):
        owner.attach(future, index)


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


def finish_request(state: object, req: Any) -> None:
    """Post the request's fingerprint or verification report (called as its output is sent)."""
    if getattr(state, "done", True) or not req.finished():
        return
    if isinstance(state, FingerprintBuilder):
        transport.post(req, **{FINGERPRINTS_FIELD: [state.finish()]})
    elif isinstance(state, PrefillVerification):
        try:
            report = state.finish(len(req.origin_input_ids))
        except FingerprintError as exc:
            report = {"error": str(exc), "verified": False}
        transport.post(req, **{RESULT_FIELD: report})
    elif isinstance(state, RejectedVerification):
        state.done = True
        transport.post(req, **{RESULT_FIELD: {"error": state.reason, "verified": False}})
