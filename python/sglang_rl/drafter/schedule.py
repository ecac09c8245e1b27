"""Learning-rate schedule of drafter co-training, counted in rounds.

Co-training has no fixed horizon (it runs as long as the server serves), so the schedule is
a linear warm-up over ``warmup`` rounds, then an optional cosine decay over ``cosine`` rounds
down to ``floor`` x the base rate, then constant at that floor. Without warm-up and decay it is
the constant base rate. Written as a flag: ``"warmup=1,cosine=16,floor=0.1"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LrSchedule"]


@dataclass(frozen=True)
class LrSchedule:
    """Multiplier of the base learning rate at a (fractional) round; see the module docstring."""

    warmup: float = 0.0
    cosine: float = 0.0
    floor: float = 1.0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.cosine < 0:
            raise ValueError(f"lr schedule: warmup and cosine must be >= 0 rounds, got {self}")
        if not 0 <= self.floor <= 1:
            raise ValueError(f"lr schedule: floor must be in [0, 1], got {self.floor}")

    @classmethod
    def parse(cls, text: str | None) -> "LrSchedule":
        """``"warmup=1,cosine=16,floor=0.1"`` (any subset; empty or None: constant)."""
        if not text or text == "constant":
            return cls()
        values: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("warmup", "cosine", "floor"):
                raise ValueError(f"lr schedule {text!r}: expected warmup=R,cosine=R,floor=F, got {part!r}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"lr schedule {text!r}: {key} is not a number") from None
        if "cosine" in values and "floor" not in values:
            values["floor"] = 0.1
        return cls(**values)

    @property
    def constant(self) -> bool:
        return self.warmup == 0 and (self.cosine == 0 or self.floor == 1)

    def factor(self, rounds: float) -> float:
        """Multiplier for the step that completes ``rounds`` rounds (fractional; > 0)."""
        if self.warmup > 0 and rounds < self.warmup:
            return rounds / self.warmup
        done = rounds - self.warmup
        if self.cosine > 0 and done < self.cosine:
            return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * done / self.cosine))
        return self.floor if self.cosine > 0 else 1.0
