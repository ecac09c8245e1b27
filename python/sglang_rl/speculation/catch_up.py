"""Catch-up of a drafter over the tokens decoded while speculation was off (plain torch).

An EAGLE drafter keeps its own KV: at position p it read the target's row h_p and the token
x_{p+1}. Plain steps write none, so when drafting resumes the drafter is caught up with draft
extends over the rows the target computed on those steps, kept on the device (`OffRows`, one
row per request per step, the newest `capacity` steps). A draft extend covers `width` tokens per
request (the draft token count); older tokens go first, in chunks of `width`, so the last chunk
ends at the newest token and leaves the drafter's next input. `plan_chunks` lays out the chunks
for requests with different numbers of kept tokens (a request that joined later has fewer).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch


class StepRows(NamedTuple):
    pool_index: torch.Tensor  # [bs] the requests' slots (the engine's request pool index)
    position: torch.Tensor  # [bs] position p of the fed token (the row's position)
    rows: torch.Tensor  # [bs, H] the target's row at p
    tokens: torch.Tensor  # [bs] the token sampled from that row (x_{p+1})


class OffRows:
    """The target's rows of the newest `capacity` plain steps, on their device."""

    def __init__(self, capacity: int) -> None:
        self.steps: deque[StepRows] = deque(maxlen=max(capacity, 0) or None)
        self.capacity = capacity

    def add(self, pool_index: torch.Tensor, position: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        if self.capacity > 0:  # copies: a graph replay reuses its output buffers
            self.steps.appendleft(StepRows(pool_index.clone(), position.clone(), rows.clone(), tokens.clone()))

    def clear(self) -> None:
        self.steps.clear()

    def __len__(self) -> int:
        return len(self.steps)

    def gather(self, pool_index: torch.Tensor, position: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a step's requests (`rows`/`tokens`: this step's, age 0): rows [A, bs, H] and tokens
        [A, bs] by age a (position - a), and each request's count of consecutive kept tokens
        [bs] (>= 1). A request missing from a step (or at another position) ends its run there."""
        all_rows, all_tokens, found = [rows], [tokens], []
        for age, step in enumerate(self.steps, start=1):
            match = (pool_index[:, None] == step.pool_index[None, :]) & ((position - age)[:, None] == step.position[None, :])
            hit = match.any(dim=1)
            where = match.to(torch.float32).argmax(dim=1)
            all_rows.append(torch.where(hit[:, None], step.rows[where], torch.zeros_like(rows)))
            all_tokens.append(torch.where(hit, step.tokens[where].to(tokens.dtype), torch.zeros_like(tokens)))
            found.append(hit)
        counts = torch.ones_like(position, dtype=torch.long)
        if found:
            counts = counts + torch.cumprod(torch.stack(found).to(torch.long), dim=0).sum(dim=0)
        return torch.stack(all_rows), torch.stack(all_tokens), counts


class Chunk(NamedTuple):
    newest_age: torch.Tensor  # [bs] age of each request's last token in this chunk
    count: torch.Tensor  # [bs] tokens of each request in this chunk (>= 1)
    ages: torch.Tensor  # [bs, width] age of each slot (slots past count repeat the chunk's newest)


def plan_chunks(counts: torch.Tensor, width: int, max_count: int) -> list[Chunk]:
    """Chunks of at most `width` tokens per request, oldest first, the last ending at age 0, for
    counts of at most `max_count` (known on the host: no wait for the device). A request with no
    token in a chunk repeats its oldest one (rewriting the same draft KV with the same input):
    every request takes part in every chunk with at least one token."""
    n_chunks = -(-max_count // width)
    slots = torch.arange(width, device=counts.device)
    chunks = []
    for r in range(n_chunks):
        low = (n_chunks - 1 - r) * width
        oldest = counts - 1
        newest_valid = torch.clamp(oldest, max=low + width - 1)
        valid = oldest >= low
        top = torch.where(valid, newest_valid, oldest)
        count = torch.where(valid, newest_valid - low + 1, torch.ones_like(counts))
        ages = (top[:, None] - slots[None, :]).clamp(min=torch.where(valid, low, oldest)[:, None])
        chunks.append(Chunk(top, count, ages))
    return chunks
