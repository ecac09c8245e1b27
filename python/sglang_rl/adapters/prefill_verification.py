"""Scheduler side of a verification request: the prefill-only request that checks a fingerprint.

On a server whose LM head holds the whole vocabulary (tensor and pipeline parallel size 1), a
verification runs on the device, in the worker's forward hook (`check_batch`, from
`toploc.worker_forward_after`): the rows that produced the response tokens are copied, chunk by
chunk, into a buffer on the device, and once a request has all of them, the batch's complete
requests are verified together (`fingerprint.device_verify`) and their token checks computed from
the rows times the LM head (`fingerprint.device_tokens`); only statistics come back, read when
the request's output is sent. Elsewhere (and for a verification built by hand) the rows come to
the host through `add_rows` and toploc's verifier checks them; the token checks then come from
sglang's log-probs (`verification_report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sglang_rl.adapters import transport
from sglang_rl.adapters.last_layer_rows import last_layer_rows
from sglang_rl.adapters.request_state import peek
from sglang_rl.fingerprint import Fingerprint, FingerprintError, verify_rows
from sglang_rl.fingerprint.calibration import ThresholdPolicy
from sglang_rl.fingerprint.device_tokens import PendingTokenChecks, SeededRequest, TokenRequest, token_checks
from sglang_rl.fingerprint.device_verify import PendingStatistics, check_rows, verify_batch
from sglang_rl.fingerprint.verify import report_from_chunks
from sglang_rl.fingerprint.termination import termination_inputs
from sglang_rl.request_options import RESULT_FIELD
from sglang_rl.verification_report import TOKEN_CHECKS_KEY, TOKEN_LISTS_KEY



@dataclass(frozen=True)
class TokenCheckSettings:
    """What a device verification computes besides the fingerprint statistics."""

    sampled: bool = False
    seeded: Optional[SeededRequest] = None
    token_lists: bool = False


@dataclass
class DeviceChecks:
    """A scheduler's means of verifying on the device: its model's LM head (rows x head.T are
    the logits) and the sampling test's bound."""

    head: torch.Tensor
    max_z: float
    logit_scale: Optional[float] = None
    softcap: Optional[float] = None

    @classmethod
    def of_worker(cls, worker: Any, max_z: float) -> Optional["DeviceChecks"]:
        """The checks of a plain model worker (a speculative one's target worker has its own);
        None where its model has no LM head to read."""
        runner = getattr(worker, "model_runner", None)
        model = getattr(runner, "model", None)
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        if head is None or hasattr(worker, "target_worker"):
            return None
        vocab = runner.model_config.vocab_size
        processor = getattr(model, "logits_processor", None)
        return cls(head[:vocab], max_z, getattr(processor, "logit_scale", None),
                   getattr(processor, "final_logit_softcapping", None))


@dataclass
class PrefixGuard:
    """A row sink that takes no rows (`stores` False, so the hooks skip it): it keeps the radix
    cache from serving the rows a device verification needs. sglang limits the prefix only for a
    request that asks for input log-probs, which these no longer do."""

    limit: int
    stores: bool = False
    done: bool = False
    needs_prompt_rows: bool = False
    takes_captured_rows: bool = False
    wants_final_row: bool = False

    def prefix_limit(self) -> Optional[int]:
        return self.limit

    def add_prefill(self, rows: torch.Tensor, last_chunk: bool, end: Optional[int] = None) -> None:
        return None

    def add_decode(self, step: Any, start: int, count: int, position: int) -> None:
        return None


class PrefillVerification:
    """A prefill-only request that validates a fingerprint against its own prefill rows, and
    reports how the response ended (for the termination check, `fingerprint.termination`).
    One whose fingerprint could not be read (normally refused earlier) is `rejected`: it keeps no
    rows, and its report is the reason. With `device` settings it verifies on the device
    (`check_batch`); else from host rows (`add_rows`)."""

    def __init__(self, fingerprint: Optional[Fingerprint], response_start: int, thresholds: Optional[ThresholdPolicy],
                 min_eos_prob: float = 0.0, max_new_tokens: Optional[int] = None,
                 rejected: Optional[str] = None, device: Optional[TokenCheckSettings] = None,
                 token_lists: bool = False) -> None:
        self.fingerprint = fingerprint
        self.response_start = response_start
        self.thresholds = thresholds
        self.min_eos_prob = min_eos_prob
        self.max_new_tokens = max_new_tokens
        self.rejected = rejected
        self.device = device
        self.token_lists = token_lists
        self.rows: list[torch.Tensor] = []
        self.done = False
        self.error: Optional[str] = None
        self._buffer: Optional[torch.Tensor] = None  # rows of positions [start - 1, last row] on the device
        self._filled = 0
        self._pending: Optional[tuple[PendingStatistics, PendingTokenChecks, int]] = None

    @classmethod
    def rejecting(cls, reason: str) -> "PrefillVerification":
        """A verification whose fingerprint failed validation, for `reason`."""
        return cls(None, -1, None, rejected=reason)

    @property
    def capture_mode(self) -> CaptureHiddenMode:
        """Every prefill row to check (FULL); a rejected one checks none."""
        return CaptureHiddenMode.LAST if self.rejected is not None else CaptureHiddenMode.FULL

    @property
    def on_device(self) -> bool:
        """Whether the forward hook verifies this request (and `add_rows` ignores its rows)."""
        return self.device is not None and self.rejected is None

    def add_rows(self, rows: torch.Tensor) -> None:
        if self.rejected is None and self.device is None:
            self.rows.append(rows.to("cpu", copy=True))

    # ---------------------------------------------------------------- on the device

    def _span(self, prompt_len: int) -> tuple[int, int]:
        """(start, n): the first response position and the fingerprint's row count."""
        n = self.fingerprint.n_rows
        return (self.response_start if self.response_start >= 0 else prompt_len - n), n

    def prefix_guard(self, prompt_len: int) -> PrefixGuard:
        """The sink that keeps the response's rows out of the radix cache's reach."""
        start, _ = self._span(prompt_len)
        return PrefixGuard(max(start - 1, 0))

    def take(self, rows: torch.Tensor, prefix: int, prompt_len: int) -> bool:
        """Keep, from one prefill chunk's rows (positions prefix .. prefix + len - 1), those of
        positions start - 1 .. max(start - 1 + n, prompt_len) - 1 (the response's rows, and the
        last row for the next token's argmax). Returns whether every wanted row is here."""
        start, n = self._span(prompt_len)
        lo, hi = start - 1, start - 1 + n
        if self.error is not None:
            return False
        if start < 1 or hi > prompt_len:
            self.error = (f"the fingerprint covers {n} response tokens starting at position {start}, which does "
                          f"not fit a prefill of {prompt_len} tokens")
            return False
        last = prompt_len - 1  # the next token's row, after or within the response's
        wanted = n + (last >= hi)
        if self._buffer is None:
            self._buffer = torch.empty(wanted, rows.shape[1], dtype=rows.dtype, device=rows.device)
        for first, stop, into in ((lo, hi, 0), (last, last + 1, n) if last >= hi else (0, 0, 0)):
            a, b = max(first, prefix), min(stop, prefix + rows.shape[0])
            if a >= b:
                continue
            if a - first + into != self._filled:
                self.error = "the prefill rows of the response were not computed (prefix cache)"
                return False
            self._buffer[a - first + into: b - first + into] = rows[a - prefix: b - prefix]
            self._filled += b - a
        return self._filled == wanted

    def token_request(self, ids: list[int]) -> TokenRequest:
        """The token checks of the complete buffer (`ids`: the request's prompt ids)."""
        start, n = self._span(len(ids))
        targets = ids[start: min(start + n, len(ids))]
        return TokenRequest(self._buffer, targets, start, sampled=self.device.sampled, seeded=self.device.seeded,
                            token_lists=self.device.token_lists)

    def started(self, stats: PendingStatistics, tokens: PendingTokenChecks, index: int) -> None:
        self._pending = (stats, tokens, index)
        self._buffer = None

    # ---------------------------------------------------------------- the report

    def post_report(self, req: Any) -> None:
        """Post the report of a finished verification request (called as its output is sent)."""
        if self.done or not req.finished():
            return
        if self.rejected is not None:
            self.done = True
            transport.post(req, **{RESULT_FIELD: {"error": self.rejected, "verified": False}})
            return
        try:
            ids = req.origin_input_ids
            report = self.finish(len(ids), ids[-1] if len(ids) else None, lambda token: is_stop(req, token))
        except FingerprintError as exc:
            report = {"error": str(exc), "verified": False}
        transport.post(req, **{RESULT_FIELD: report})

    def finish(self, prompt_len: int, last_token: Optional[int] = None,
               is_stop: Callable[[int], bool] = lambda token: False) -> dict:
        """Verify the captured rows, or read the device's verdict; returns the report dict posted
        to the response. `last_token` is the prefill's last token, `is_stop` tells the model's
        EOS / stop ids."""
        self.done = True
        start, n = self._span(prompt_len)
        if self.device is not None:
            report = self._device_report(prompt_len)
        else:
            report = self._host_report(prompt_len, start, n)
        report["thresholds_source"] = self.thresholds.source
        report["response_start"] = start
        report["response_tokens"] = n
        report[TOKEN_LISTS_KEY] = self.token_lists
        report.update(termination_inputs(start + n == prompt_len, last_token, is_stop, self.min_eos_prob,
                                         self.max_new_tokens))
        return report

    def _device_report(self, prompt_len: int) -> dict:
        if self.error is not None:
            raise FingerprintError(self.error)
        if self._pending is None:
            raise FingerprintError("the prefill rows of the response were not computed")
        stats, tokens, index = self._pending
        self._pending = None
        policy = self.thresholds
        report = report_from_chunks(stats.results()[index], self.fingerprint, policy.full, policy.short,
                                    policy.fail_factor).to_dict()
        report[TOKEN_CHECKS_KEY] = tokens.results()[index]
        return report

    def _host_report(self, prompt_len: int, start: int, n: int) -> dict:
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
        rows = captured[lo - first_captured: hi - first_captured]
        policy = self.thresholds
        return verify_rows(rows, self.fingerprint, policy.full, policy.short, policy.fail_factor).to_dict()


def check_batch(checks: DeviceChecks, batch: Any, rows: torch.Tensor) -> None:
    """In a prefill's forward hook: hand each device verification of the batch its rows
    (`rows`: the batch's FULL last-layer rows, one per extended token, on the device), then
    start the checks of every request that now has all of them, in one batched pass each for
    the fingerprints and the tokens. Nothing waits for the device."""
    complete = []
    offset = 0
    for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        state = peek(req)
        verification = None if state is None else state.verification
        if verification is not None and verification.on_device and not verification.done:
            ids = req.origin_input_ids
            if verification.take(rows[offset: offset + extend], prefix, len(ids)):
                complete.append((verification, ids))
        offset += extend
    items = []
    for verification, ids in complete:
        start, n = verification._span(len(ids))
        try:
            check_rows(verification._buffer[:n], verification.fingerprint)
        except FingerprintError as exc:
            verification.error = str(exc)
            continue
        items.append((verification, ids))
    if not items:
        return
    topks = {v.fingerprint.topk for v, _ in items}
    for topk in topks:  # one topk per server: one pass
        group = [(v, ids) for v, ids in items if v.fingerprint.topk == topk]
        stats = verify_batch([(v._buffer[: v.fingerprint.n_rows], v.fingerprint) for v, _ in group])
        tokens = token_checks([v.token_request(ids) for v, ids in group], checks.head, checks.max_z,
                              logit_scale=checks.logit_scale, softcap=checks.softcap)
        for index, (verification, _) in enumerate(group):
            verification.started(stats, tokens, index)


def batch_rows(batch: Any, result: Any) -> Optional[torch.Tensor]:
    """A prefill batch's last-layer rows, one per extended token (FULL capture), or None."""
    if batch is None or not hasattr(batch, "reqs") or not batch.forward_mode.is_extend():
        return None
    rows = last_layer_rows(getattr(result, "logits_output", None))
    if rows is None or batch.extend_lens is None or rows.shape[0] != sum(batch.extend_lens):
        return None
    return rows


def is_stop(req: Any, token: int) -> bool:
    """Whether sglang would end this request's generation on `token`: its stop_token_ids, the
    model's EOS ids, the tokenizer's EOS and additional stop ids (`Req._check_token_based_finish`)."""
    params = req.sampling_params
    if params.stop_token_ids and token in params.stop_token_ids:
        return True
    if req.eos_token_ids and token in req.eos_token_ids:
        return True
    tokenizer = req.tokenizer
    if tokenizer is None:
        return False
    return token == tokenizer.eos_token_id or token in (getattr(tokenizer, "additional_stop_token_ids", None) or ())
