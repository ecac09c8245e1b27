"""Fingerprint builders: the rows of one generating request, proven chunk by chunk.

The row that sampled output token j (the lm_head input of that step) is written to the request's
slot of the row store (`add_builder_rows`: every request of a step in one indexed write); a full
chunk of 32 rows is queued for the pending proof job while the builder goes on in a fresh slot.
When a request finishes, its last partial chunk joins the same job (`finish_builders`), and its
fingerprint (all proofs, one container string) is encoded once the job is done.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional

import torch

from sglang_rl.fingerprint.codec import FingerprintError, encode_built_proofs
from sglang_rl.fingerprint.proof_jobs import Chunk, PendingProofs
from sglang_rl.fingerprint.row_store import RowStore
from sglang_rl.fingerprint.settings import CHUNK_ROWS

logger = logging.getLogger(__name__)


class FingerprintBuilder:
    """Rows of one generating request, turned into proofs chunk by chunk. Made with the request,
    before it meets a pipeline: it works in the row store and pending job of the pipeline that
    first gives it rows (`bind`)."""

    __slots__ = ("topk", "rows_seen", "slot", "fill", "chunks", "_cut", "done", "store", "pending")

    def __init__(self, topk: int) -> None:
        self.topk = topk
        self.rows_seen = 0
        self.slot: Optional[int] = None
        self.fill = 0
        self.chunks: list[Chunk] = []  # full chunks, in order; only the newest keeps its slot
        self._cut: Optional[Chunk] = None  # a full chunk dropped by a speculative cut (rows read at finish)
        self.done = False
        self.store: Optional[RowStore] = None
        self.pending: Optional[PendingProofs] = None

    def bind(self, store: RowStore, pending: PendingProofs) -> None:
        """Work in this store and pending job from now on (a request meets one pipeline)."""
        self.store, self.pending = store, pending

    def chunk_filled(self, hidden_size: int) -> Chunk:
        """The current slot is full: keep it as the newest full chunk and go on in a fresh slot.
        The previous full chunk's slot goes back to the store once its job has read it."""
        if self.chunks:
            self._retire(self.chunks[-1])
        chunk = Chunk(self.slot)
        self.chunks.append(chunk)
        self.slot = self.store.acquire(hidden_size)
        self.fill = 0
        return chunk

    def _retire(self, chunk: Chunk) -> None:
        if not chunk.released:
            self.store.release(chunk.slot, chunk.job)
            chunk.released = True

    def tail(self, n_rows: int) -> Optional[Chunk]:
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
            return Chunk(self.slot, keep) if keep else None
        self._cut = self.chunks.pop()
        self.pending.take([self._cut])
        keep = CHUNK_ROWS - (excess - self.fill)
        return Chunk(self._cut.slot, keep) if keep else None

    def finish(self, last_proof: Optional[bytes]) -> str:
        """The fingerprint string of this builder alone, starting the pending job at once if it
        holds any of its full chunks (`finish_builders` does the same for a batch, and proves
        its last chunks there too)."""
        queued_in = self.pending.future if self.pending is not None else None
        if queued_in is not None and any(chunk.job is queued_in for chunk in self.chunks):
            self.pending.flush()
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
        if self.pending is None:  # never bound: no rows, no slots
            return
        self.pending.take(self.chunks)
        for chunk in (*self.chunks, self._cut):
            if chunk is not None:
                self._retire(chunk)
        self._cut = None
        self.pending.settle()
        if self.slot is not None:
            self.store.release(self.slot)
            self.slot = None


def add_builder_rows(store: RowStore, pending: PendingProofs, builders: list[FingerprintBuilder],
                     rows: torch.Tensor, topk: int, counts: Optional[list[int]] = None,
                     starts: Optional[list[int]] = None) -> None:
    """Append rows to builders: builder i takes the run rows[starts[i] : starts[i] + counts[i]]
    of the step's rows [N, H] (one row each when counts is None; a speculative step commits a
    run; runs follow each other from row 0 when starts is None). The whole step is one indexed
    write; chunks filled in it join the pending proof job (`PendingProofs`), which reads their
    rows from the store itself (the scheduler copies nothing). This runs for every request at
    every step, so a run that stays inside its chunk (most of them) takes the short path."""
    if not builders:  # a step all the same: finishing requests may wait for the pending job
        pending.step()
        return
    counts = counts or [1] * len(builders)
    if starts is None:
        starts = [0, *itertools.accumulate(counts[:-1])]
    hidden = rows.shape[-1]
    runs: list[int] = []  # flat (start, first, count) triples (`RowStore.write`)
    for b, start, count in zip(builders, starts, counts):
        slot = b.slot
        if slot is None:
            b.bind(store, pending)  # a builder's first rows
            slot = b.slot = store.acquire(hidden)
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
                pending.add(b.chunk_filled(hidden), topk)  # queued at once: its slot is lent from here on
    store.write(runs, rows, sum(counts))
    pending.step()


def finish_builders(store: RowStore, pending: PendingProofs, items: list[tuple[FingerprintBuilder, Any, int]]
                    ) -> list[tuple[FingerprintBuilder, Any, Optional[Chunk]]]:
    """Start the fingerprints of finishing requests, (builder, request, tokens returned) each:
    each covers exactly the request's returned tokens, and its last partial chunk joins the
    pending job with the full chunks still queued. Returns (builder, request, last chunk) of
    those that get a fingerprint; a request that returns no tokens (aborted, or nothing
    generated) gets none, and its slots go back at once."""
    kept = []
    for builder, req, returned in items:
        builder.bind(store, pending)  # a builder that saw no rows still settles the pending job
        if returned == 0:
            builder.release()  # nothing generated (a prefill, e.g. sglang's shared prefix of n > 1)
            continue
        try:
            tail = builder.tail(returned)
        except FingerprintError as exc:
            logger.error("no fingerprint for request %s: %s", getattr(req, "rid", req), exc)
            builder.release()
            continue
        if tail is not None:
            pending.add(tail, builder.topk)
        builder.done = True  # no more rows; a later output batch holding the request again skips it
        kept.append((builder, req, tail))
    return kept
