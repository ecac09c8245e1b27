"""Scheduler side of TOPLOC: per-request fingerprint builders and verification of prefills.

Generation: the row that sampled output token j (the lm_head input of that step) is appended to
the request's builder; full chunks of 32 rows are gathered into jobs of many chunks, which a
background thread turns into toploc proofs (on a GPU server: top-k and interpolation on the GPU),
so the scheduler loop never waits on top-k or interpolation. When the request finishes, the last partial chunk is added and the
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

from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.runtime_context import get_server_args

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
from sglang_rl.fingerprint.calibration import UNCALIBRATED, ThresholdPolicy, cached_policy
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


def thresholds_from_server_args(server_args: Any) -> ThresholdPolicy:
    """The pass/fail bounds in force: those of --toploc-verification-calibration (read once per
    process), else the uncalibrated defaults as adjusted by the --toploc-verification-max-* flags."""
    path = getattr(server_args, "toploc_verification_calibration", None)
    if path:
        return cached_policy(path)
    base = Thresholds.for_topk(
        server_args.toploc_verification_topk,
        mant_err_mean=server_args.toploc_verification_max_mant_err_mean,
        mant_err_median=server_args.toploc_verification_max_mant_err_median,
    )
    if server_args.toploc_verification_max_exp_mismatches is not None:
        base = Thresholds(
            max_exp_mismatches=server_args.toploc_verification_max_exp_mismatches,
            max_mant_err_mean=base.max_mant_err_mean,
            max_mant_err_median=base.max_mant_err_median,
        )
    source = UNCALIBRATED if base == Thresholds.for_topk(server_args.toploc_verification_topk) else (
        "uncalibrated, set by flags"
    )
    return ThresholdPolicy(full=base, source=source)


class RowStore:
    """Host chunk buffers of all generating requests in one tensor [slots, 32, H] (bf16), so that a
    scheduler step writes every request's row with a single indexed copy. A full chunk is not
    copied out: its slot is lent to the proof job (and kept for a speculative cut at finish) while
    the builder goes on in a fresh slot."""

    def __init__(self) -> None:
        self.data: Optional[torch.Tensor] = None
        self._free: list[int] = []
        self._lent: list[tuple[Future, int]] = []

    def acquire(self, hidden_size: int) -> int:
        if self._lent:
            self._free.extend(slot for future, slot in self._lent if future.done())
            self._lent = [(future, slot) for future, slot in self._lent if not future.done()]
        if self.data is None:
            self.data = self._allocate(64, hidden_size)
            self._free = list(range(63, -1, -1))
        if not self._free:
            old = self.data.shape[0]
            grown = self._allocate(2 * old, hidden_size)
            grown[:old].copy_(self.data)
            self.data = grown  # a proof job still reading the old tensor keeps it alive
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    @staticmethod
    def _allocate(slots: int, hidden_size: int) -> torch.Tensor:
        """Page-locked on a GPU server, so a proof job copies full chunks straight to the device,
        asynchronously, without staging them."""
        pinned = _selection_device() is not None
        return torch.empty(slots, CHUNK_ROWS, hidden_size, dtype=torch.bfloat16, pin_memory=pinned)

    def release(self, slot: int, reader: Optional[Future] = None) -> None:
        """Free a slot; one that a pending proof job (`reader`) still reads is freed after it."""
        if reader is None or reader.done():
            self._free.append(slot)
        else:
            self._lent.append((reader, slot))

    def write(self, slots: list[int], fills: list[int], rows: torch.Tensor) -> None:
        """rows[i] -> chunk row fills[i] of slot slots[i], as one index_copy_ into the flat view."""
        flat = self.data.view(-1, self.data.shape[-1])
        index = torch.tensor(slots, dtype=torch.long) * CHUNK_ROWS + torch.tensor(fills, dtype=torch.long)
        flat.index_copy_(0, index, rows)


_store = RowStore()
_device: Optional[torch.device] = None
_streams: dict[torch.device, Any] = {}


def _selection_device() -> Optional[torch.device]:
    """The accelerator the scheduler runs on (top-k selection runs there), None on a CPU server.
    Read in the scheduler thread, which sglang binds to its device."""
    global _device
    if _device is None and torch.cuda.is_available() and _server_device() not in ("cpu", None):
        _device = torch.device("cuda", torch.cuda.current_device())
    return _device


def _server_device() -> Optional[str]:
    try:
        return get_server_args().device
    except Exception:  # noqa: BLE001 - outside a server process (unit tests, tools): the CPU
        return None


def _proof_stream(device: torch.device) -> Any:
    """The side stream proof jobs run on (they never wait for the forward)."""
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)
    return stream


def _prove(chunks: torch.Tensor | list[torch.Tensor], topk: int, device: Optional[torch.device]) -> list[bytes]:
    """toploc proofs of host chunks. On a GPU server the batched top-k and the interpolation run
    on the GPU, on a side stream of its own (it never waits for the forward), and only the proof
    coefficients come back to the host."""
    if device is None:
        return build_chunk_proofs(chunks, topk)
    with torch.cuda.device(device), torch.cuda.stream(_proof_stream(device)):
        if isinstance(chunks, torch.Tensor):
            return build_chunk_proofs(chunks.pin_memory().to(device, non_blocking=True), topk)
        return build_chunk_proofs([c.to(device, non_blocking=True) for c in chunks], topk)


def _prove_slots(data: torch.Tensor, slots: list[int], topk: int, device: Optional[torch.device]) -> list[bytes]:
    """Proofs of the full chunks in `slots` of `data`, gathered here, in the proof thread, so the
    scheduler step that filled them copies nothing. On a GPU server the page-locked slots go to
    the device one run of consecutive slots per copy, on the proof stream."""
    if device is None or not data.is_pinned():
        return _prove(data.index_select(0, torch.tensor(slots, dtype=torch.long)), topk, device)
    stream = _proof_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        chunks = torch.empty((len(slots), *data.shape[1:]), dtype=data.dtype, device=device)
        for start, first, count in _runs(slots):
            chunks[start : start + count].copy_(data[first : first + count], non_blocking=True)
        return build_chunk_proofs(chunks, topk)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(position, first slot, length) of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, slot, 1))
    return runs


class FingerprintBuilder:
    """Rows of one generating request, turned into proofs chunk by chunk."""

    def __init__(self, topk: int) -> None:
        self.topk = topk
        self.rows_seen = 0
        self.slot: Optional[int] = None
        self.fill = 0
        self._proofs: list[tuple[Future, int]] = []
        self._last_full: Optional[int] = None  # the slot of the newest full chunk, lent to its proof
        self._last_future: Optional[Future] = None  # the proof job that reads it
        self.done = False

    def chunk_filled(self, hidden_size: int) -> int:
        """The current slot is full: keep it as the newest full chunk and go on in a fresh slot.
        Returns the full slot (the previous full one goes back to the store)."""
        full = self.slot
        if self._last_full is not None:
            _store.release(self._last_full, self._last_future)
        self._last_full = full
        self.slot = _store.acquire(hidden_size)
        self.fill = 0
        return full

    def attach(self, future: Future, index: int) -> None:
        """Record where the proof of this builder's newest full chunk will come from."""
        self._proofs.append((future, index))
        self._last_future = future

    def tail(self, n_rows: int) -> Optional[torch.Tensor]:
        """A copy of the rows of the last, partial chunk of a fingerprint over the first `n_rows`
        rows (None if there are none). A speculative step's run of rows may go past the request's
        end (sglang cuts the tokens with finished_len): those rows are dropped here, also from the
        newest full chunk, whose proof is then replaced by the partial one's."""
        excess = self.rows_seen - n_rows
        reach = self.fill + (CHUNK_ROWS if self._last_full is not None else 0)
        if excess < 0 or excess > reach:
            raise FingerprintError(
                f"the fingerprint saw {self.rows_seen} rows for {n_rows} returned tokens"
            )
        self.rows_seen = n_rows
        if excess <= self.fill:
            keep = self.fill - excess
            return _store.data[self.slot, :keep].clone() if keep else None
        self._proofs.pop()
        keep = CHUNK_ROWS - (excess - self.fill)
        return _store.data[self._last_full, :keep].clone() if keep else None

    def finish(self, last_proof: Optional[bytes]) -> str:
        """Wait for pending proofs and return the fingerprint string; frees the row slot."""
        self.done = True
        _pending.flush(self.topk)  # its newest chunks may still wait for their job
        proofs = [future.result()[index] for future, index in self._proofs]
        if last_proof is not None:
            proofs.append(last_proof)
        self.release()
        fp = Fingerprint(topk=self.topk, chunk_size=CHUNK_ROWS, n_rows=self.rows_seen, proofs=tuple(proofs))
        return encode_fingerprint(fp)

    def release(self) -> None:
        """Give the row slot back (the request finished, with or without a fingerprint)."""
        self.done = True
        if self._last_full is not None:
            _store.release(self._last_full, self._last_future)
            self._last_full = None
        if self.slot is not None:
            _store.release(self.slot)
            self.slot = None


class PendingProofs:
    """Full chunks waiting for their proof job. Chunks fill a few at a time (every step under
    speculative decoding), and every job costs the proof thread a fixed few dozen kernel launches
    and host ops that compete with the scheduler for the GIL, so chunks are gathered into one job
    of up to `max_chunks` chunks, started at the latest `max_steps` steps after its first chunk,
    or as soon as a request finishes (`flush`). Each chunk gets its future at once: a slot stays
    lent until the job that reads it is done."""

    def __init__(self, max_chunks: int = 64, max_steps: int = 16) -> None:
        self.max_chunks = max_chunks
        self.max_steps = max_steps
        self._future: Optional[Future] = None
        self._slots: list[int] = []
        self._steps = 0

    def add(self, slot: int) -> tuple[Future, int]:
        """Queue a full chunk; returns its job's future and its index in the job's result."""
        if self._future is None:
            self._future, self._slots, self._steps = Future(), [], 0
        self._slots.append(slot)
        return self._future, len(self._slots) - 1

    def step(self, topk: int) -> None:
        """End of a scheduler step: start the job if it is full or old enough."""
        if self._future is None:
            return
        self._steps += 1
        if len(self._slots) >= self.max_chunks or self._steps >= self.max_steps:
            self.flush(topk)

    def flush(self, topk: int) -> None:
        """Start the job of the queued chunks now (a request that finishes waits for it)."""
        future, slots = self._future, self._slots
        if future is None:
            return
        self._future, self._slots = None, []
        device = _selection_device()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(_prove_slots(_store.data, slots, topk, device))
            except BaseException as exc:  # noqa: BLE001 - the waiting request reports it
                future.set_exception(exc)

        _proof_executor().submit(job)


_pending = PendingProofs()


def add_builder_rows(builders: list[FingerprintBuilder], rows: torch.Tensor, topk: int,
                     counts: Optional[list[int]] = None) -> None:
    """Append rows to builders: `rows` [sum(counts), H] (CPU) holds each builder's run of
    `counts[i]` rows in turn (one row each when counts is None; a speculative step commits a run).
    Each round of the runs is one indexed write; chunks filled in this step join the pending
    proof job (`PendingProofs`), which gathers their rows itself (the scheduler copies nothing)."""
    if not builders:
        return
    counts = counts or [1] * len(builders)
    hidden = rows.shape[-1]
    for b in builders:
        if b.slot is None:
            b.slot = _store.acquire(hidden)
    if rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16)
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)
    filled: list[tuple[FingerprintBuilder, int]] = []
    for j in range(max(counts)):
        active = [k for k, count in enumerate(counts) if count > j]
        members = [builders[k] for k in active]
        # one row per builder (no speculative run): the rows are already in builder order
        source = rows if len(active) == rows.shape[0] else rows[[starts[k] + j for k in active]]
        _store.write([b.slot for b in members], [b.fill for b in members], source)
        for b in members:
            b.fill += 1
            b.rows_seen += 1
            if b.fill == CHUNK_ROWS:
                filled.append((b, b.chunk_filled(hidden)))
    for b, slot in filled:
        b.attach(*_pending.add(slot))
    _pending.step(topk)


def finish_builders(items: list[tuple[FingerprintBuilder, Any]]) -> None:
    """Finalise the fingerprints of requests finishing in one output batch: each covers exactly
    the request's returned output ids; the last partial chunks are proven together, then each
    fingerprint is posted to its response (aborted requests get none)."""
    if items:
        _pending.flush(items[0][0].topk)
    tails, kept = [], []
    for builder, req in items:
        if isinstance(req.finished_reason, FINISH_ABORT):
            builder.release()
            continue
        returned = len(req.output_ids_through_stop)
        if returned == 0:
            builder.release()  # nothing generated (a prefill, e.g. sglang's shared prefix of n > 1)
            continue
        try:
            tails.append(builder.tail(returned))
        except FingerprintError as exc:
            logger.error("no fingerprint for request %s: %s", req.rid, exc)
            builder.release()
            continue
        kept.append((builder, req))
    if not kept:
        return
    chunks = [c for c in tails if c is not None]
    built = iter(_prove(chunks, kept[0][0].topk, _selection_device()) if chunks else [])
    for (builder, req), chunk in zip(kept, tails):
        last = next(built) if chunk is not None else None
        try:
            fingerprint = builder.finish(last)
        except FingerprintError as exc:  # never the scheduler's end: this response goes without
            logger.error("no fingerprint for request %s: %s", req.rid, exc)
            builder.release()
            continue
        transport.post(req, **{FINGERPRINTS_FIELD: [fingerprint]})


class PrefillVerification:
    """A prefill-only request that validates a fingerprint against its own prefill rows."""

    def __init__(self, fingerprint: Fingerprint, response_start: int, thresholds: ThresholdPolicy) -> None:
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
        report = verify_rows(rows, self.fingerprint, self.thresholds.full, self.thresholds.short).to_dict()
        report["thresholds_source"] = self.thresholds.source
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
