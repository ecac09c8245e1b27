"""Scheduler -> API channel for per-request results (fingerprints, validation reports, ...).

sglang forwards `customized_info` from the scheduler's output batches through the detokenizer to
the tokenizer manager, which accumulates it into `meta_info[key]`. We use one key whose value for a
request is a list of payload dicts (zero or one per output batch), so a result can travel even for
a prefill-only request that produced no output token. The API side merges the dicts in order.
"""

from __future__ import annotations

from typing import Any, Callable

KEY = "sglang_rl"
_PENDING_ATTR = "_sglang_rl_pending_payload"


def post(req: Any, **fields: Any) -> None:
    """Queue fields for the next output batch that carries `req`."""
    pending = getattr(req, _PENDING_ATTR, None)
    if pending is None:
        pending = {}
        setattr(req, _PENDING_ATTR, pending)
    pending.update(fields)


def accept_around(original: Callable, accumulator: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND `_GenerationStreamAccumulator.accept`: attach the request's queued payload."""
    req = kwargs.get("req", args[0] if args else None)
    before = len(accumulator.rids)
    original(accumulator, *args, **kwargs)
    if len(accumulator.rids) == before:
        return
    pending = getattr(req, _PENDING_ATTR, None)
    entries = accumulator.customized_info.get(KEY)
    if entries is None:
        if not pending:
            return
        entries = [[] for _ in range(len(accumulator.rids) - 1)]
        entries.append([])
        accumulator.customized_info[KEY] = entries
    entries[-1] = [pending] if pending else []
    if pending:
        setattr(req, _PENDING_ATTR, None)


def collect(meta_info: dict) -> dict:
    """Pop the channel from a meta_info and return the merged payload (empty if none)."""
    merged: dict = {}
    for payload in meta_info.pop(KEY, None) or ():
        if isinstance(payload, dict):
            merged.update(payload)
    return merged
