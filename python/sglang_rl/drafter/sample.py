"""One generation's hidden-state rows laid out on its token columns: the drafter's training sample.

Every source of samples (a server's rollouts, verl's padded batch) produces this; windows,
batches and the replay buffer consume it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AlignedSample:
    """One sample's rows laid out on the columns of its (possibly trimmed) batch row.

    Shapes (S = number of columns, ``P + R`` for an untrimmed verl row):
        input_ids:     ``[S]`` int64, the batch row's token ids (padding included).
        hidden_states: ``[S, H]`` bfloat16, the row whose input token is in that column;
                       zeros where no row exists.
        row_mask:      ``[S]`` bool, True where a row exists.
        loss_mask:     ``[S]`` float32, 1 where a row exists and its column is a response
                       token.
    ``token_start``/``token_end`` bound the real (non-padding) tokens and
    ``response_start`` is the first response column.
    """

    input_ids: torch.Tensor
    hidden_states: torch.Tensor
    row_mask: torch.Tensor
    loss_mask: torch.Tensor
    token_start: int
    token_end: int
    response_start: int

    @property
    def nbytes(self) -> int:
        """Bytes held by the sample's tensors (what the replay buffer budgets)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.input_ids, self.hidden_states, self.row_mask, self.loss_mask)
        )

    @property
    def row_span(self) -> tuple[int, int]:
        """``(first, last + 1)`` columns that hold rows; ``(0, 0)`` when there are none."""
        cols = torch.nonzero(self.row_mask).flatten()
        if cols.numel() == 0:
            return (0, 0)
        return (int(cols[0]), int(cols[-1]) + 1)

    def trimmed(self) -> "AlignedSample":
        """Copy without the padding columns, so a replay buffer does not store zero rows."""
        a, b = self.token_start, self.token_end
        return replace(
            self,
            input_ids=self.input_ids[a:b].clone(),
            hidden_states=self.hidden_states[a:b].clone(),
            row_mask=self.row_mask[a:b].clone(),
            loss_mask=self.loss_mask[a:b].clone(),
            token_start=0,
            token_end=b - a,
            response_start=self.response_start - a,
        )
