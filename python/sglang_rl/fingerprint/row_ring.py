"""A fixed buffer that a GPU server's kept rows are copied into, back to back.

Each decode step's rows are copied out of the forward's output buffer (which the next forward
overwrites) and wait, staged, until the row store writes many steps of them with one indexed
copy. A fresh tensor per step costs the allocator's work each step, a cudaMalloc after sglang's
`flush_cache` empties the cache, and a concatenation at every flush. Copied into one buffer
instead, consecutive steps' rows lie side by side: a flush reads them as one view.

A region is handed out again once the view over it is garbage and the reads of it have passed:
the row store drops its staged views as soon as it has issued the copy that reads them, and
`fence`s the ring with an event recorded after that copy; a dead view's region is reused only
once the latest fence has passed (device work on one stream finishes in order, and a view dies
only after the copy that reads it was issued, so that fence comes after every read of it). The
host waits for a step's results before it drops a view it never staged, so a write into a reused
region never meets an earlier write still in flight either.

`RowRings` holds a pipeline's rings, one per kind of rows, and makes the kept copies
(`RowRings.keep`).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Iterable, NamedTuple, Optional

import torch

from sglang_rl.fingerprint.settings import RING_BYTES

logger = logging.getLogger(__name__)

SPAN_ATTR = "_sglang_rl_ring_span"
"""Set on each view `RowRing.copy` returns: (ring, first row, end row)."""
KEPT_ATTR = "_sglang_rl_kept"
"""Set on every kept copy (`RowRings.keep`, `clone_kept`): the row store may stage it."""


class RowRing:
    """`capacity` rows of one width and dtype on one device, handed out in order as views.
    A piece larger than a quarter of the buffer (a long prefill's rows) is refused, and so is
    one that does not fit before the oldest live view: the caller then copies it elsewhere."""

    def __init__(self, capacity: int, like: torch.Tensor) -> None:
        self.data = torch.empty(capacity, *like.shape[1:], dtype=like.dtype, device=like.device)
        self.capacity = capacity
        self._live: deque[tuple] = deque()  # (first, end, weakref to the view) of each view, oldest first
        self._tail = 0  # where the newest view ends
        self._fence = None  # an event after the reads issued so far (`fence`); None once passed

    def copy(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """A view of this buffer holding a copy of `rows` (made on the current stream), or None
        when there is no room for them now (or ever: over a quarter of the buffer). The caller
        matches rows to a ring of their dtype, width and device."""
        n = rows.shape[0]
        if not 0 < n <= self.capacity // 4:
            return None
        first = self._place(n)
        if first is None:
            return None
        view = self.data[first : first + n]
        view.copy_(rows)
        self._live.append((first, first + n, weakref.ref(view)))  # free once the view is gone
        self._tail = first + n
        setattr(view, SPAN_ATTR, (self, first, first + n))
        return view

    def _place(self, n: int) -> Optional[int]:
        """The first row of a free region of n rows after the newest view, wrapping to the start
        when the end is too close; None when the oldest live views are in the way."""
        live = self._live
        while live and live[0][2]() is None:
            if self._fence is not None:
                if not self._fence.query():
                    break
                self._fence = None
            live.popleft()
        if not live:
            return 0
        head = live[0][0]
        if live[-1][0] >= head:  # the live views do not wrap: free after them, then before them
            if n <= self.capacity - self._tail:
                return self._tail
            return 0 if n <= head else None
        return self._tail if n <= head - self._tail else None

    def fence(self, event: object) -> None:
        """Device reads of views handed out so far are issued, and `event` (recorded after them,
        all on one stream) says when they are done: no region of a view that dies from here on
        is handed out before it has passed."""
        self._fence = event

    @staticmethod
    def join(parts: list[torch.Tensor]) -> Joined:
        """`parts` with each run of views that follow each other in one ring merged into one
        view (the same rows in the same order, in as few tensors as the buffer allows); the
        parts that are no ring's views; and the rings of the others."""
        pieces: list[list] = []  # [ring or None, first, end, the part, parts merged]
        for part in parts:
            span = getattr(part, SPAN_ATTR, None)
            last = pieces[-1] if pieces else None
            if span is not None and last is not None and span[0] is last[0] and span[1] == last[2]:
                last[2] = span[2]
                last[4] += 1
                continue
            pieces.append([*span, part, 1] if span is not None else [None, 0, 0, part, 1])
        return Joined([ring.data[first:end] if merged > 1 else part for ring, first, end, part, merged in pieces],
                      [part for ring, _, _, part, _ in pieces if ring is None],
                      {id(ring): ring for ring, *_ in pieces if ring is not None}.values())


class Joined(NamedTuple):
    """What `RowRing.join` makes of some parts."""

    pieces: list[torch.Tensor]
    loose: list[torch.Tensor]  # the parts that are no ring's views
    rings: Iterable[RowRing]  # the rings the other parts are views of


def clone_kept(rows: torch.Tensor) -> torch.Tensor:
    """A kept copy without a ring: a tensor of its own, marked as a kept copy."""
    kept = rows.clone()
    setattr(kept, KEPT_ATTR, True)
    return kept


class RowRings:
    """The rings of one pipeline, one per kind of device rows (dtype, width, device index),
    allocated on first use; a kind without a ring (host rows, or no room) maps to None."""

    def __init__(self, ring_bytes: int = RING_BYTES) -> None:
        self.ring_bytes = ring_bytes
        self.by_kind: dict[tuple, Optional[RowRing]] = {}

    def keep(self, rows: torch.Tensor) -> torch.Tensor:
        """A private copy of a step's device rows for the row store, made where the serving loop
        starts the step's host copies (before its copy-done event), so finished once the host
        has waited for that event, as the result hooks do before they route rows. The store may
        stage it for many steps and write it with no stream wait (`RowStore.write`). The copy
        goes into this kind's ring, beside the previous step's; rows that do not fit there (a
        long prefill's, or while the ring is full) get a tensor of their own."""
        kind = (rows.dtype, rows.shape[-1], rows.get_device())
        ring = self.by_kind.get(kind, False)
        if ring is False:
            ring = self.by_kind[kind] = self._new_ring(rows)
        kept = ring.copy(rows) if ring is not None else None
        if kept is None:
            return clone_kept(rows)
        setattr(kept, KEPT_ATTR, True)
        return kept

    def _new_ring(self, rows: torch.Tensor) -> Optional[RowRing]:
        """The ring for device rows like these (None for host rows). Allocated while the server
        runs, out of the memory it leaves free: where `ring_bytes` do not fit, kept rows are
        cloned step by step rather than the step failing."""
        if not (rows.is_cuda and rows.dim() == 2):
            return None
        try:
            return RowRing(self.ring_bytes // (rows.shape[1] * rows.element_size()), rows)
        except torch.cuda.OutOfMemoryError:
            logger.warning("no room for the %d MB row ring: TOPLOC copies each step's rows apart",
                           self.ring_bytes >> 20)
            return None
