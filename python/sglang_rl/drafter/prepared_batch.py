"""The batch a drafter trains on, prepared once per optimizer step (by ``trainer.py``, read by the
objectives in ``objectives.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_rl.drafter.loss import SoftTargets


@dataclass(frozen=True)
class PreparedBatch:
    """A ``build_eagle_batch`` dict on the model's device and dtype, flattened to ``[N]`` /
    ``[N, H]``, with the target side of the loss (:class:`SoftTargets`) computed once.

    ``target`` and ``loss_mask`` are the objective's (``objectives.py``): EAGLE-1/2 the next
    rows and the batch's mask; EAGLE3 the draft-id labels and weights that drop unlabelled pairs."""

    input_ids: torch.Tensor
    hidden_states: torch.Tensor
    target: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    soft: SoftTargets

    @property
    def num_pairs(self) -> int:
        """Pairs in the batch (masked or not)."""
        return int(self.input_ids.shape[0])

    @property
    def num_loss_pairs(self) -> int:
        """Pairs with a positive loss weight."""
        return int((self.loss_mask > 0).sum())
