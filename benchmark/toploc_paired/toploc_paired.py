"""A benchmark-only sglang plugin for `bench_toploc.py --paired`: lets one TOPLOC process switch
its requests' fingerprinting off and on between timed runs (never for serving).

`bench_toploc.py --paired` puts this folder on the path of its Engine's processes and sets
`SGLANG_RL_TOPLOC_PAIRED_FLAG`; without that variable the plugin does nothing. While the file it
names exists, a request gets no TOPLOC state, so no fingerprint builder: only the server-wide
capture mode of --toploc-verification remains (TOPLOC off, in effect). With
`SGLANG_RL_TOPLOC_PAIRED_CLONE` set, while the file of that name plus `.clone` exists, each
step's kept rows are a fresh clone instead of a view of the row ring (`--compare-clone`): the
scheduler's `FingerprintPipeline.keep_rows` is wrapped, for every pipeline of the process.
"""

from __future__ import annotations

import os
from typing import Any

TOPLOC = "sglang_rl.adapters.toploc"
PIPELINE = "sglang_rl.fingerprint.pipeline.FingerprintPipeline"


def _paired(original: Any, *args: Any, **kwargs: Any) -> Any:
    """`builder_for_request` while the flag file is absent; no TOPLOC state at all (so no builder)
    while it exists. The paired runs only generate, so no verification request meets it."""
    if os.path.exists(os.environ["SGLANG_RL_TOPLOC_PAIRED_FLAG"]):
        return None
    return original(*args, **kwargs)


def _paired_keep(original: Any, pipeline: Any, rows: Any) -> Any:
    """`pipeline.keep_rows`, or while the `.clone` flag exists a clone of the rows."""
    if not os.path.exists(os.environ["SGLANG_RL_TOPLOC_PAIRED_FLAG"] + ".clone"):
        return original(pipeline, rows)
    from sglang_rl.fingerprint.row_ring import clone_kept

    return clone_kept(rows)


def register() -> None:
    """Entry point: wrap `builder_for_request` (and with the clone variable, `keep_rows`)."""
    if not os.environ.get("SGLANG_RL_TOPLOC_PAIRED_FLAG"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{TOPLOC}.builder_for_request", _paired, HookType.AROUND)
    if os.environ.get("SGLANG_RL_TOPLOC_PAIRED_CLONE"):
        HookRegistry.register(f"{PIPELINE}.keep_rows", _paired_keep, HookType.AROUND)
