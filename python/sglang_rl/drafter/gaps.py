"""Training in the serving loop's idle gaps.

A co-training process on the serving GPU competes with the rollouts it learns from. With a gate,
the trainer runs an optimizer step only while the server is idle (between rollout bursts, e.g.
while an RL trainer updates the policy), and waits otherwise; `max_wait_s` bounds the waiting of
one round, so that a server that never idles still trains. The server sets `idle` (a
multiprocessing Event) on its busy/idle transitions.
"""

from __future__ import annotations

import time
from typing import Any


class IdleGate:
    """Blocks the trainer's next optimizer step until the server is idle or the round's waiting
    budget is spent. ``waited_s`` is the round's time spent waiting (reset by ``new_round``)."""

    def __init__(self, idle: Any, max_wait_s: float) -> None:
        self.idle = idle
        self.max_wait_s = float(max_wait_s)
        self.waited_s = 0.0

    def new_round(self) -> None:
        self.waited_s = 0.0

    def wait(self) -> None:
        """Called before each optimizer step."""
        budget = self.max_wait_s - self.waited_s
        if budget <= 0 or self.idle.is_set():
            return
        start = time.perf_counter()
        self.idle.wait(timeout=budget)
        self.waited_s += time.perf_counter() - start
