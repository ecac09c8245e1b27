"""verl-side helpers for EAGLE drafter co-training, usable without verl installed.

Flow: :func:`align_batch` places each generation's hidden-state rows on verl's padded
``input_ids`` row (refusing and counting samples that cannot be placed),
:class:`HiddenStateReplayBuffer` keeps samples across RL steps within a byte budget,
and :func:`build_eagle_batch` packs response-end windows (:func:`select_window`) into
shifted-by-one drafter training pairs.
"""

from sglang_rl.integrations.verl.alignment import (
    REFUSAL_REASONS,
    AlignedSample,
    AlignmentRefused,
    AlignmentStats,
    GenerationRows,
    align_batch,
    align_sample,
)
from sglang_rl.integrations.verl.batch import build_eagle_batch
from sglang_rl.integrations.verl.buffer import HiddenStateReplayBuffer, tensor_nbytes
from sglang_rl.integrations.verl.window import DEFAULT_WINDOW, select_window

__all__ = [
    "DEFAULT_WINDOW",
    "REFUSAL_REASONS",
    "AlignedSample",
    "AlignmentRefused",
    "AlignmentStats",
    "GenerationRows",
    "HiddenStateReplayBuffer",
    "align_batch",
    "align_sample",
    "build_eagle_batch",
    "select_window",
    "tensor_nbytes",
]
