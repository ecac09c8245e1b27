"""A benchmark-only sglang plugin: the scheduler thread's time in each phase of its loop.

It is found only when this folder is on PYTHONPATH (its dist-info declares the entry point), so a
benchmark turns it on for both modes of a comparison alike:

    PYTHONPATH=benchmark/scheduler_timing:$PYTHONPATH SGLANG_RL_PHASE_TIMING_DIR=/tmp/t python ...

Each scheduler process writes `<dir>/phases-<pid>.json` (calls and seconds per phase, totals
since start) whenever its loop goes idle, so the file holds every finished batch. The phases are
the calls of sglang's overlap loop (`Scheduler.event_loop_overlap`); the times include the
sglang-rl hooks inside them. Hooks on the same function nest in the order plugins load, which
follows sys.path: put this folder after the sglang-rl package so that `on_idle` includes the
plugin's wait for held proofs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

SCHED = "sglang.srt.managers.scheduler.Scheduler"
PHASES = {
    "process_input_requests": f"{SCHED}.process_input_requests",
    "get_next_batch_to_run": f"{SCHED}.get_next_batch_to_run",
    "run_batch": f"{SCHED}.run_batch",
    "process_batch_result": f"{SCHED}.process_batch_result",
    "launch_batch_sample_if_needed": f"{SCHED}.launch_batch_sample_if_needed",
    "on_idle": f"{SCHED}.on_idle",
}
_totals: dict[str, list[float]] = {name: [0, 0.0] for name in PHASES}
_last_dump = 0.0


def _timed(name: str) -> Callable:
    entry = _totals[name]

    def around(original: Callable, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            if name == "on_idle":
                _dump()

    return around


def _dump() -> None:
    global _last_dump
    folder = os.environ.get("SGLANG_RL_PHASE_TIMING_DIR")
    now = time.monotonic()
    if not folder or now - _last_dump < 0.2:
        return
    _last_dump = now
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"phases-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({name: {"calls": c, "seconds": s} for name, (c, s) in _totals.items()}, f)
    os.replace(path + ".tmp", path)


def register() -> None:
    """Entry point: an AROUND timer on each phase."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name, target in PHASES.items():
        HookRegistry.register(target, _timed(name), HookType.AROUND)


def main() -> int:
    """Print the phases of each folder given (one per mode, say): seconds and calls in all."""
    import sys

    folders = sys.argv[1:]
    totals = {}
    for folder in folders:
        merged: dict[str, list[float]] = {}
        for name in sorted(os.listdir(folder)):
            if name.startswith("phases-") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    for phase, entry in json.load(f).items():
                        into = merged.setdefault(phase, [0, 0.0])
                        into[0] += entry["calls"]
                        into[1] += entry["seconds"]
        totals[folder] = merged
    print("| phase | " + " | ".join(f"{os.path.basename(f.rstrip('/'))} s (calls)" for f in folders) + " |")
    print("|---|" + "---|" * len(folders))
    for phase in PHASES:
        cells = [f"{totals[f].get(phase, [0, 0.0])[1]:.3f} ({totals[f].get(phase, [0, 0])[0]})" for f in folders]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
