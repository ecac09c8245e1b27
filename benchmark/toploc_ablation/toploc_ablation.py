"""A benchmark-only sglang plugin: a TOPLOC server with part of its work switched off, to see
what each part costs (never for serving: responses lose their fingerprints).

Found only when this folder is on PYTHONPATH; `SGLANG_RL_TOPLOC_ABLATION` picks the part:

* `no_builders`: no request gets a fingerprint builder, so only the server-wide capture mode of
  --toploc-verification remains (every batch and CUDA graph captures LAST rows);
* `no_rows`: requests get builders and raise their capture mode (sglang keeps each step's rows
  for them), and the hooks run, but no row reaches the store and no proof is built.

    PYTHONPATH=$PYTHONPATH:benchmark/toploc_ablation SGLANG_RL_TOPLOC_ABLATION=no_rows \\
        python benchmark/bench_toploc.py ... --modes on
"""

from __future__ import annotations

import os
from typing import Any

TOPLOC = "sglang_rl.adapters.toploc"


def _no_builder(*args: Any, **kwargs: Any) -> None:
    return None


def _no_rows(*args: Any, **kwargs: Any) -> None:
    return None


def _nothing_held(items: list) -> list:
    for builder, _ in items:
        builder.release()
    return []


def register() -> None:
    """Entry point: replace the switched-off part with a no-op."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    part = os.environ.get("SGLANG_RL_TOPLOC_ABLATION")
    if part == "no_builders":
        HookRegistry.register(f"{TOPLOC}.state_for_request", _no_builder, HookType.REPLACE)
    elif part == "no_rows":
        HookRegistry.register(f"{TOPLOC}.add_builder_rows", _no_rows, HookType.REPLACE)
        HookRegistry.register(f"{TOPLOC}.finish_builders", _nothing_held, HookType.REPLACE)
    elif part:
        raise ValueError(f"SGLANG_RL_TOPLOC_ABLATION={part!r}: expected no_builders or no_rows")
