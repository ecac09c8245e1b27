"""The fingerprint pipeline's tuning: its constants, with the measurements behind them, and the
settings one pipeline is built with (`PipelineSettings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

CHUNK_ROWS = 32
"""Rows per proof: a request's rows are proven 32 at a time (toploc's decode batching)."""

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
(`FingerprintPipeline.release_finished`). Requests finish a few at a time over many steps (under
speculative decoding even those of one length), and every job costs the scheduler thread
~0.5-0.7 ms: with 4 steps, 64 EAGLE requests of 64-512 tokens started 32 jobs a run on an H100,
with 16 steps 10. A finished output waits at most 16 steps (~65 ms there); the last ones of a
burst not at all."""
RING_BYTES = STAGED_BYTES + STAGED_BYTES // 4
"""The buffer that kept rows are copied into (`RowRing`): the staged rows, whose bytes start a
flush at `STAGED_BYTES`, and the few steps kept meanwhile."""
PROOF_STREAM_PRIORITY = 0
"""Priority of the proof stream (lower is higher; torch clamps it to the device's range). The
default: on an H100 the highest made no job finish sooner beside a forward (docs/design.md,
section 7)."""


@dataclass(frozen=True)
class PipelineSettings:
    """How a pipeline gathers its work; None leaves a value to the defaults of its device."""

    max_chunks: Optional[int] = None
    """Chunks that start a proof job at once (`JOB_CHUNKS` on a GPU server, 64 on a CPU one)."""
    max_steps: Optional[int] = None
    """Steps a proof job waits for more chunks at most (`JOB_STEPS` on a GPU server, else 1)."""
    finish_steps: Optional[int] = None
    """Steps finishing requests may wait for their job (`FINISH_STEPS` on a GPU server, else 0:
    at once)."""
    staged_steps: Optional[int] = None
    """Decode steps the row store writes together (`STAGED_STEPS` for a store on a GPU, else 1)."""
    stream_priority: int = PROOF_STREAM_PRIORITY
    """Priority of a GPU server's proof stream."""
