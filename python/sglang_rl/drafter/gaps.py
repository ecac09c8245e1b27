"""Training in the serving loop's idle gaps.

A co-training process on the serving GPU competes with the rollouts it learns from. With a gate,
the trainer runs an optimizer step only while the server is idle (between rollout bursts, e.g.
while an RL trainer updates the policy), and waits otherwise; `max_wait_s` bounds the waiting of
one round, so that a server that never idles still trains. The server sets `idle` (a
multiprocessing Event) on its busy/idle transitions. With `busy_share` < 1 the steps a round
takes while the server is busy (its waiting budget spent) are paced to that share of the time, so
that a server that never idles gives training a bounded part of the GPU.
"""

from __future__ import annotations

import time
from typing import Any, Optional


class IdleGate:
    """Blocks the trainer's next optimizer step until the server is idle or the round's waiting
    budget is spent; then, while the server stays busy, paces the steps so that training computes
    at most ``busy_share`` of the time. ``waited_s`` is the round's time spent waiting or paced
    (reset by ``new_round``)."""

    def __init__(self, idle: Any, max_wait_s: float, busy_share: float = 1.0) -> None:
        self.idle = idle
        self.max_wait_s = float(max_wait_s)
        self.busy_share = float(busy_share)
        self.waited_s = 0.0
        self.step_started: Optional[float] = None

    def new_round(self) -> None:
        self.waited_s = 0.0
        self.step_started = None

    def wait(self) -> None:
        """Called before each optimizer step."""
        start = time.perf_counter()
        budget = self.max_wait_s - self.waited_s
        if budget > 0 and not self.idle.is_set():
            self.idle.wait(timeout=budget)
        if not self.idle.is_set() and self.busy_share < 1 and self.step_started is not None:
            # the previous step computed for (start - step_started): rest in proportion, unless idle comes first
            self.idle.wait(timeout=(start - self.step_started) * (1 - self.busy_share) / self.busy_share)
        self.step_started = time.perf_counter()
        self.waited_s += self.step_started - start
