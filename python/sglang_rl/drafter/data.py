"""Training inputs for the drafter, all through the verl helpers' one packing path.

A plain sample (token ids, one hidden row per token, where the response starts) becomes an
:class:`~sglang_rl.drafter.sample.AlignedSample`, and every batch is made by
:func:`~sglang_rl.drafter.batch.build_eagle_batch` (windowing, shift-by-one, packing
and ``cu_seqlens`` live there only).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sglang_rl.drafter.batch import build_eagle_batch
from sglang_rl.drafter.sample import AlignedSample
from sglang_rl.drafter.window import DEFAULT_WINDOW

__all__ = ["batches_from_samples", "sample_from_rows"]


def sample_from_rows(input_ids: Any, hidden_states: torch.Tensor, response_start: int) -> AlignedSample:
    """One generation as an :class:`AlignedSample`.

    ``input_ids [L]`` are prompt + response tokens. ``hidden_states [L, H]`` holds the target's
    row for each token, i.e. the row from which the next token was sampled. ``response_start``
    is the index of the first response token; pairs whose target token lies before it take
    no loss, but they still act as attention context.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).detach().to("cpu").reshape(-1)
    rows = torch.as_tensor(hidden_states).detach().to("cpu")
    n = ids.numel()
    if rows.dim() != 2 or rows.shape[0] != n:
        raise ValueError(f"hidden_states {tuple(rows.shape)} must be [{n}, H] for {n} tokens")
    if not 0 <= response_start <= n:
        raise ValueError(f"response_start {response_start} outside [0, {n}]")
    if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
        raise ValueError("hidden_states contain NaN or infinity")
    is_response = torch.arange(n) >= response_start
    return AlignedSample(
        input_ids=ids,
        hidden_states=rows.to(torch.bfloat16),
        row_mask=torch.ones(n, dtype=torch.bool),
        loss_mask=is_response.to(torch.float32),
        token_start=0,
        token_end=n,
        response_start=int(response_start),
    )


def batches_from_samples(
    samples: Sequence[AlignedSample],
    window: int = DEFAULT_WINDOW,
    samples_per_batch: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Pack ``samples`` with ``build_eagle_batch``, ``samples_per_batch`` at a time (all at
    once when None); groups with no usable sample are dropped."""
    if samples_per_batch is not None and samples_per_batch < 1:
        raise ValueError(f"samples_per_batch must be >= 1, got {samples_per_batch}")
    step = samples_per_batch or max(len(samples), 1)
    out = []
    for i in range(0, len(samples), step):
        batch = build_eagle_batch(samples[i : i + step], window=window)
        if batch is not None:
            out.append(batch)
    return out
