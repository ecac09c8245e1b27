"""A benchmark-only sglang plugin: a TOPLOC server with part of its work switched off, to see
what each part costs (never for serving: responses lose their fingerprints).

Found only when this folder is on PYTHONPATH; `SGLANG_RL_TOPLOC_ABLATION` picks the part:

* `no_builders`: no request gets a fingerprint builder, so only the server-wide capture mode of
  --toploc-verification remains (every batch and CUDA graph captures LAST rows);
* `no_rows`: requests get builders and raise their capture mode (sglang keeps each step's rows
  for them), and the hooks run, but no row reaches the store and no proof is built;
* `no_jobs`: the rows are written to the store as when on, but no proof job starts and no
  finishing request is held;
* `no_finish`: the full chunks' proof jobs run as when on, but finishing requests start no job of
  their own and are not held.

And variants that switch nothing off:

* `high_priority`: the proof jobs run on a stream of the device's highest priority;
* `paired`: a request gets no fingerprint builder while the file named by
  `SGLANG_RL_TOPLOC_PAIRED_FLAG` exists (as `no_builders`), so one process can alternate its timed
  runs between TOPLOC on and, in effect, off (`bench_toploc.py --paired`). With
  `SGLANG_RL_TOPLOC_PAIRED_CLONE` set, while the file of that name plus `.clone` exists, each
  step's kept rows are a fresh clone instead of a view of the row ring
  (`bench_toploc.py --paired --compare-clone`; unset, no step looks for that file).

    PYTHONPATH=$PYTHONPATH:benchmark/toploc_ablation SGLANG_RL_TOPLOC_ABLATION=no_rows \\
        python benchmark/bench_toploc.py ... --modes on
"""

from __future__ import annotations

import os
from typing import Any

TOPLOC = "sglang_rl.adapters.toploc"


def _no_builder(*args: Any, **kwargs: Any) -> None:
    return None


def _paired(original: Any, *args: Any, **kwargs: Any) -> Any:
    """`state_for_request` while the flag file is absent; no TOPLOC state at all (so no builder)
    while it exists. The paired runs only generate, so no verification request meets it."""
    if os.path.exists(os.environ["SGLANG_RL_TOPLOC_PAIRED_FLAG"]):
        return None
    return original(*args, **kwargs)


def _paired_keep(original: Any, rows: Any) -> Any:
    """`keep_rows`, or while the `.clone` flag exists a clone of the rows, as before the ring."""
    if not os.path.exists(os.environ["SGLANG_RL_TOPLOC_PAIRED_FLAG"] + ".clone"):
        return original(rows)
    from sglang_rl.adapters import toploc

    return toploc.clone_kept(rows)


def _no_rows(*args: Any, **kwargs: Any) -> None:
    return None


def _nothing_held(items: list) -> list:
    for builder, _ in items:
        builder.release()
    return []


def _no_job(future: Any, parts: list, topk: int, finish: Any) -> None:
    """`_start` without a job: the staged rows are written as a job would have them written, and
    the job is done at once (its chunks get empty proofs, which nothing reads here)."""
    from sglang_rl.adapters import toploc

    toploc._store.flush()
    future.set_result(finish([b""] * len(parts)))


def register() -> None:
    """Entry point: replace the switched-off part with a no-op (or raise the proof stream's
    priority)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    part = os.environ.get("SGLANG_RL_TOPLOC_ABLATION")
    if part == "no_builders":
        HookRegistry.register(f"{TOPLOC}.state_for_request", _no_builder, HookType.REPLACE)
    elif part == "no_rows":
        HookRegistry.register(f"{TOPLOC}.add_builder_rows", _no_rows, HookType.REPLACE)
        HookRegistry.register(f"{TOPLOC}.finish_builders", _nothing_held, HookType.REPLACE)
    elif part == "no_jobs":
        HookRegistry.register(f"{TOPLOC}._start", _no_job, HookType.REPLACE)
        HookRegistry.register(f"{TOPLOC}.finish_builders", _nothing_held, HookType.REPLACE)
    elif part == "no_finish":
        HookRegistry.register(f"{TOPLOC}.finish_builders", _nothing_held, HookType.REPLACE)
    elif part == "paired":
        HookRegistry.register(f"{TOPLOC}.state_for_request", _paired, HookType.AROUND)
        if os.environ.get("SGLANG_RL_TOPLOC_PAIRED_CLONE"):
            HookRegistry.register(f"{TOPLOC}.keep_rows", _paired_keep, HookType.AROUND)
    elif part == "high_priority":
        from sglang_rl.adapters import toploc

        toploc.PROOF_STREAM_PRIORITY = -100  # clamped to the device's highest
    elif part:
        raise ValueError(f"SGLANG_RL_TOPLOC_ABLATION={part!r}: expected one of "
                         "no_builders, no_rows, no_jobs, no_finish, high_priority, paired")
