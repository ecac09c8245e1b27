"""API side of the hidden-state fields: a finished request's rows, delivered in its format.

The scheduler posts a payload per finished request (`adapters.hidden_states`): the wanted
positions and either a handle to the request's shared-memory files or the few rows it kept in
memory. Here, in the API process, `deliver` maps the rows, selects the wanted ones and encodes
them: raw little-endian bytes in base64, upstream-style lists, or tensors for the in-process
Engine. The scheduler thread never encodes, and megabytes of rows never travel through the
detokenizer.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_rl.adapters import transport
from sglang_rl.adapters.hidden_states import PAYLOAD_KEY
from sglang_rl.hidden_states import HiddenStatesFormat, encode_rows, rows_to_list
from sglang_rl.hidden_states.row_segments import discard_handle, read_rows
from sglang_rl.request_options import (
    HIDDEN_STATES_ERROR_FIELD as ERROR_FIELD,
    HIDDEN_STATES_POSITIONS_FIELD as POSITIONS_FIELD,
    HIDDEN_STATES_ROWS_FIELD as ROWS_FIELD,
)

__all__ = ["ERROR_FIELD", "PAYLOAD_KEY", "POSITIONS_FIELD", "ROWS_FIELD", "deliver", "encodes",
           "orphaned_output_before"]


def encodes(payload: Any) -> bool:
    """Whether delivering this payload encodes rows to base64 (the costly format)."""
    return isinstance(payload, dict) and payload.get("format") == HiddenStatesFormat.BASE64.value


def deliver(payload: dict) -> dict:
    """Select the wanted rows and encode them in the requested format."""
    wanted = payload["wanted"]
    fmt = HiddenStatesFormat(payload["format"])
    if "handle" in payload:
        # tensors keep their mapped files; base64 and lists are encoded before this returns, so
        # they read into the delivering thread's reusable buffer
        encoded = fmt is not HiddenStatesFormat.TENSOR
        rows, positions = read_rows(payload["handle"], load=encoded, scratch=encoded)
    else:
        rows, positions = payload["rows"], payload["positions"]
    index = {p: i for i, p in enumerate(positions)}
    missing = [p for p in wanted if p not in index]
    if missing:
        return {ERROR_FIELD: f"rows for positions {missing[:8]} were not captured"}
    pick = [index[p] for p in wanted]
    if not pick:
        rows = torch.empty(0, rows.shape[-1] if rows is not None else 0)
    elif pick != list(range(pick[0], pick[0] + len(pick))):
        rows = rows.index_select(0, torch.tensor(pick))
    else:
        rows = rows[pick[0]:pick[0] + len(pick)]
    if fmt is HiddenStatesFormat.BASE64:
        return {ROWS_FIELD: encode_rows(rows, wanted)}
    if fmt is HiddenStatesFormat.TENSOR:
        return {ROWS_FIELD: rows, POSITIONS_FIELD: wanted}
    return {ROWS_FIELD: rows_to_list(rows), POSITIONS_FIELD: wanted}


def orphaned_output_before(manager: Any, recv_obj: Any) -> None:
    """BEFORE TokenizerManager._handle_batch_output: sglang drops an output whose request state
    is gone (its client went away while the output was in flight), so nobody would read that
    request's row files: unlink them now rather than at the writer's stale-file reaper."""
    rids = getattr(recv_obj, "rids", None) or ()
    gone = [i for i, rid in enumerate(rids) if rid not in manager.rid_to_state]
    info = getattr(recv_obj, "customized_info", None)
    if not gone or info is None:
        return None
    from sglang.srt.managers.io_struct import unwrap_from_pickle

    entries = (unwrap_from_pickle(info) or {}).get(transport.KEY) or []
    for i in gone:
        for payload in (entries[i] if i < len(entries) else None) or ():
            rows = payload.get(PAYLOAD_KEY) if isinstance(payload, dict) else None
            if isinstance(rows, dict) and isinstance(rows.get("handle"), dict):
                discard_handle(rows["handle"])
    return None
