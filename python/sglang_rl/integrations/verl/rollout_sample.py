"""A random sample of verl's rollouts, written with their fingerprints for a later audit.

A verifier checks a fingerprint against the exact token ids it was built on. verl keeps the
fingerprint (`extra_fields`) but turns its samples into padded tensors, so an audit after the run
reads a sample that the rollout server writes as it goes: one JSON line per sampled rollout,
`{"request_id", "global_steps", "input_ids", "output_ids", "toploc_verification_fingerprints"}`.

Turned on in verl's Ray settings (each server writes its own file in the folder):

    +ray_kwargs.ray_init.runtime_env.env_vars.SGLANG_RL_ROLLOUT_SAMPLE_DIR=/path/to/folder
    +ray_kwargs.ray_init.runtime_env.env_vars.SGLANG_RL_ROLLOUT_SAMPLE_RATE=0.05   # default 0.05
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path
from typing import Optional, Sequence

from sglang_rl.request_options import FINGERPRINTS_FIELD

DIR_ENV = "SGLANG_RL_ROLLOUT_SAMPLE_DIR"
RATE_ENV = "SGLANG_RL_ROLLOUT_SAMPLE_RATE"
DEFAULT_RATE = 0.05


class RolloutSample:
    """Appends a random fraction of fingerprinted rollouts to one JSON-lines file."""

    def __init__(self, path: Path, rate: float, seed: Optional[int] = None) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"{RATE_ENV} must be in (0, 1], got {rate}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.rate = path, rate
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, name: str) -> Optional["RolloutSample"]:
        """The sample this process writes as `<dir>/<name>.jsonl`, or None when not asked for."""
        folder = os.environ.get(DIR_ENV)
        if not folder:
            return None
        return cls(Path(folder) / f"{name}.jsonl", float(os.environ.get(RATE_ENV, DEFAULT_RATE)))

    def offer(self, request_id: str, global_steps: int, input_ids: Sequence[int], output_ids: Sequence[int],
              record: dict) -> bool:
        """Write this rollout with probability `rate` (only a fingerprinted one); True if written."""
        if FINGERPRINTS_FIELD not in record or self._random.random() >= self.rate:
            return False
        line = json.dumps({"request_id": request_id, "global_steps": global_steps,
                           "input_ids": list(map(int, input_ids)), "output_ids": list(map(int, output_ids)),
                           FINGERPRINTS_FIELD: record[FINGERPRINTS_FIELD]})
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
        return True
