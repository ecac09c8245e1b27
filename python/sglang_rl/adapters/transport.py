"""Scheduler -> API channel for per-request results (fingerprints, validation reports, ...), and the rank that sends them.

sglang forwards `customized_info` from the scheduler's output batches through the detokenizer to
the tokenizer manager, which accumulates it into `meta_info[key]`. We use one key whose value for a
request is a list of payload dicts (zero or one per output batch), so a result can travel even for
a prefill-only request that produced no output token. The API side merges the dicts in order.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang.srt.runtime_context import get_parallel

from sglang_rl.adapters.request_state import peek, state_of

KEY = "sglang_rl"


def sends_outputs() -> bool:
    """Only the first rank of each attention-TP group streams outputs; other ranks hold the same
    rows and skip the work (no host copies, no proofs) on them."""
    try:
        return get_parallel().attn_tp_rank == 0
    except Exception:
        return True


def post(req: Any, **fields: Any) -> None:
    """Queue fields for the next output batch that carries `req`."""
    state = state_of(req)
    if state.pending_payload is None:
        state.pending_payload = {}
    state.pending_payload.update(fields)


def accept_around(original: Callable, accumulator: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND `_GenerationStreamAccumulator.accept`: attach the request's queued payload."""
    req = kwargs.get("req", args[0] if args else None)
    before = len(accumulator.rids)
    original(accumulator, *args, **kwargs)
    if len(accumulator.rids) == before:
        return
    state = peek(req)
    pending = None if state is None else state.pending_payload
    entries = accumulator.customized_info.get(KEY)
    if entries is None:
        if not pending:
            return
        entries = [[] for _ in range(len(accumulator.rids) - 1)]
        entries.append([])
        accumulator.customized_info[KEY] = entries
    entries[-1] = [pending] if pending else []
    if pending:
        state.pending_payload = None


def collect(meta_info: dict) -> dict:
    """Pop the channel from a meta_info and return the merged payload (empty if none)."""
    merged: dict = {}
    for payload in meta_info.pop(KEY, None) or ():
        if isinstance(payload, dict):
            merged.update(payload)
    return merged
