"""sglang-rl inside verl: the activation hook, verl's rollout server and trainer with the plugin's
results (activate.py, server.py, trainer.py), the rollout sample and its audit, and the placement
of a generation's rows on verl's padded batch row (alignment.py).

The drafter's own data (samples, windows, batches, the replay buffer) lives in `sglang_rl.drafter`.
Importing this package does not import verl.
"""

from sglang_rl.integrations.verl.alignment import (
    REFUSAL_REASONS,
    AlignmentRefused,
    AlignmentStats,
    GenerationRows,
    align_batch,
    align_sample,
)

__all__ = [
    "REFUSAL_REASONS",
    "AlignmentRefused",
    "AlignmentStats",
    "GenerationRows",
    "align_batch",
    "align_sample",
]
