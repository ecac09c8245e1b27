"""Co-training's rows of one request: the window of the last rows the target computed for it.

Routed by the scheduler's prefill and decode hooks like user-requested rows (`adapters.scheduler`),
kept as runs of each decode step's one shared copy, and turned into a training sample once the
request has finished (`adapters.cotrain`).
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch

from sglang_rl.adapters.decode_step import DecodeStep
from sglang_rl.drafter.messages import RolloutSample
from sglang_rl.hidden_states.prefill_chunks import join_prefill_chunks


class CotrainRows:
    """The last `window` rows of one request, kept in memory for its training sample.

    Rows are kept as runs `(block, first, count, position)`, rows `block[first:first+count]` at
    positions `position..`: a decode step's run references the step's one copy of the kept rows
    that every request of the step shares (`DecodeStep.keep_copy`), so keeping costs no tensor op
    per request (benchmark/bench_cotrain_host.py). It is a `RowSink` (adapters/request_state.py)."""

    stores = True  # only a rank that sends outputs creates one (`CotrainRuntime.adopt`)
    needs_prompt_rows = True  # the prompt's rows train too, as far as the window reaches
    takes_captured_rows = True  # what the draft reads: an EAGLE3 target's auxiliary layers
    wants_final_row = False  # the last token's row would predict a token that was never sampled

    def __init__(self, prompt_len: int, window: int) -> None:
        self.prompt_len = prompt_len
        self.window = window
        self.runs: collections.deque[tuple[torch.Tensor, int, int, int]] = collections.deque()
        self.kept = 0
        self._prefill: list[torch.Tensor] = []
        self.done = False
        self.ids: list[int] = []
        self.policy_version = 0

    def prefix_limit(self) -> Optional[int]:
        """No limit: co-training takes the prompt rows that were computed, whatever the radix
        cache served."""
        return None

    def add_prefill(self, rows: torch.Tensor, last_chunk: bool, end: Optional[int] = None) -> None:
        """Rows of one prefill chunk (chunks end at position `end`, default the prompt length)."""
        block = join_prefill_chunks(self._prefill, rows, last_chunk)
        if block is not None:
            end = self.prompt_len if end is None else end
            block = block[-self.window:].clone()  # never hold a view of a whole batch's rows
            self.keep_run(block, 0, block.shape[0], end - block.shape[0])

    def add_decode(self, step: DecodeStep, start: int, count: int, position: int) -> None:
        """Rows of a decode step: a run of the step's one shared copy."""
        step.keep_copy(self.keep_run, start, count, position)

    def keep_run(self, kept: torch.Tensor, first: int, count: int, position: int) -> None:
        """Rows `kept[first:first+count]` at positions from `position`. Whole old runs go once the
        rest holds `window` rows beyond this step's (a speculative step's last rows may lie past
        the finish, which sglang decides afterwards)."""
        self.runs.append((kept, first, count, position))
        self.kept += count
        while len(self.runs) > 1 and self.kept - self.runs[0][2] >= self.window + count:
            self.kept -= self.runs.popleft()[2]

    def close(self, req: Any, policy_version: int) -> None:
        """The request finished: keep its tokens and the policy version that produced them."""
        self.done = True
        self.ids = list(req.origin_input_ids) + list(req.output_ids_through_stop)
        self.policy_version = policy_version

    def sample(self) -> Optional[RolloutSample]:
        """The training sample of the closed request: the longest run of consecutive rows (at
        most `window`) that ends at its last committed token's input. Rows past the finish are
        dropped; where positions repeat (a retracted request computes them again) the newest win."""
        ids = self.ids
        end = len(ids) - 1  # the last token's row would predict a token that was never sampled
        need, taken, pieces = end - 1, 0, []
        for block, first, count, position in reversed(self.runs):
            if taken >= self.window:
                break
            if position > need:
                continue  # past the finish, or computed before a retraction
            if position + count - 1 < need:
                break  # a gap: the rows before it are not consecutive with the newer ones
            hi = need - position + 1
            lo = max(0, hi - (self.window - taken))
            pieces.append(block[first + lo:first + hi])
            taken += hi - lo
            need = position + lo - 1
        self.runs.clear()
        if not taken:
            return None
        rows = torch.cat(pieces[::-1]) if len(pieces) > 1 else pieces[0]
        start = end - taken
        # bf16 on the wire: the trainer trains on bf16 rows (`sample_from_rows`), and half the bytes cross
        return RolloutSample(input_ids=torch.tensor(ids[start:end], dtype=torch.long), rows=rows.to(torch.bfloat16),
                             response_start=max(self.prompt_len - start, 0), policy_version=self.policy_version)
