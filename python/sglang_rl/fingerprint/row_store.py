"""The row store: the chunk buffers of all generating requests in one tensor, written once a step.

Each generating request fills 32-row chunk slots of one bf16 tensor [slots, 32, H], on the GPU
on a GPU server (rows are written there on the proof stream and proven there), on the host on a
CPU server. A scheduler step writes every request's new rows with one indexed copy; a GPU
server's store stages the private copies of many decode steps and writes them together
(`RowStore.flush`), with one index built in numpy (`staged_index`).
"""

from __future__ import annotations

import contextlib
import itertools
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np
import torch

from sglang_rl.fingerprint.device_prover import DeviceProver, device_index
from sglang_rl.fingerprint.row_ring import KEPT_ATTR, RowRing
from sglang_rl.fingerprint.settings import CHUNK_ROWS, STAGED_BYTES, STAGED_STEPS


def reads_done(job: Future) -> bool:
    """Whether a job no longer needs its slots' rows (a launched device job has queued its reads
    ahead of any later write; a thread job reads until it is done)."""
    if getattr(job, "launched", None) is not None:
        return True
    return Future.done(job)  # a device job not launched has nothing to pick up


class RowStore:
    """Chunk buffers of all generating requests in one tensor [slots, 32, H] (bf16), so that a
    scheduler step writes every request's rows with one indexed copy. On a GPU server it lives on
    the GPU (rows are written there on the proof stream and proven there); on a CPU server on the
    host. A full chunk is not copied out: its slot is lent to the proof job (and kept for a
    speculative cut at finish) while the builder goes on in a fresh slot. The last slot is never
    handed out: a step's rows that no builder takes are written there (`write`), so a GPU step
    scatters all its rows in one copy instead of first gathering those it keeps. `prover`: a GPU
    server's, whose device holds the store and whose stream every use of it runs on."""

    def __init__(self, prover: Optional[DeviceProver] = None, staged_steps: Optional[int] = None) -> None:
        self.prover = prover
        self.data: Optional[torch.Tensor] = None
        self._words: Optional[torch.Tensor] = None  # data's flat rows as int32 words (even H)
        self._free: list[int] = []
        self._lent: dict[Future, list[int]] = {}  # slots a proof job still reads, by job
        self._staged: list[tuple[torch.Tensor, list[int]]] = []  # (rows, runs) not yet written
        self._staged_bytes = 0
        self._quarantined: list[int] = []  # freed while rows were staged: free after the next flush
        self._in_flight: list[tuple[Any, list[torch.Tensor]]] = []  # (event, rows) of GPU writes
        self._events: list[Any] = []  # events of writes that have passed, to record again
        self.staged_steps = staged_steps  # decode steps written together; None: by device

    @property
    def capacity(self) -> int:
        """Slots that can be handed out (all but the discard slot)."""
        return 0 if self.data is None else self.data.shape[0] - 1

    def acquire(self, hidden_size: int) -> int:
        """A free slot for rows of width `hidden_size` (the store grows when none is left)."""
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
            with self.on_stream():
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
        for future in [f for f in self._lent if reads_done(f)]:
            self._free.extend(self._lent.pop(future))

    def on_stream(self) -> Any:
        """The context in which a GPU server touches the store: its prover's side stream."""
        return contextlib.nullcontext() if self.prover is None else self.prover.on_stream()

    def _allocate(self, slots: int, hidden_size: int) -> torch.Tensor:
        """`slots` slots to hand out and the discard slot after them."""
        with self.on_stream():  # allocated on the stream every later use is ordered on
            return torch.empty(slots + 1, CHUNK_ROWS, hidden_size, dtype=torch.bfloat16,
                               device=self.prover.device if self.prover is not None else "cpu")

    def release(self, slot: int, reader: Optional[Future] = None) -> None:
        """Free a slot; one that a pending proof job (`reader`) still reads is freed after it.
        A slot freed while rows are staged (an aborted request's may be among them) is handed
        out again only after they are written, so that they can never land after the rows of
        the slot's next owner (an indexed copy writes duplicate rows in no set order)."""
        if reader is None:
            (self._quarantined if self._staged else self._free).append(slot)
        elif reads_done(reader):
            self._free.append(slot)
        else:
            self._lent.setdefault(reader, []).append(slot)

    def write(self, runs: list[int], rows: torch.Tensor, kept: int) -> None:
        """Store the step's rows: each run, three ints (start, first, count) of the flat list
        `runs`, puts rows[start : start + count] at flat rows first.. (slot * 32 + row in
        chunk); `kept` is the runs' rows in all. Flat ints rather than a tuple per run: nothing
        for Python's collector to track while staged.

        When most rows are kept (a decode step) all of them go in one scatter, those no run takes
        to the discard slot. Kept rows (`RowRings.keep`: a private, finished copy) on the store's
        device are staged instead, and the staged steps written together (`flush`) every
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
        stream's work when `wait`. Kept rows need no wait: they are finished before the host
        reads the step's results, and sglang's scheduler stream is ordered behind the
        forward it has just launched, so waiting for it would hold every flush and proof job, and
        the outputs that end a burst, behind that whole forward. Page-locked host rows cross in
        one asynchronous copy. Device rows made on another stream are kept (not handed back to
        their stream's allocator) until an event says the copy has read them: one event instead
        of a `record_stream` per step. An even hidden size is copied as int32 words, two bf16
        each: the same bits, and on the CPU twice as fast."""
        device = self.data.device
        on_device = parts[0].is_cuda
        producer = torch.cuda.current_stream() if on_device and wait else None
        with self.on_stream():
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


def pick_rows(rows: torch.Tensor, picks: list[int] | range) -> torch.Tensor:
    """rows[picks] for ascending `picks`: a view for a run of rows (all rows, say, in plain
    decoding), else one gather (on the rows' device)."""
    if picks and picks[-1] - picks[0] == len(picks) - 1:
        return rows[picks[0] : picks[-1] + 1]
    return rows.index_select(0, device_index(picks, rows.device))
