"""A benchmark-only sglang plugin: the scheduler thread's time in each phase of its loop.

It is found only when this folder is on PYTHONPATH (its dist-info declares the entry point), so a
benchmark turns it on for both modes of a comparison alike:

    PYTHONPATH=benchmark/scheduler_timing:$PYTHONPATH SGLANG_RL_PHASE_TIMING_DIR=/tmp/t python ...

Each scheduler process writes `<dir>/phases-<pid>.json` (the seconds of every call, per phase,
since start) whenever its loop goes idle after running a batch, so the file holds every finished batch. The phases are
the calls of sglang's overlap loop (`Scheduler.event_loop_overlap`); the times include the
sglang-rl hooks inside them. Hooks on the same function nest in the order plugins load, which
follows sys.path: put this folder after the sglang-rl package so that `on_idle` includes the
plugin's wait for held proofs.
"""

from __future__ import annotations

import json
import os
import statistics
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
    "copy_to_cpu": "sglang.srt.managers.utils.GenerationBatchResult.copy_to_cpu",
    # every wait for the device on the host (sglang's wait for a step's results, a proof
    # job waited for): what is left of a phase without it is host work
    "gpu_wait": "torch.cuda.streams.Event.synchronize",
}
RL = "sglang_rl.adapters.toploc"
RL_PHASES = {
    "rl.add_builder_rows": f"{RL}.add_builder_rows",
    "rl.store_write": f"{RL}.RowStore.write",
    "rl.store_flush": f"{RL}.RowStore.flush",
    "rl.proof_launch": "sglang_rl.fingerprint.device_prover.DeviceProver.launch",
    "rl.finish_builders": f"{RL}.finish_builders",
    "rl.release_finished": f"{RL}.release_finished",
    "rl.proofs_read": "sglang_rl.fingerprint.device_prover.LaunchedProofs.proofs",
    "rl.fingerprint": f"{RL}.FingerprintBuilder.fingerprint",
    "rl.hidden_rows": "sglang_rl.adapters.scheduler._hidden_rows",
    "rl.finish_rows": "sglang_rl.adapters.scheduler._finish_rows",
    "rl.stream_held": "sglang_rl.adapters.scheduler._stream_held",
}
"""sglang-rl's TOPLOC work inside the phases above (they nest: the store's write and flush run
inside add_builder_rows, a launch inside either; a job's read-back and the fingerprints' encoding
inside release_finished; finish_builders inside _finish_rows, with the other finishing rows'
work), timed when sglang-rl is installed. Module functions are timed where the plugin calls them
through their module (its own hook table holds the hook functions themselves)."""
LONG_S = 0.02
"""A call longer than this is a one-off (a kernel compiled or a CUDA graph captured on first use,
a warm-up batch) and is counted apart, so the steady per-step cost is not swamped by them."""
_calls: dict[str, list[float]] = {name: [] for name in (*PHASES, *RL_PHASES)}
"""Every call's seconds, per phase."""
_dumped_at_step = -1


def _timed(name: str) -> Callable:
    calls = _calls[name]

    def around(original: Callable, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)
            if name == "on_idle":
                _dump()

    return around


def _dump() -> None:
    global _dumped_at_step
    folder = os.environ.get("SGLANG_RL_PHASE_TIMING_DIR")
    step = len(_calls["run_batch"])
    if not folder or step == _dumped_at_step:
        return  # nothing ran since the last dump (an idle loop calls on_idle again and again)
    _dumped_at_step = step
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"phases-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({name: [round(t, 7) for t in calls] for name, calls in _calls.items()}, f)
    os.replace(path + ".tmp", path)


def register() -> None:
    """Entry point: an AROUND timer on each phase."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    targets = dict(PHASES)
    try:
        import sglang_rl  # noqa: F401
    except ImportError:
        pass
    else:
        targets.update(RL_PHASES)
    for name, target in targets.items():
        HookRegistry.register(target, _timed(name), HookType.AROUND)


def _cell(calls: list[float], steps: int) -> str:
    """A phase's steady cost per step (calls under LONG_S), its calls and median call, and the
    long calls apart."""
    short = [t for t in calls if t < LONG_S]
    long = [t for t in calls if t >= LONG_S]
    median = statistics.median(short) * 1e6 if short else 0.0
    text = f"{sum(short) / steps * 1e6:.0f} us/step ({len(short)} calls, median {median:.0f} us"
    return text + (f"; {len(long)} long: {sum(long):.2f} s)" if long else ")")


def main() -> int:
    """Print the phases of each folder given (one per variant, say): the steady host time of each
    phase per scheduler step (run_batch call)."""
    import sys

    folders = sys.argv[1:]
    merged: dict[str, dict[str, list[float]]] = {}
    for folder in folders:
        into = merged[folder] = {}
        for name in sorted(os.listdir(folder)):
            if name.startswith("phases-") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    for phase, calls in json.load(f).items():
                        into.setdefault(phase, []).extend(calls)
    steps = {f: max(len(merged[f].get("run_batch", [])), 1) for f in folders}
    print(f"steady host time per scheduler step (calls under {LONG_S * 1e3:.0f} ms; steps: "
          + ", ".join(f"{os.path.basename(f.rstrip('/'))} {steps[f]}" for f in folders) + ")")
    print("| phase | " + " | ".join(os.path.basename(f.rstrip("/")) for f in folders) + " |")
    print("|---|" + "---|" * len(folders))
    for phase in (*PHASES, *RL_PHASES):
        print(f"| {phase} | " + " | ".join(_cell(merged[f].get(phase, []), steps[f]) for f in folders) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
