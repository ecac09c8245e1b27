"""Outputs of finishing requests, held back from streaming until their proofs are built.

The step in which requests finish never waits for proofs: their last partial chunks join the
pending job, and their outputs wait here (`OutputHold`), one `FinishingBatch` per output batch,
until the few jobs their chunks are in are done; then each fingerprint is posted to its request
and the requests go out, oldest batch first.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from sglang_rl.fingerprint.builder import FingerprintBuilder
from sglang_rl.fingerprint.proof_jobs import Chunk

logger = logging.getLogger(__name__)

Post = Callable[[Any, str], None]
"""Hands a request its fingerprint string (the serving side puts it on the response)."""


class FinishingBatch:
    """Requests that finished in one output batch, held back from streaming until the proofs of
    all their chunks are built, so that the step in which they finish never waits for proofs.
    Their last partial chunks joined the shared pending job; `ready` looks at the few jobs their
    chunks are in, and `release` then posts each fingerprint."""

    def __init__(self, kept: list[tuple[FingerprintBuilder, Any, Optional[Chunk]]], post: Post) -> None:
        self.kept = kept  # (builder, req, its last partial chunk, if any)
        self.post = post
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
                logger.error("no fingerprint for request %s: %r", getattr(req, "rid", req), exc)
                builder.release()
                continue
            self.post(req, fingerprint)
        return self.reqs


class OutputHold:
    """The held batches of one pipeline, oldest first, and the ids of their requests."""

    def __init__(self, post: Post) -> None:
        self.post = post
        self.batches: list[FinishingBatch] = []
        self.ids: set[int] = set()  # ids of the requests of `batches`, kept as batches come and go
        self.releasing = False  # released requests are being streamed now (`FingerprintPipeline.release_to`)

    def hold(self, kept: list[tuple[FingerprintBuilder, Any, Optional[Chunk]]]) -> FinishingBatch:
        """Hold the requests of one output batch until their proofs are built."""
        batch = FinishingBatch(kept, self.post)
        self.batches.append(batch)
        self.ids.update(map(id, batch.reqs))
        return batch

    def release(self, wait: bool) -> list[Any]:
        """The held requests whose proofs are done (all of them with `wait`), oldest first, with
        their fingerprints posted."""
        ready: list[Any] = []
        while self.batches and (wait or self.batches[0].ready()):
            released = self.batches.pop(0).release()
            self.ids.difference_update(map(id, released))
            ready += released
        return ready
