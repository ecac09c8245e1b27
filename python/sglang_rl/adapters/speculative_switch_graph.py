"""The target's plain-decode CUDA graph for the speculation switch's off steps.

A speculative server captures its target's decode graphs in TARGET_VERIFY mode (draft_token_num
tokens per request), so a plain decode cannot replay them. At start-up the switch captures one
more set for ForwardMode.DECODE, one token per request, with its own attention backend (as
sglang's adaptive speculation builds one per step count), while the model runner is told it
serves no speculation. Off steps swap the runner's graph and backend for these. Without a CUDA
device or with graphs off there is nothing to capture and off steps run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)


@dataclass
class PlainDecodeGraph:
    runner: Any
    attn_backend: Any


def capture_plain_decode_graph(worker: Any) -> Optional[PlainDecodeGraph]:
    """The target's DECODE-mode graph runner and backend, or None (no CUDA graphs here)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    from sglang.srt.utils.common import is_cuda

    runner = worker.target_worker.model_runner
    if not is_cuda() or check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED) or runner.decode_cuda_graph_runner is None:
        return None
    from sglang.srt.model_executor.runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    saved = runner.spec_algorithm, runner.attn_backend, runner.init_new_workspace
    try:
        runner.spec_algorithm = SpeculativeAlgorithm.NONE  # a plain server's backend, DECODE graphs
        backend = runner._get_attention_backend(init_new_workspace=True)
        runner.init_new_workspace = saved[2]
        runner.attn_backend = backend
        graph = DecodeCudaGraphRunner(runner, attn_backend=backend, speculative_num_steps=0,
                                      speculative_num_draft_tokens=1)
    except Exception:  # an unsupported backend: off steps stay correct, only eager
        logger.exception("speculation switch: no plain-decode CUDA graph, off steps run eagerly")
        return None
    finally:
        runner.spec_algorithm, runner.attn_backend, runner.init_new_workspace = saved
    return PlainDecodeGraph(graph, backend)
