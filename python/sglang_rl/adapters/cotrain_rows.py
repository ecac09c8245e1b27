"""The rows of one co-training rollout: a collector of the last `window` rows the target
computed for a request, and the training sample they give when the request finishes."""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang_rl.drafter.cotrain import RolloutSample
from sglang_rl.hidden_states import HiddenStatesFormat, HiddenStatesMode, HiddenStatesOptions, HiddenStatesScope


class CotrainRows:
    """The last `window` rows of one request, kept in memory for its training sample."""

    def __init__(self, prompt_len: int, window: int) -> None:
        from sglang_rl.adapters.hidden_states import RowCollector

        options = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR,
                                      scope=HiddenStatesScope.LAST_N, last_n=window)
        # its own attribute on the request, so it never limits the radix cache (prefix_limit
        # applies to user-requested rows only): it takes the prompt rows that were computed
        self.rows = RowCollector(options, prompt_len, stores=True)

    def sample(self, req: Any, policy_version: int) -> Optional[RolloutSample]:
        """The training sample of a finished request: the longest run of consecutive rows that
        ends at its last committed token's input (rows past the finish are dropped)."""
        collector = self.rows
        collector.done = True
        ids = list(req.origin_input_ids) + list(req.output_ids_through_stop)
        end = len(ids) - 1  # the last token's row would predict a token that was never sampled
        index = {p: i for i, p in enumerate(collector.positions)}
        first = end - 1
        if first not in index:
            return None
        while first - 1 in index and end - (first - 1) <= collector.options.last_n:
            first -= 1
        rows = torch.stack([collector.rows[index[p]][0][collector.rows[index[p]][1]]
                            for p in range(first, end)])
        collector.rows, collector.positions = [], []
        return RolloutSample(input_ids=torch.tensor(ids[first:end], dtype=torch.long), rows=rows.float(),
                             response_start=max(len(req.origin_input_ids) - first, 0),
                             policy_version=policy_version)
