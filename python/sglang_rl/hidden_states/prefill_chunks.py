"""A request's prefill rows arrive one chunk at a time (chunked prefill): joined into one block."""

from __future__ import annotations

from typing import Optional

import torch


def join_prefill_chunks(pending: list[torch.Tensor], rows: torch.Tensor, last_chunk: bool) -> Optional[torch.Tensor]:
    """Collect one prefill chunk's rows in `pending`; on the last chunk, all of them as one block
    (pending is emptied). A middle chunk may be a view of its batch's rows: it is kept as a copy."""
    pending.append(rows if last_chunk else rows.clone())
    if not last_chunk:
        return None
    block = torch.cat(pending) if len(pending) > 1 else pending[0]
    pending.clear()
    return block
