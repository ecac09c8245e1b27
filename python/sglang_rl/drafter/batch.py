"""Pack aligned samples into one padding-free EAGLE training batch.

EAGLE's drafter learns ``(f_t, x_{t+1}) -> f_{t+1}``: from the target model's row at
position ``t`` and the token that was sampled from it, predict the next row. Each
sample's window is turned into such pairs *before* the windows are concatenated, so no
pair straddles two samples (FastRL shifts after concatenating, which pairs the last row
of one sample with the first of the next). Sequence boundaries are returned as
``cu_seqlens`` for variable-length attention, so nothing is padded.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_rl.drafter.sample import AlignedSample
from sglang_rl.drafter.window import DEFAULT_WINDOW, select_window

__all__ = ["build_eagle_batch"]


def _sample_pairs(
    sample: AlignedSample, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(input_ids, hidden, target, loss_mask) pairs of one sample's window, or None if
    it has fewer than two rows."""
    first, stop = sample.row_span
    if stop - first < 2:
        return None
    response_start = min(max(sample.response_start, first), stop)
    win = select_window(stop - first, response_start - first, window)
    cols = slice(first + win.start, first + win.stop)
    ids = sample.input_ids[cols]
    hidden = sample.hidden_states[cols]
    has_row = sample.row_mask[cols]
    loss = sample.loss_mask[cols].to(torch.float32)
    pair_loss = loss[1:] * has_row[:-1].to(torch.float32)
    return ids[1:], hidden[:-1], hidden[1:], pair_loss


def build_eagle_batch(
    samples: Sequence[AlignedSample], window: int = DEFAULT_WINDOW
) -> dict[str, torch.Tensor] | None:
    """Build one packed batch; ``None`` when no sample has at least two rows.

    With ``L`` = total pairs over the used samples (a window of ``w`` rows gives
    ``w - 1`` pairs), ``H`` = hidden size and ``S`` = number of used samples, pair ``i``
    of a sample whose window starts at column ``c`` is:

    * ``input_ids``     ``[1, L]`` int64: token at column ``c + i + 1``, the token sampled
      from the input row (EAGLE's "next token id").
    * ``hidden_states`` ``[1, L, H]`` bfloat16: row at column ``c + i`` (drafter input).
    * ``target``        ``[1, L, H]`` bfloat16: row at column ``c + i + 1``.
    * ``loss_mask``     ``[1, L]`` float32: 1 when both rows exist and the target row's
      token is a response token.
    * ``position_ids``  ``[1, L]`` int64: ``i``, restarting at 0 for every sample (each
      window is attended to as its own sequence; rotary attention only sees differences).
    * ``cu_seqlens``    ``[S + 1]`` int32: cumulative pair counts, the sequence
      boundaries for variable-length attention.
    """
    parts = [p for p in (_sample_pairs(s, window) for s in samples) if p is not None]
    if not parts:
        return None
    lengths = torch.tensor([p[0].numel() for p in parts], dtype=torch.int32)
    cu_seqlens = torch.zeros(len(parts) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    position_ids = torch.cat([torch.arange(int(n), dtype=torch.long) for n in lengths])
    return {
        "input_ids": torch.cat([p[0] for p in parts]).to(torch.long).unsqueeze(0),
        "hidden_states": torch.cat([p[1] for p in parts]).to(torch.bfloat16).unsqueeze(0),
        "target": torch.cat([p[2] for p in parts]).to(torch.bfloat16).unsqueeze(0),
        "loss_mask": torch.cat([p[3] for p in parts]).unsqueeze(0),
        "position_ids": position_ids.unsqueeze(0),
        "cu_seqlens": cu_seqlens,
    }
