"""The fingerprint pipeline of one serving loop: rows in, fingerprints out, the loop never waiting.

A `FingerprintPipeline` owns everything between a step's rows and a finished request's
fingerprint: the kept copies of device rows (`RowRings`), the row store (`RowStore`), the proof
jobs (`ProofLauncher`, `PendingProofs`; on a GPU server a `DeviceProver` on a side stream of its
own) and the outputs held until their proofs are built (`OutputHold`). A serving loop makes one
and calls it at each step: `keep_rows` where it copies a step's results off the device,
`add_builder_rows` with each step's rows, `finish_builders` with the requests finishing in an
output batch, and `release_finished` (or `release_to`) to stream held outputs once proven.
Per-request state is the request's `FingerprintBuilder`, which the loop keeps with the request.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from sglang_rl.fingerprint.builder import FingerprintBuilder, add_builder_rows, finish_builders
from sglang_rl.fingerprint.device_prover import DeviceProver
from sglang_rl.fingerprint.output_hold import OutputHold, Post
from sglang_rl.fingerprint.proof_jobs import PendingProofs, ProofLauncher
from sglang_rl.fingerprint.row_ring import RowRings
from sglang_rl.fingerprint.row_store import RowStore
from sglang_rl.fingerprint.settings import PipelineSettings

logger = logging.getLogger(__name__)


class FingerprintPipeline:
    """The fingerprint work of one serving loop. `device`: the CUDA device the loop runs on
    (the row store and the proofs go there), None on a CPU server (a host store and a proof
    thread). `post(req, fingerprint)` hands a finished request its fingerprint. `prover`
    replaces the device's own (tests: a CPU prover exercises a GPU server's job bookkeeping)."""

    def __init__(self, device: Optional[torch.device], settings: PipelineSettings, post: Post,
                 prover: Optional[DeviceProver] = None) -> None:
        self.device = device
        self.settings = settings
        self.prover = prover if prover is not None else _device_prover(device, settings.stream_priority)
        self.rings = RowRings()
        self.store = RowStore(self.prover, settings.staged_steps)
        self.launcher = ProofLauncher(self.store, self.prover)
        self.pending = PendingProofs(self.launcher, device is not None, settings.max_chunks,
                                     settings.max_steps, settings.finish_steps)
        self.outputs = OutputHold(post)

    def keep_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A private copy of a step's device rows for the row store (`RowRings.keep`)."""
        return self.rings.keep(rows)

    def add_builder_rows(self, builders: list[FingerprintBuilder], rows: torch.Tensor, topk: int,
                         counts: Optional[list[int]] = None, starts: Optional[list[int]] = None) -> None:
        """One step's rows for its builders (`builder.add_builder_rows`); also a step of the
        pending job's count when no builder has rows."""
        add_builder_rows(self.store, self.pending, builders, rows, topk, counts, starts)

    def finish_builders(self, items: list[tuple[FingerprintBuilder, Any, int]]) -> list[Any]:
        """Start the fingerprints of requests finishing in one output batch, (builder, request,
        tokens returned) each; 0 tokens (an aborted request, or nothing generated) gets none.
        Their last partial chunks join the pending job with the full chunks still queued, which
        then starts within a few steps (`PendingProofs.due`). Returns the requests held back
        until their proofs are built (`release_finished` posts their fingerprints)."""
        kept = finish_builders(self.store, self.pending, items)
        if not kept:
            return []
        batch = self.outputs.hold(kept)
        if self.pending.future in batch.jobs:
            try:
                self.pending.due()
            except Exception as exc:  # noqa: BLE001 - never the scheduler's end: the held requests report it
                logger.error("the proof job of %d finishing requests failed to start: %r", len(kept), exc)
        return batch.reqs

    def release_finished(self, wait: bool = False) -> list[Any]:
        """Requests held by `finish_builders` whose proofs are done (all of them with `wait`,
        which first starts the pending job they may be waiting for), oldest first, with their
        fingerprints posted: they are ready to stream."""
        if wait and self.outputs.batches:
            self.pending.flush()
        return self.outputs.release(wait)

    def release_to(self, send: Callable[[list[Any]], None], wait: bool) -> None:
        """Hand the held requests whose proofs are done (all of them, waiting, with `wait`) to
        `send`, outside any batch's outputs; `releasing` is True meanwhile, so the loop's own
        output hook lets them through untouched."""
        if not self.outputs.batches:
            return
        ready = self.release_finished(wait=wait)
        if not ready:
            return
        self.outputs.releasing = True
        try:
            send(ready)
        finally:
            self.outputs.releasing = False

    @property
    def releasing(self) -> bool:
        """Whether `release_to` is handing released requests to the loop now."""
        return self.outputs.releasing

    def holds_requests(self) -> bool:
        """Whether finished requests wait for their fingerprints."""
        return bool(self.outputs.batches)

    def held_ids(self) -> set[int]:
        """ids of the requests held back (with the overlap schedule a finished request also shows
        up in the next batch's outputs: it must not be streamed there without its fingerprint).
        The live set, kept as requests are held and released (this is asked at every step while
        any are held): read it, do not change it."""
        return self.outputs.ids


def _device_prover(device: Optional[torch.device], priority: int) -> Optional[DeviceProver]:
    """The prover of a GPU server's row store, None on a CPU server (its proofs are built in the
    proof thread, in numpy). It runs on a side stream of its own, so proofs never wait for the
    forward."""
    if device is None or device.type != "cuda":
        return None
    return DeviceProver(device, torch.cuda.Stream(device=device, priority=priority))
