"""Engine-agnostic EAGLE-1/2 and EAGLE3 drafter core in plain torch (no sglang import).

* :class:`EagleDrafter` (model.py): the one-layer draft model; its forward is what
  sglang 0.5.17's ``LlamaForCausalLMEagle`` / ``Qwen2ForCausalLMEagle`` compute.
* :class:`Eagle3Drafter` (eagle3_model.py): the same for ``LlamaForCausalLMEagle3``; its
  loss is in eagle3_loss.py, its folders in eagle3.py.
* :func:`eagle_loss` (loss.py): SmoothL1 on rows plus soft cross-entropy through the
  frozen head, with an optional reduced vocabulary.
* :class:`AlignedSample` (sample.py): one generation's rows on its token columns;
  :func:`select_window` (window.py), :func:`build_eagle_batch` (batch.py) and
  :class:`HiddenStateReplayBuffer` (buffer.py) turn samples into training batches.
* :class:`DrafterTrainer` (trainer.py): AdamW training on ``build_eagle_batch`` batches, with
  the objective of the drafter's kind (objectives.py).
* :func:`init_drafter`, :func:`save_drafter`, :func:`load_drafter`, :func:`sglang_weights`
  (checkpoint.py): folders sglang loads with ``--speculative-draft-model-path``.
* :func:`greedy_draft_chain` (chain.py): sglang's ``topk = 1`` chain drafting.
* ``sglang-rl drafter init --model-path DIR --out DIR`` (cli.py).
"""

from sglang_rl.drafter.batch import build_eagle_batch
from sglang_rl.drafter.buffer import HiddenStateReplayBuffer, tensor_nbytes
from sglang_rl.drafter.chain import DraftChain, greedy_draft_chain
from sglang_rl.drafter.checkpoint import (
    INIT_SCHEMES,
    WEIGHTS_FILE,
    DrafterCheckpointError,
    init_drafter,
    load_drafter,
    read_draft_weights,
    save_drafter,
    sglang_weights,
)
from sglang_rl.drafter.config import DRAFT_ARCHITECTURES, DrafterConfig, DrafterConfigError
from sglang_rl.drafter.data import batches_from_samples, sample_from_rows
from sglang_rl.drafter.eagle3_model import Eagle3Drafter
from sglang_rl.drafter.loss import EagleLossConfig, LossOutput, SoftTargets, eagle_loss, soft_targets
from sglang_rl.drafter.model import EagleDrafter
from sglang_rl.drafter.sample import AlignedSample
from sglang_rl.drafter.target_weights import TargetHead, load_target_head
from sglang_rl.drafter.trainer import DrafterTrainer, PreparedBatch
from sglang_rl.drafter.window import DEFAULT_WINDOW, select_window

__all__ = [
    "DEFAULT_WINDOW",
    "AlignedSample",
    "HiddenStateReplayBuffer",
    "build_eagle_batch",
    "select_window",
    "tensor_nbytes",
    "DRAFT_ARCHITECTURES",
    "INIT_SCHEMES",
    "WEIGHTS_FILE",
    "DraftChain",
    "DrafterCheckpointError",
    "DrafterConfig",
    "DrafterConfigError",
    "DrafterTrainer",
    "Eagle3Drafter",
    "EagleDrafter",
    "EagleLossConfig",
    "LossOutput",
    "PreparedBatch",
    "SoftTargets",
    "TargetHead",
    "batches_from_samples",
    "eagle_loss",
    "greedy_draft_chain",
    "init_drafter",
    "load_drafter",
    "load_target_head",
    "read_draft_weights",
    "sample_from_rows",
    "save_drafter",
    "sglang_weights",
    "soft_targets",
]
