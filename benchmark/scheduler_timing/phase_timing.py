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

In a `bench_toploc.py --paired` process (`SGLANG_RL_TOPLOC_PAIRED_FLAG` set) every call is filed
under the shape and mode of the run it belongs to, read once per loop iteration (at its
`get_next_batch_to_run`) from the flag file and the label file beside it (`<flag>.label`, which
the benchmark writes): the file then holds an "off" and an "on" column per shape of one process,
and the table shows where the on runs spent more time than the off runs beside them. Each
shape's untimed first run is filed apart ("warmup") and left out of the table. The `iteration`
row is the whole loop per step (from one `run_batch` start to the next); `gc` is the time of
Python's garbage collections (`gc.full` those of the oldest generation), wherever they ran.
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
    "rl.keep_rows": f"{RL}.keep_rows",
}
"""sglang-rl's TOPLOC work inside the phases above (they nest: the store's write and flush run
inside add_builder_rows, a launch inside either; a job's read-back and the fingerprints' encoding
inside release_finished; finish_builders inside _finish_rows, with the other finishing rows'
work), timed when sglang-rl is installed. Module functions are timed where the plugin calls them
through their module (its own hook table holds the hook functions themselves)."""
LONG_S = 0.02
"""A call longer than this is a one-off (a kernel compiled or a CUDA graph captured on first use,
a warm-up batch) and is counted apart, so the steady per-step cost is not swamped by them."""
NAMES = ("iteration", *PHASES, "gc", "gc.full", *RL_PHASES)
_by_mode: dict[str, dict[str, list[float]]] = {}
"""Every call's seconds, per phase, per mode ("all" outside a paired run)."""
_calls: dict[str, list[float]] = {}
"""The current mode's calls."""
_last_launch: list[float] = []
"""When the last `run_batch` started (the `iteration` row is the time between two)."""
_dumped_at_step = -1


def _use_mode(mode: str) -> None:
    global _calls
    _calls = _by_mode.setdefault(mode, {name: [] for name in NAMES})


_label = ["", -1]
"""The paired run's label (its shape, or "warmup") and the label file's mtime when it was read."""


def _read_mode() -> None:
    """File the calls from here on under the paired run's shape and mode (off while the flag
    exists); the label file is read again only when it has changed."""
    flag = os.environ.get("SGLANG_RL_TOPLOC_PAIRED_FLAG")
    if not flag:
        return
    try:
        changed = os.stat(flag + ".label").st_mtime_ns
    except OSError:
        changed = 0
    if changed != _label[1]:
        _label[1] = changed
        try:
            with open(flag + ".label") as f:
                _label[0] = f.read().strip()
        except OSError:
            _label[0] = ""
    mode = "off" if os.path.exists(flag) else "on"
    _use_mode("warmup" if _label[0] == "warmup" else f"{_label[0]}:{mode}" if _label[0] else mode)


_gc_started = [0.0]


def _gc(phase: str, info: dict) -> None:
    """gc.callbacks: the time of each collection, under the current mode."""
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _gc_started[0]
    _calls["gc"].append(took)
    if info.get("generation") == 2:
        _calls["gc.full"].append(took)


_use_mode("all")


def _timed(name: str) -> Callable:
    def around(original: Callable, *args: Any, **kwargs: Any) -> Any:
        if name == "get_next_batch_to_run":
            _read_mode()
        start = time.perf_counter()
        if name == "run_batch":
            if _last_launch and start - _last_launch[0] < LONG_S:
                _calls["iteration"].append(start - _last_launch[0])
            _last_launch[:] = [start]
        try:
            return original(*args, **kwargs)
        finally:
            _calls[name].append(time.perf_counter() - start)
            if name == "on_idle":
                _dump()

    return around


def _dump() -> None:
    global _dumped_at_step
    folder = os.environ.get("SGLANG_RL_PHASE_TIMING_DIR")
    step = sum(len(calls["run_batch"]) for calls in _by_mode.values())
    if not folder or step == _dumped_at_step:
        return  # nothing ran since the last dump (an idle loop calls on_idle again and again)
    _dumped_at_step = step
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"phases-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({mode: {name: [round(t, 7) for t in times] for name, times in calls.items()}
                   for mode, calls in _by_mode.items() if calls["run_batch"]}, f)
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
    if os.environ.get("SGLANG_RL_PHASE_TIMING_DIR"):
        import gc

        gc.callbacks.append(_gc)


def _steady_us(calls: list[float], steps: int) -> float:
    """A phase's steady cost per step in us: its calls under LONG_S."""
    return sum(t for t in calls if t < LONG_S) / steps * 1e6


def _cell(calls: list[float], steps: int) -> str:
    """A phase's steady cost per step (calls under LONG_S), its calls and median call, and the
    long calls apart."""
    short = [t for t in calls if t < LONG_S]
    long = [t for t in calls if t >= LONG_S]
    median = statistics.median(short) * 1e6 if short else 0.0
    text = f"{_steady_us(calls, steps):.0f} us/step ({len(short)} calls, median {median:.0f} us"
    return text + (f"; {len(long)} long: {sum(long):.2f} s)" if long else ")")


def main() -> int:
    """Print the phases of each folder given (one per variant, say): the steady host time of each
    phase per scheduler step (run_batch call), then sglang-rl's own per on column
    (`_plugin_summary`)."""
    import sys

    merged: dict[str, dict[str, list[float]]] = {}  # by column: a folder, or a folder's mode
    for folder in sys.argv[1:]:
        label = os.path.basename(folder.rstrip("/"))
        for name in sorted(os.listdir(folder)):
            if name.startswith("phases-") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    for mode, calls in json.load(f).items():
                        if mode == "warmup":
                            continue
                        into = merged.setdefault(label if mode == "all" else f"{label}:{mode}", {})
                        for phase, times in calls.items():
                            into.setdefault(phase, []).extend(times)
    columns = sorted(merged, key=lambda c: (c.rsplit(":", 1)[0], c.endswith(":on")))
    steps = {c: max(len(merged[c].get("run_batch", [])), 1) for c in columns}
    print(f"steady host time per scheduler step (calls under {LONG_S * 1e3:.0f} ms; steps: "
          + ", ".join(f"{c} {steps[c]}" for c in columns) + ")")
    print("| phase | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for phase in NAMES:
        print(f"| {phase} | " + " | ".join(_cell(merged[c].get(phase, []), steps[c]) for c in columns) + " |")
    _plugin_summary(merged, columns, steps)
    return 0


def _plugin_summary(merged: dict[str, dict[str, list[float]]], columns: list[str], steps: dict[str, int]) -> None:
    """One line per "on" column: sglang-rl's own host time per step (steady calls, us): keep_rows,
    add_builder_rows (with the flushes and launches inside it), release_finished plus the held
    streaming (nested calls counted in both, as in the phase rows), finish_builders, their sum;
    the jobs and flushes; and the loop's time per step against the off column beside it."""
    def us(column: str, phase: str) -> float:
        return _steady_us(merged[column].get(phase, []), steps[column])

    on_columns = [c for c in columns if c.endswith(":on") and merged[c].get("rl.keep_rows")]
    if not on_columns:
        return
    print("\nsglang-rl host time per step (us; release + held: release_finished + stream_held)")
    print("| column | keep_rows | add_builder_rows (flush, launch) | release + held | finish_builders | all | "
          "jobs | flushes | iteration off -> on |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in on_columns:
        parts = [us(c, "rl.keep_rows"), us(c, "rl.add_builder_rows"),
                 us(c, "rl.release_finished") + us(c, "rl.stream_held"), us(c, "rl.finish_builders")]
        off = c[: -len(":on")].split("/")[0] + ":off"  # "shape/variant:on" beside "shape:off"
        loop = f"{us(off, 'iteration'):.0f} -> {us(c, 'iteration'):.0f}" if off in merged else ""
        print(f"| {c} | {parts[0]:.0f} | {parts[1]:.0f} ({us(c, 'rl.store_flush'):.0f}, {us(c, 'rl.proof_launch'):.0f})"
              f" | {parts[2]:.0f} | {parts[3]:.0f} | {sum(parts):.0f} | {len(merged[c].get('rl.proof_launch', []))}"
              f" | {len(merged[c].get('rl.store_flush', []))} | {loop} |")


if __name__ == "__main__":
    raise SystemExit(main())
