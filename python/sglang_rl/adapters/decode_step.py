"""One decode step's rows on the host, shared out to the row sinks of the step's requests.

Each sink takes its run of the step (`RowSink.add_decode`) in the cheapest way its kind allows:
rows written to files come as one numpy copy from a single host view of the whole step (a tensor
op per request and row cost ~25 us, i.e. ~10% of a 64-request 8B decode step); rows kept by
reference (LAST) cost nothing; the other in-memory sinks (last_n, co-training's windows) share
one copy of the step's rows, taken in one `index_select` instead of a copy per request, and each
keeps its run of it (benchmark/bench_cotrain_host.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from sglang_rl.hidden_states.packing import host_view

KeepRun = Callable[[torch.Tensor, int, int, int], None]
"""`keep_run(kept, first, count, position)`: rows `kept[first:first+count]` at positions from `position`."""


class DecodeStep:
    """The host rows (`[n, H]`, a copy sglang will not reuse) of one decode step."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self._view: Optional[np.ndarray] = None
        self._copies: list[tuple[KeepRun, int, int, int]] = []

    def host_view(self) -> np.ndarray:
        """The step's rows as one host array, made once for every sink that writes files."""
        if self._view is None:
            self._view = host_view(self.rows)
        return self._view

    def keep_copy(self, keep_run: KeepRun, start: int, count: int, position: int) -> None:
        """Rows `start .. start+count-1` go to `keep_run` from the step's one shared copy
        (`copy_out`), at positions from `position`."""
        self._copies.append((keep_run, start, count, position))

    def copy_out(self) -> None:
        """Take the one copy of the rows that `keep_copy` asked for, and hand each its run."""
        if not self._copies:
            return
        index = torch.tensor([start + j for _, start, count, _ in self._copies for j in range(count)],
                             device=self.rows.device)
        kept = self.rows.index_select(0, index)
        offset = 0
        for keep_run, _, count, position in self._copies:
            keep_run(kept, offset, count, position)
            offset += count
        self._copies = []


def add_decode_rows(items: list[tuple[Any, int, int, int]], rows: torch.Tensor) -> None:
    """One decode step's rows (host `[n, H]`): item `(sink, start, count, position)` gives the
    sink rows `start .. start+count-1` at positions `position ..` (count > 1 when a speculative
    step commits several tokens)."""
    step = DecodeStep(rows)
    for sink, start, count, position in items:
        sink.add_decode(step, start, count, position)
    step.copy_out()
