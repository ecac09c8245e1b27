"""When a co-training scheduler is idle: the signal its own trainer waits on
(`--drafter-cotrain-train-in-gaps`), and whether its weights are released (verl's colocated mode).
"""

from __future__ import annotations

from typing import Any


def idle_event() -> Any:
    """The Event a scheduler sets while idle, shared with the co-training process it spawns."""
    import multiprocessing

    event = multiprocessing.get_context("spawn").Event()
    event.set()
    return event


def note_idle(event: Any, idle: bool) -> None:
    """Tell the trainer (train_in_gaps) whether the scheduler is idle, on transitions only."""
    if idle != event.is_set():
        event.set() if idle else event.clear()


def weights_released(scheduler: Any) -> bool:
    """Whether the server's weights are released (`release_memory_occupation`, as verl's colocated
    mode does around each update): a copy into them then fails with a CUDA error."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

    updater = getattr(scheduler, "weight_updater", None)
    return GPU_MEMORY_TYPE_WEIGHTS in getattr(updater, "offload_tags", ())
