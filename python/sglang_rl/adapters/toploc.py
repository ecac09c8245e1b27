"""Scheduler side of TOPLOC: per-request fingerprint builders and verification of prefills.

Generation: the row that sampled output token j (the lm_head input of that step) is written to
the request's slot of the row store; full chunks of 32 rows are gathered into jobs of many
chunks, so the scheduler loop never waits on top-k or interpolation. On a GPU server the store is
on the GPU and the scheduler thread launches each job there itself, as a replayed CUDA graph on a
side stream (`DeviceJob`, `fingerprint/device_prover.py`), and picks up the proofs when they are
back; on a CPU server a background thread builds them from the host store. When requests finish,
their last partial chunks join the pending job, which then starts within a few steps (at once
with nothing left to run); their outputs are held until their proofs are built
(`finish_builders`, `release_finished`), then each fingerprint (all proofs, one container
string) is posted to its response.

Verification: a prefill-only request carrying a fingerprint captures its prefill rows (FULL mode
for that request only); once its prefill is done, rows [L-1, L-1+n) - the rows that produced the
n response tokens - are checked against the proofs with toploc's verifier.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np
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
    encode_built_proofs,
    verify_rows,
)
from sglang_rl.fingerprint.device_prover import DeviceProver, LaunchedProofs, device_index
from sglang_rl.fingerprint.calibration import UNCALIBRATED, ThresholdPolicy, cached_policy
from sglang_rl.fingerprint.row_ring import RowRing
from sglang_rl.request_options import FINGERPRINTS_FIELD, RESPONSE_START_KEY, RESULT_FIELD

logger = logging.getLogger(__name__)

CHUNK_ROWS = 32

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


class DeviceJob(Future):
    """A proof job of a GPU server: launched on the device by the scheduler thread itself (a
    second Python thread would fight the busy scheduler for the GIL at each of its ops), and
    completed by whichever scheduler-thread call first finds it done (`done`) or waits (`result`).
    Its slots may be written again once it is launched: the writes queue behind its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: Optional[LaunchedProofs] = None
        self._finish: Optional[Callable[[list[bytes]], Any]] = None

    def attach(self, launched: LaunchedProofs, finish: Callable[[list[bytes]], Any]) -> None:
        """The job is on the device; `finish(proofs)` gives the result once its proofs are back."""
        self.launched, self._finish = launched, finish

    def _complete(self, wait: bool) -> None:
        if Future.done(self) or self.launched is None or not (wait or self.launched.ready()):
            return
        try:
            self.set_result(self._finish(self.launched.proofs()))
        except BaseException as exc:  # noqa: BLE001 - the waiting requests report it
            self.set_exception(FingerprintError(f"proof job failed: {exc!r}"))

    def done(self) -> bool:
        self._complete(wait=False)
        return super().done()

    def result(self, timeout: Optional[float] = None) -> Any:
        if self.launched is None and not Future.done(self):
            raise FingerprintError("a proof job was waited for before it was started")
        self._complete(wait=True)
        return super().result(timeout)


def _reads_done(job: Future) -> bool:
    """Whether a job no longer needs its slots' rows (a launched device job has queued its reads
    ahead of any later write; a thread job reads until it is done)."""
    if getattr(job, "launched", None) is not None:
        return True
    return Future.done(job)  # a device job not launched has nothing to pick up


def _new_job() -> Future:
    return DeviceJob() if _prover() is not None else Future()


JOB_STEPS = 128
"""Scheduler steps a GPU server's proof job waits for more chunks at most (`PendingProofs`). Only
finishing requests wait for proofs, and they start the job within `FINISH_STEPS`; a running
request's full chunks only hold their slots, so a long wait costs some store memory, while
every job costs the scheduler thread a flush, a launch and a read-back (~0.5 ms in all). At
batch 8 under EAGLE a chunk fills every ~1.2 steps, so 32 steps made a job of ~26 chunks."""
JOB_CHUNKS = 256
"""Chunks that start a GPU server's proof job at once (four graph pieces of 64)."""
STAGED_STEPS = 2 * JOB_STEPS
"""Decode steps whose rows a GPU server's row store writes together at most (the rows wait on
the device, ~2 MB a step for 64 requests at 4096 under speculative decoding, so `STAGED_BYTES`
comes first there); a CPU store writes every step. A proof job flushes the store before it
starts, and its first chunk may fill some steps after the last flush, so staging twice as many
steps as a job waits leaves the flushes to the jobs: each costs the scheduler thread a few
hundred us."""
STAGED_BYTES = 64 << 20
"""Staged rows a GPU server's store writes once they reach this size, whatever their steps."""
FINISH_STEPS = 16
"""Scheduler steps (decode or prefill) a GPU server's finishing requests may wait for the shared
proof job to start (`PendingProofs.due`); with no batch left to run it starts at once
(`release_finished`). Requests finish a few at a time over many steps (under speculative
decoding even those of one length), and every job costs the scheduler thread ~0.5-0.7 ms: with
4 steps, 64 EAGLE requests of 64-512 tokens started 32 jobs a run on an H100, with 16 steps 10.
A finished output waits at most 16 steps (~65 ms there); the last ones of a burst not at all."""


class RowStore:
    """Chunk buffers of all generating requests in one tensor [slots, 32, H] (bf16), so that a
    scheduler step writes every request's rows with one indexed copy. On a GPU server it lives on
    the GPU (rows are written there on the proof stream and proven there); on a CPU server on the
    host. A full chunk is not copied out: its slot is lent to the proof job (and kept for a
    speculative cut at finish) while the builder goes on in a fresh slot. The last slot is never
    handed out: a step's rows that no builder takes are written there (`write`), so a GPU step
    scatters all its rows in one copy instead of first gathering those it keeps."""

    def __init__(self) -> None:
        self.data: Optional[torch.Tensor] = None
        self._words: Optional[torch.Tensor] = None  # data's flat rows as int32 words (even H)
        self._free: list[int] = []
        self._lent: dict[Future, list[int]] = {}  # slots a proof job still reads, by job
        self._staged: list[tuple[torch.Tensor, list[int]]] = []  # (rows, runs) not yet written
        self._staged_bytes = 0
        self._quarantined: list[int] = []  # freed while rows were staged: free after the next flush
        self._in_flight: list[tuple[Any, list[torch.Tensor]]] = []  # (event, rows) of GPU writes
        self._events: list[Any] = []  # events of writes that have passed, to record again
        self.staged_steps: Optional[int] = None  # decode steps written together; None: by device

    @property
    def capacity(self) -> int:
        """Slots that can be handed out (all but the discard slot)."""
        return 0 if self.data is None else self.data.shape[0] - 1

    def acquire(self, hidden_size: int) -> int:
        if not self._free:  # slots lent to jobs or freed while rows were staged come back first
            self.reclaim()
            if self._quarantined:
                self.flush()
        if self.data is None:
            self._set_data(self._allocate(64, hidden_size))
            self._free = list(range(63, -1, -1))
        if not self._free:
            self.flush()  # staged rows go to the discard slot of the tensor they were indexed for
            old = self.capacity
            grown = self._allocate(2 * old, hidden_size)
            with _on_proof_stream():
                grown[:old].copy_(self.data[:old])
            self._set_data(grown)  # a proof job still reading the old tensor keeps it alive
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _set_data(self, data: torch.Tensor) -> None:
        self.data = data
        flat = data.view(-1, data.shape[-1])
        self._words = flat.view(torch.int32) if flat.shape[-1] % 2 == 0 else None

    def reclaim(self) -> None:
        """Free the slots of jobs that no longer read them (few jobs, many slots: each job is
        looked at once)."""
        for future in [f for f in self._lent if _reads_done(f)]:
            self._free.extend(self._lent.pop(future))

    @staticmethod
    def _allocate(slots: int, hidden_size: int) -> torch.Tensor:
        """`slots` slots to hand out and the discard slot after them."""
        prover = _prover()
        with _on_proof_stream():  # allocated on the stream every later use is ordered on
            return torch.empty(slots + 1, CHUNK_ROWS, hidden_size, dtype=torch.bfloat16,
                               device=prover.device if prover is not None else "cpu")

    def release(self, slot: int, reader: Optional[Future] = None) -> None:
        """Free a slot; one that a pending proof job (`reader`) still reads is freed after it.
        A slot freed while rows are staged (an aborted request's may be among them) is handed
        out again only after they are written, so that they can never land after the rows of
        the slot's next owner (an indexed copy writes duplicate rows in no set order)."""
        if reader is None:
            (self._quarantined if self._staged else self._free).append(slot)
        elif _reads_done(reader):
            self._free.append(slot)
        else:
            self._lent.setdefault(reader, []).append(slot)

    def write(self, runs: list[int], rows: torch.Tensor, kept: int) -> None:
        """Store the step's rows: each run, three ints (start, first, count) of the flat list
        `runs`, puts rows[start : start + count] at flat rows first.. (slot * 32 + row in
        chunk); `kept` is the runs' rows in all. Flat ints rather than a tuple per run: nothing
        for Python's collector to track while staged.

        When most rows are kept (a decode step) all of them go in one scatter, those no run takes
        to the discard slot. Rows of `keep_rows` on the store's device (a private, finished copy)
        are staged instead, and the staged steps written together (`flush`) every
        `staged_steps` steps (or `STAGED_BYTES`), or before a proof job reads the store or a slot
        is handed out again: each write costs the scheduler thread a few launches. Other rows (a
        forward's own output, which the next forward may overwrite) are written at once, after
        the current stream's work. Else (a prefill's last rows) the kept rows are gathered and
        written at once."""
        own = getattr(rows, KEPT_ATTR, False)
        if 2 * kept >= rows.shape[0]:
            steps = self.staged_steps or (STAGED_STEPS if self.data.is_cuda else 1)
            if steps > 1 and own and rows.device == self.data.device:
                self._staged.append((rows, runs))  # the flush turns all staged runs into one index
                self._staged_bytes += rows.numel() * rows.element_size()
                if len(self._staged) >= steps or self._staged_bytes >= STAGED_BYTES:
                    self.flush()
                return
            discard = (self.data.shape[0] - 1) * CHUNK_ROWS
            index = [discard] * rows.shape[0]
            for start, first, count in _triples(runs):
                index[start : start + count] = range(first, first + count)
            picks = None
        else:
            picks, index = [], []
            for start, first, count in _triples(runs):
                picks.extend(range(start, start + count))
                index.extend(range(first, first + count))
        self.flush()
        self._copy([rows], index, picks, wait=not own)

    def flush(self) -> None:
        """Write the staged steps' rows (one concatenation and one indexed copy); slots freed
        meanwhile can then be handed out again."""
        if self._staged:
            staged, self._staged, self._staged_bytes = self._staged, [], 0
            index = staged_index([runs for _, runs in staged], [rows.shape[0] for rows, _ in staged],
                                 (self.data.shape[0] - 1) * CHUNK_ROWS)
            self._copy([rows for rows, _ in staged], index, wait=False)
        if self._quarantined:
            self._free.extend(self._quarantined)
            self._quarantined = []

    def _copy(self, parts: list[torch.Tensor], index: list[int] | np.ndarray,
              picks: Optional[list[int]] = None, wait: bool = True) -> None:
        """data's flat rows `index` = the rows of `parts`, concatenated (only rows `picks` of
        them when given). On a GPU server this runs on the proof stream, after the current
        stream's work when `wait`. Rows of `keep_rows` need no wait: they are finished before
        the host reads the step's results, and sglang's scheduler stream is ordered behind the
        forward it has just launched, so waiting for it would hold every flush and proof job, and
        the outputs that end a burst, behind that whole forward. Page-locked host rows cross in
        one asynchronous copy. Device rows made on another stream are kept (not handed back to
        their stream's allocator) until an event says the copy has read them: one event instead
        of a `record_stream` per step. An even hidden size is copied as int32 words, two bf16
        each: the same bits, and on the CPU twice as fast."""
        device = self.data.device
        on_device = parts[0].is_cuda
        producer = torch.cuda.current_stream() if on_device and wait else None
        with _on_proof_stream():
            if producer is not None:
                torch.cuda.current_stream().wait_stream(producer)
            joined = RowRing.join(parts)
            pieces = joined.pieces
            if len(pieces) > 2 or picks is not None:
                pieces = [torch.cat(pieces) if len(pieces) > 1 else pieces[0]]
            if picks is not None:
                pieces = [pick_rows(pieces[0], picks)]
            target = device_index(index, device)
            offset = 0
            for rows in pieces:  # two when the staged rows wrap round the ring's end
                if rows.device != device:
                    rows = rows.to(device, non_blocking=True)
                if rows.dtype != torch.bfloat16:
                    rows = rows.to(torch.bfloat16)
                if self._words is not None:
                    flat, rows = self._words, rows.contiguous().view(torch.int32)
                else:
                    flat = self.data.view(-1, self.data.shape[-1])
                n = rows.shape[0]
                flat.index_copy_(0, target if len(pieces) == 1 else target[offset : offset + n], rows)
                offset += n
            if on_device:
                event = self._hold(joined.loose)
                for ring in joined.rings:  # ring views need no keeping: the ring waits for the event
                    ring.fence(event)

    def _hold(self, rows: list[torch.Tensor]) -> Any:
        """Keep `rows` until the copy just issued on the proof stream has read them (writes
        before it are let go once their events have passed); returns the event that says so."""
        while self._in_flight and self._in_flight[0][0].query():
            self._events.append(self._in_flight.pop(0)[0])
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record()  # recorded again once passed, rather than a new CUDA event per write
        self._in_flight.append((event, rows))
        return event


def _triples(runs: list[int]) -> Any:
    """(start, first, count) of each run of a flat run list."""
    it = iter(runs)
    return zip(it, it, it)


def staged_index(runs: list[list[int]], sizes: list[int], discard: int) -> np.ndarray:
    """The flat store row of every row of some staged steps, concatenated: step s has `sizes[s]`
    rows, and its runs (flat (start, first, count) triples) put its rows start.. at store rows
    first..; the rows no run takes go to `discard`. Built in numpy once per flush from the runs
    that `add_builder_rows` made anyway: at 64 requests a step's index as a Python list took
    ~50 us of the scheduler thread, per step."""
    per_step = [len(r) // 3 for r in runs]
    flat = np.fromiter(itertools.chain.from_iterable(runs), np.int64, 3 * sum(per_step)).reshape(-1, 3)
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    count = flat[:, 2]
    offset_in_run = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    index = np.full(int(sizes_arr.sum()), discard, dtype=np.int64)
    step_start = np.repeat(np.cumsum(sizes_arr) - sizes_arr, per_step)
    index[np.repeat(flat[:, 0] + step_start, count) + offset_in_run] = np.repeat(flat[:, 1], count) + offset_in_run
    return index


KEPT_ATTR = "_sglang_rl_kept"


RING_BYTES = STAGED_BYTES + STAGED_BYTES // 4
"""The buffer that kept rows are copied into (`RowRing`): the staged rows, whose bytes start a
flush at `STAGED_BYTES`, and the few steps kept meanwhile."""
_rings: dict[tuple, Optional[RowRing]] = {}  # by the rows' (dtype, width, device index); None: no ring


def keep_rows(rows: torch.Tensor) -> torch.Tensor:
    """A private copy of a step's device rows for the row store, made where sglang starts the
    step's host copies (before its copy_done event), so finished once the host has waited for
    that event, as the result hooks do before they route rows. The store may stage it for many
    steps and write it with no stream wait (`RowStore.write`). The copy goes into the server's
    `RowRing` (allocated on first use, `RING_BYTES`), beside the previous step's; rows that do
    not fit there (a long prefill's, or while the ring is full) get a tensor of their own."""
    kind = (rows.dtype, rows.shape[-1], rows.get_device())
    ring = _rings.get(kind, False)
    if ring is False:
        ring = _rings[kind] = _new_ring(rows)
    kept = ring.copy(rows) if ring is not None else None
    if kept is None:
        return clone_kept(rows)
    setattr(kept, KEPT_ATTR, True)
    return kept


def clone_kept(rows: torch.Tensor) -> torch.Tensor:
    """`keep_rows` without the ring: a tensor of its own, marked as a kept copy."""
    kept = rows.clone()
    setattr(kept, KEPT_ATTR, True)
    return kept


def _new_ring(rows: torch.Tensor) -> Optional[RowRing]:
    """The ring for device rows like these (None for host rows). Allocated while the server
    runs, out of the memory sglang leaves free: where `RING_BYTES` do not fit, kept rows are
    cloned step by step, as before the ring, rather than the step failing."""
    if not (rows.is_cuda and rows.dim() == 2):
        return None
    try:
        return RowRing(RING_BYTES // (rows.shape[1] * rows.element_size()), rows)
    except torch.cuda.OutOfMemoryError:
        logger.warning("no room for the %d MB row ring: TOPLOC copies each step's rows apart",
                       RING_BYTES >> 20)
        return None


def pick_rows(rows: torch.Tensor, picks: list[int] | range) -> torch.Tensor:
    """rows[picks] for ascending `picks`: a view for a run of rows (all rows, say, in plain
    decoding), else one gather (on the rows' device)."""
    if picks and picks[-1] - picks[0] == len(picks) - 1:
        return rows[picks[0] : picks[-1] + 1]
    return rows.index_select(0, device_index(picks, rows.device))


_store = RowStore()
_device: Optional[torch.device] = None
_device_known = False
_provers: dict[torch.device, DeviceProver] = {}
PROOF_STREAM_PRIORITY = 0
"""Priority of the proof stream (lower is higher; torch clamps it to the device's range). The
default: on an H100 the highest made no job finish sooner beside a forward (docs/design.md, section 7);
the TOPLOC ablation plugin raises it to measure that."""


def _selection_device() -> Optional[torch.device]:
    """The accelerator the scheduler runs on (top-k selection runs there), None on a CPU server.
    Decided once, in the scheduler thread, which sglang binds to its device (this is asked
    several times a step)."""
    global _device, _device_known
    if not _device_known:
        cuda = torch.cuda.is_available()
        server_device = _server_device() if cuda else "cpu"
        if cuda and server_device not in ("cpu", None):
            _device = torch.device("cuda", torch.cuda.current_device())
        _device_known = server_device is not None  # None: no server args yet, ask again
    return _device


def store_device() -> Optional[torch.device]:
    """The device of the row store: the server's accelerator, or None (the host)."""
    return _selection_device()


def _prover() -> Optional[DeviceProver]:
    """The prover of a GPU server's row store, None on a CPU server (its proofs are built in the
    proof thread, in numpy). It runs on a side stream of its own, so proofs never wait for the
    forward."""
    device = _selection_device()
    if device is None:
        return None
    prover = _provers.get(device)
    if prover is None:
        stream = torch.cuda.Stream(device=device, priority=PROOF_STREAM_PRIORITY)
        prover = _provers[device] = DeviceProver(device, stream)
    return prover


def _server_device() -> Optional[str]:
    try:
        return get_server_args().device
    except Exception:  # noqa: BLE001 - outside a server process (unit tests, tools): the CPU
        return None


def _on_proof_stream() -> Any:
    """The context in which a GPU server touches the row store: its prover's side stream."""
    prover = _prover()
    return contextlib.nullcontext() if prover is None else prover.on_stream()


class _Chunk:
    """A chunk of one request: its row slot and row count (32 but for the last chunk of a
    finished request), the job that will read it (the pending job's future, set when the chunk
    is queued) and its proof once built. `released`: the slot went back to the store (freed
    once that job is done, so its rows stay readable until then)."""

    __slots__ = ("slot", "rows", "job", "proof", "released")

    def __init__(self, slot: int, rows: int = CHUNK_ROWS) -> None:
        self.slot = slot
        self.rows = rows
        self.job: Optional[Future] = None
        self.proof: Optional[bytes] = None
        self.released = False

    def wait(self) -> bytes:
        """The proof, waiting for the job that builds it."""
        if self.proof is None and self.job is not None:
            self.job.result()
        if self.proof is None:
            raise FingerprintError("a full chunk was left without a proof")
        return self.proof


class FingerprintBuilder:
    """Rows of one generating request, turned into proofs chunk by chunk."""

    __slots__ = ("topk", "rows_seen", "slot", "fill", "chunks", "_cut", "done")

    def __init__(self, topk: int) -> None:
        self.topk = topk
        self.rows_seen = 0
        self.slot: Optional[int] = None
        self.fill = 0
        self.chunks: list[_Chunk] = []  # full chunks, in order; only the newest keeps its slot
        self._cut: Optional[_Chunk] = None  # a full chunk dropped by a speculative cut (rows read at finish)
        self.done = False

    def chunk_filled(self, hidden_size: int) -> _Chunk:
        """The current slot is full: keep it as the newest full chunk and go on in a fresh slot.
        The previous full chunk's slot goes back to the store once its job has read it."""
        if self.chunks:
            self._retire(self.chunks[-1])
        chunk = _Chunk(self.slot)
        self.chunks.append(chunk)
        self.slot = _store.acquire(hidden_size)
        self.fill = 0
        return chunk

    @staticmethod
    def _retire(chunk: _Chunk) -> None:
        if not chunk.released:
            _store.release(chunk.slot, chunk.job)
            chunk.released = True

    def tail(self, n_rows: int) -> Optional[_Chunk]:
        """The last, partial chunk of a fingerprint over the first `n_rows` rows, None if there
        is none; its rows stay in the store until `fingerprint` or `release`. A
        speculative step's run of rows may go past the request's end (sglang cuts the tokens with
        finished_len): those rows are dropped here, also from the newest full chunk, which then
        becomes the partial one. Staged rows need no flush here: the job that reads the chunk
        writes them first."""
        excess = self.rows_seen - n_rows
        reach = self.fill + (CHUNK_ROWS if self.chunks else 0)
        if excess < 0 or excess > reach:
            raise FingerprintError(
                f"the fingerprint saw {self.rows_seen} rows for {n_rows} returned tokens"
            )
        self.rows_seen = n_rows
        if excess <= self.fill:
            keep = self.fill - excess
            return _Chunk(self.slot, keep) if keep else None
        self._cut = self.chunks.pop()
        _pending.take([self._cut])
        keep = CHUNK_ROWS - (excess - self.fill)
        return _Chunk(self._cut.slot, keep) if keep else None

    def finish(self, last_proof: Optional[bytes]) -> str:
        """The fingerprint string of this builder alone, starting the pending job at once if it
        holds any of its full chunks (`finish_builders` does the same for a batch, and proves
        its last chunks there too)."""
        queued_in = _pending.future
        if queued_in is not None and any(chunk.job is queued_in for chunk in self.chunks):
            _pending.flush()
        return self.fingerprint(last_proof)

    def fingerprint(self, last_proof: Optional[bytes]) -> str:
        """The fingerprint string once no full chunk is left queued: the full chunks' proofs
        (waiting for jobs still running), then `last_proof`. Frees the row slots."""
        self.done = True
        proofs = [chunk.wait() for chunk in self.chunks]
        if last_proof is not None:
            proofs.append(last_proof)
        self.release()
        return encode_built_proofs(self.topk, CHUNK_ROWS, self.rows_seen, tuple(proofs))

    def release(self) -> None:
        """Give the row slots back (the request finished, with or without a fingerprint)."""
        self.done = True
        _pending.take(self.chunks)
        for chunk in (*self.chunks, self._cut):
            if chunk is not None:
                self._retire(chunk)
        self._cut = None
        _pending.settle()
        if self.slot is not None:
            _store.release(self.slot)
            self.slot = None


class PendingProofs:
    """Chunks waiting for their proof job. Chunks fill a few at a time (every step under
    speculative decoding), and every job costs the scheduler thread a flush of the staged rows,
    a launch and a read-back (a few hundred us on a GPU server's host, whatever its size), so
    chunks are gathered into one job of up to `max_chunks` chunks, started at the latest
    `max_steps` steps after its first chunk (defaults: `JOB_CHUNKS` and `JOB_STEPS` on a GPU
    server; 64 and 1 on a CPU server, where a proof costs per chunk, in numpy, rather than per
    job, so holding chunks back only makes finishing outputs wait longer). The last, partial
    chunks of finishing requests join the same job, which then starts within `finish_steps`
    steps (default: `FINISH_STEPS` on a GPU server, at once on a CPU server; `due`): requests
    finish a few at a time over many steps, and a job of their own at each of those steps cost
    more host time than the rest of TOPLOC together. A queued chunk knows its job's future at once: its slot
    stays lent until that job is done."""

    def __init__(self, max_chunks: Optional[int] = None, max_steps: Optional[int] = None,
                 finish_steps: Optional[int] = None) -> None:
        self.max_chunks = max_chunks
        self.max_steps = max_steps
        self.finish_steps = finish_steps
        self.future: Optional[Future] = None
        self.queue: list[_Chunk] = []
        self.topk = 0
        self._steps = 0
        self._due: Optional[int] = None  # the step by which finishing requests need the job

    def _limits(self) -> tuple[int, int, int]:
        """(max_chunks, max_steps, finish_steps) in force: those given, else this server's
        defaults. 0 leaves the first two unset; a finish_steps of 0 means at once."""
        on_gpu = _selection_device() is not None
        finish_steps = self.finish_steps
        if finish_steps is None:
            finish_steps = FINISH_STEPS if on_gpu else 0
        return (self.max_chunks or (JOB_CHUNKS if on_gpu else 64),
                self.max_steps or (JOB_STEPS if on_gpu else 1), finish_steps)

    def add(self, chunk: _Chunk, topk: int) -> None:
        """Queue a chunk for the next job."""
        if self.future is None:
            self.future, self.queue, self._steps, self._due = _new_job(), [], 0, None
        self.topk = topk
        chunk.job = self.future
        self.queue.append(chunk)

    def due(self) -> None:
        """Finishing requests wait for the queued job: start it within `finish_steps` steps."""
        if self.future is None:
            return
        steps = self._limits()[2]
        if steps <= 0:
            self.flush()
            return
        due = self._steps + steps
        self._due = due if self._due is None else min(self._due, due)

    def take(self, chunks: list[_Chunk]) -> list[_Chunk]:
        """Remove those of `chunks` still queued (their owner proves them, or needs no proof);
        returns them, in the order given. They no longer wait for a job; slots lent to the job
        stay lent until `settle` or the job, so the owner can still read them. A queued chunk is
        one whose job is the queue's future, so a request with nothing queued (most requests
        that give their slots back) costs no queue scan."""
        future = self.future
        if future is None:
            return []
        taken = [c for c in chunks if c.job is future]
        if taken:
            wanted = {id(c) for c in taken}
            self.queue = [c for c in self.queue if id(c) not in wanted]
            for chunk in taken:
                chunk.job = None
        return taken

    def settle(self) -> None:
        """Close a job that nothing is queued for any more: the slots lent to it come back."""
        if self.future is not None and not self.queue:
            self.future.set_result(None)
            self.future = None

    def step(self) -> None:
        """End of a scheduler step: start the job if it is full, old enough or due."""
        if self.future is None:
            return
        self._steps += 1
        max_chunks, max_steps, _ = self._limits()
        if (len(self.queue) >= max_chunks or self._steps >= max_steps
                or (self._due is not None and self._steps >= self._due)):
            self.flush()

    def flush(self) -> None:
        """Start the job of the queued chunks now."""
        future, chunks = self.future, self.queue
        if future is None:
            return
        self.future, self.queue = None, []
        if not chunks:
            future.set_result(None)
            return
        def assign(proofs: list[bytes]) -> None:
            for chunk, proof in zip(chunks, proofs):
                chunk.proof = proof

        _start(future, [(chunk.slot, chunk.rows) for chunk in chunks], self.topk, assign)


_pending = PendingProofs()


def _start(future: Future, parts: list[tuple[int, int]], topk: int,
           finish: Callable[[list[bytes]], Any]) -> None:
    """Start the proofs of store chunks `parts` ((slot, rows) each); `future` gets
    `finish(proofs)`. A GPU server launches them here, on the device (`DeviceJob`); a CPU
    server's proof thread builds them from the host store."""
    _store.flush()
    prover = _prover()
    if prover is not None:
        try:  # the launch runs on the prover's stream
            launched = prover.launch(_store.data, [slot for slot, _ in parts], [rows for _, rows in parts], topk)
        except Exception as exc:  # noqa: BLE001 - never the scheduler's end: the waiting requests report it
            future.set_exception(FingerprintError(f"proof job failed to start: {exc!r}"))
            return
        future.attach(launched, finish)
        return
    chunks = [_store.data[slot, :rows] for slot, rows in parts]  # chunks of one size share a top-k

    def job() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(finish(build_chunk_proofs(chunks, topk)))
        except BaseException as exc:  # noqa: BLE001 - the waiting requests report it
            future.set_exception(FingerprintError(f"proof job failed: {exc!r}"))

    _proof_executor().submit(job)


def add_builder_rows(builders: list[FingerprintBuilder], rows: torch.Tensor, topk: int,
                     counts: Optional[list[int]] = None, starts: Optional[list[int]] = None) -> None:
    """Append rows to builders: builder i takes the run rows[starts[i] : starts[i] + counts[i]]
    of the step's rows [N, H] (one row each when counts is None; a speculative step commits a
    run; runs follow each other from row 0 when starts is None). The whole step is one indexed
    write; chunks filled in it join the pending proof job (`PendingProofs`), which reads their
    rows from the store itself (the scheduler copies nothing). This runs for every request at
    every step, so a run that stays inside its chunk (most of them) takes the short path."""
    if not builders:  # a step all the same: finishing requests may wait for the pending job
        _pending.step()
        return
    counts = counts or [1] * len(builders)
    if starts is None:
        starts = [0, *itertools.accumulate(counts[:-1])]
    hidden = rows.shape[-1]
    runs: list[int] = []  # flat (start, first, count) triples (`RowStore.write`)
    for b, start, count in zip(builders, starts, counts):
        slot = b.slot
        if slot is None:
            slot = b.slot = _store.acquire(hidden)
        b.rows_seen += count
        fill = b.fill
        if fill + count < CHUNK_ROWS:
            runs += (start, slot * CHUNK_ROWS + fill, count)
            b.fill = fill + count
            continue
        while count:
            take = min(count, CHUNK_ROWS - b.fill)
            runs += (start, b.slot * CHUNK_ROWS + b.fill, take)
            start += take
            count -= take
            b.fill += take
            if b.fill == CHUNK_ROWS:
                _pending.add(b.chunk_filled(hidden), topk)  # queued at once: its slot is lent from here on
    _store.write(runs, rows, sum(counts))
    _pending.step()


class FinishingBatch:
    """Requests that finished in one output batch, held back from streaming until the proofs of
    all their chunks are built, so that the step in which they finish never waits for proofs.
    Their last partial chunks joined the shared pending job; `ready` looks at the few jobs their
    chunks are in, and `release` then posts each fingerprint."""

    def __init__(self, kept: list[tuple[FingerprintBuilder, Any, Optional[_Chunk]]]) -> None:
        self.kept = kept  # (builder, req, its last partial chunk, if any)
        self.reqs = [req for _, req, _ in kept]
        self.jobs = {chunk.job for builder, _, tail in kept for chunk in (*builder.chunks, tail)
                     if chunk is not None and chunk.proof is None and chunk.job is not None}

    def ready(self) -> bool:
        """Whether every job that builds these requests' proofs is done."""
        return all(job.done() for job in self.jobs)

    def release(self) -> list[Any]:
        """Post the fingerprints (waiting for jobs still running); returns the requests."""
        for builder, req, tail in self.kept:
            try:
                fingerprint = builder.fingerprint(tail.wait() if tail is not None else None)
            except Exception as exc:  # noqa: BLE001 - never the scheduler's end: this response goes without
                logger.error("no fingerprint for request %s: %r", req.rid, exc)
                builder.release()
                continue
            transport.post(req, **{FINGERPRINTS_FIELD: [fingerprint]})
        return self.reqs


_held: list[FinishingBatch] = []
_held_ids: set[int] = set()  # ids of the requests of `_held`, kept as batches come and go


def finish_builders(items: list[tuple[FingerprintBuilder, Any]]) -> list[Any]:
    """Start the fingerprints of requests finishing in one output batch: each covers exactly the
    request's returned output ids. Their last partial chunks join the pending job with the full
    chunks still queued, which then starts within a few steps (`PendingProofs.due`). Returns the
    requests held back until their proofs are built (`release_finished` posts their
    fingerprints); aborted requests and those without output get none and are not held."""
    kept = []
    for builder, req in items:
        if isinstance(req.finished_reason, FINISH_ABORT):
            builder.release()
            continue
        returned = len(req.output_ids_through_stop)
        if returned == 0:
            builder.release()  # nothing generated (a prefill, e.g. sglang's shared prefix of n > 1)
            continue
        try:
            tail = builder.tail(returned)
        except FingerprintError as exc:
            logger.error("no fingerprint for request %s: %s", req.rid, exc)
            builder.release()
            continue
        if tail is not None:
            _pending.add(tail, builder.topk)
        builder.done = True  # no more rows; a later output batch holding the request again skips it
        kept.append((builder, req, tail))
    if not kept:
        return []
    batch = FinishingBatch(kept)
    _held.append(batch)
    _held_ids.update(map(id, batch.reqs))
    if _pending.future in batch.jobs:
        try:
            _pending.due()
        except Exception as exc:  # noqa: BLE001 - never the scheduler's end: the held requests report it
            logger.error("the proof job of %d finishing requests failed to start: %r", len(kept), exc)
    return batch.reqs


def release_finished(wait: bool = False) -> list[Any]:
    """Requests held by `finish_builders` whose proofs are done (all of them with `wait`, which
    first starts the pending job they may be waiting for), oldest first, with their
    fingerprints posted: they are ready to stream."""
    if wait and _held:
        _pending.flush()
    ready: list[Any] = []
    while _held and (wait or _held[0].ready()):
        released = _held.pop(0).release()
        _held_ids.difference_update(map(id, released))
        ready += released
    return ready


def holds_requests() -> bool:
    """Whether finished requests wait for their fingerprints."""
    return bool(_held)


def held_ids() -> set[int]:
    """ids of the requests held back (with the overlap schedule a finished request also shows up
    in the next batch's outputs: it must not be streamed there without its fingerprint). The
    live set, kept as requests are held and released (this is asked at every step while any
    are held): read it, do not change it."""
    return _held_ids


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
