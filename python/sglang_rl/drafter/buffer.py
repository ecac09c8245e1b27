"""Cross-step replay buffer for drafter training samples, bounded by tensor bytes.

FastRL's DataBuffer caps the number of samples, but one sample's hidden states range from
a few KB to hundreds of MB (``seq_len x H`` bf16), so a count cap says nothing about host
memory. This buffer caps the total tensor bytes and evicts the oldest samples first.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Mapping

import torch

__all__ = ["HiddenStateReplayBuffer", "tensor_nbytes"]


def tensor_nbytes(obj: Any) -> int:
    """Bytes of all tensors reachable from ``obj`` (tensor, mapping, sequence or dataclass).

    An object with an integer ``nbytes`` attribute (such as ``AlignedSample``) reports its
    own size.
    """
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    own = getattr(obj, "nbytes", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own
    if isinstance(obj, Mapping):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


class HiddenStateReplayBuffer:
    """Samples tagged with the RL step that produced them, oldest evicted first.

    The buffer's current step starts at 0, advances with :meth:`increment_step` and also
    moves up to any larger step passed to :meth:`add`, so callers may either tag samples
    explicitly or rely on the running counter.
    """

    def __init__(self, max_bytes: int) -> None:
        """``max_bytes``: upper bound on the summed tensor bytes of the stored samples."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._items: deque[tuple[int, int, Any]] = deque()
        self._nbytes = 0
        self._current_step = 0
        self.evicted = 0
        self.rejected = 0

    @property
    def nbytes(self) -> int:
        """Summed tensor bytes of the stored samples (never above ``max_bytes``)."""
        return self._nbytes

    @property
    def current_step(self) -> int:
        """The step the next untagged sample is tagged with."""
        return self._current_step

    def __len__(self) -> int:
        return len(self._items)

    def add(self, sample: Any, step: int | None = None) -> bool:
        """Store ``sample`` tagged with ``step`` (default: the current step).

        Older samples are evicted until the new one fits. A sample larger than the whole
        budget is not stored (and evicts nothing); returns whether it was stored.
        """
        if step is None:
            step = self._current_step
        elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self._current_step = max(self._current_step, step)
        size = tensor_nbytes(sample)
        if size > self.max_bytes:
            self.rejected += 1
            return False
        while self._items and self._nbytes + size > self.max_bytes:
            _, old_size, _ = self._items.popleft()
            self._nbytes -= old_size
            self.evicted += 1
        self._items.append((step, size, sample))
        self._nbytes += size
        return True

    def increment_step(self) -> None:
        """Mark the boundary between two RL steps."""
        self._current_step += 1

    def get_all(self) -> list[Any]:
        """All stored samples, oldest first."""
        return [sample for _, _, sample in self._items]

    def get_data_from_last_n_steps(self, n: int) -> list[Any]:
        """Samples tagged with one of the last ``n`` steps (current included), oldest first."""
        if n <= 0:
            return []
        min_step = self._current_step - n + 1
        return [sample for step, _, sample in self._items if step >= min_step]

    def replay(self, n: int, decay: float, exclude: list[Any], generator: torch.Generator) -> list[Any]:
        """Up to ``n`` distinct stored samples not in ``exclude``, drawn at random with weight
        ``decay ** (current_step - step)``: the whole buffer is replayed, newer policies more often."""
        skip = {id(s) for s in exclude}
        pool = [(step, sample) for step, _, sample in self._items if id(sample) not in skip]
        if n <= 0 or not pool:
            return []
        weights = torch.tensor([decay ** (self._current_step - step) for step, _ in pool], dtype=torch.float64)
        picks = torch.multinomial(weights, min(n, len(pool)), replacement=False, generator=generator)
        return [pool[i][1] for i in sorted(picks.tolist())]

    def clear(self) -> None:
        """Drop every sample; the step counter is kept."""
        self._items.clear()
        self._nbytes = 0
