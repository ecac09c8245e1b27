"""The server's EAGLE draft model (EAGLE-1/2 or EAGLE3) as the draft-only weight updates see it:
found behind sglang's speculative worker, its parameters described in drafter checkpoint terms
(names, full shapes, the pieces of fused ones, the tensors it shares with the target), and its
shared tensors kept equal to the target's after a target update. An EAGLE-1/2 draft shares the
target's embedding and LM head; an EAGLE3 draft shares only the embedding (its LM head over the
draft vocabulary is its own, and trained).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang_rl.draft_weight_check import DraftWeightSpec, ParamInfo

logger = logging.getLogger(__name__)

NO_DRAFT = ("this server has no draft model: start it with --speculative-algorithm EAGLE "
            "--speculative-draft-model-path DIR for draft-only weight updates")


def _eagle_draft_classes() -> tuple[type, ...]:
    from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.qwen2_eagle import Qwen2ForCausalLMEagle

    return LlamaForCausalLMEagle, Qwen2ForCausalLMEagle, LlamaForCausalLMEagle3


def is_eagle3(eagle: Any) -> bool:
    """Whether the draft found by :func:`find_eagle_draft` is an EAGLE3 one."""
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    return isinstance(getattr(getattr(eagle, "draft_runner", None), "model", None), LlamaForCausalLMEagle3)


def find_eagle_draft(draft_worker: Any) -> tuple[Optional[Any], str]:
    """(sglang's EagleDraftWorker, "") when the server's draft is an EAGLE-1/2 Llama/Qwen2 or an
    EAGLE3 Llama drafter, else (None, why draft-only updates cannot serve this server)."""
    if draft_worker is None:
        return None, NO_DRAFT
    inner = getattr(draft_worker, "draft_worker", None)
    runner = getattr(inner, "draft_runner", None)
    if runner is None:
        return None, f"this server's speculative worker ({type(draft_worker).__name__}) has no draft model to update"
    classes = _eagle_draft_classes()
    if not isinstance(runner.model, classes):
        names = ", ".join(c.__name__ for c in classes)
        return None, (f"draft-only updates support EAGLE drafters ({names}); "
                      f"this server's draft is {type(runner.model).__name__}")
    return inner, ""


def _checkpoint_name(param_name: str) -> str:
    """Draft parameter name -> the checkpoint name its loader takes (EAGLE drafters prefix every
    name but lm_head with ``model.``)."""
    return param_name.removeprefix("model.")


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are one (the draft's embedding and head are normally the target's)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _param_info(model: torch.nn.Module, param_name: str, param: torch.Tensor) -> ParamInfo:
    """A draft parameter in checkpoint terms: full shape, and the pieces of a fused one."""
    from sglang.srt.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module_name, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    name = _checkpoint_name(param_name)
    if isinstance(module, VocabParallelEmbedding):  # an EAGLE3 head: padded and sharded in memory
        return ParamInfo(name, (module.org_vocab_size, module.embedding_dim))
    if leaf not in ("weight", "bias") or not isinstance(module, LinearBase):
        return ParamInfo(name, tuple(param.shape))
    parts = local = None
    if isinstance(module, QKVParallelLinear):
        kv = module.total_num_kv_heads
        parts = (module.total_num_heads * module.head_size, kv * module.head_size, kv * module.v_head_size)
        local = (module.q_proj_shard_size, module.kv_proj_shard_size, module.v_proj_shard_size)
    elif isinstance(module, MergedColumnParallelLinear):
        parts = tuple(int(s) for s in module.output_sizes)
        local = tuple(s // module.tp_size for s in parts)
    out_size = sum(parts) if parts else module.output_size
    shape = (out_size, module.input_size) if leaf == "weight" else (out_size,)
    return ParamInfo(name, shape, parts, local)


def draft_spec(eagle: Any) -> tuple[DraftWeightSpec, dict[str, torch.Tensor]]:
    """The loadable tensors of the live draft model, and its parameters by checkpoint name."""
    model = eagle.draft_runner.model
    embed, head = eagle.target_worker.model_runner.model.get_embed_and_head()
    own_head = is_eagle3(eagle)
    params: dict[str, torch.Tensor] = {}
    infos: list[ParamInfo] = []
    shared: dict[str, str] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        name = _checkpoint_name(param_name)
        params[name] = param
        if same_tensor(param, embed) or same_tensor(param, head):
            shared[name] = "the draft uses the target's embedding and LM head, which a target update changes"
        elif "lm_head" in name.split(".") and not own_head:
            shared[name] = "sglang's EAGLE-1/2 draft loader never loads an lm_head"
        else:
            infos.append(_param_info(model, param_name, param))
    return DraftWeightSpec.from_params(infos, shared), params


def resync_shared_tensors(eagle: Any) -> None:
    """Make the draft's embedding (and an EAGLE-1/2 draft's LM head) equal the target's again
    after a target update.

    They are normally the target's own tensors, updated in place with it (nothing to do). Under
    --speculative-token-map the draft's head is a row-subset copy, refreshed here in place so that
    the draft's CUDA graphs keep pointing at it. An EAGLE3 draft's head is its own: left as it is."""
    embed, head = eagle.target_worker.model_runner.model.get_embed_and_head()
    draft_embed, draft_head = eagle.draft_runner.model.get_embed_and_head()
    hot = getattr(eagle, "hot_token_id", None)
    pairs = [(draft_embed, embed)]
    if not is_eagle3(eagle):
        pairs.append((draft_head, head if hot is None else head[hot]))
    with torch.no_grad():
        for dst, src in pairs:
            if same_tensor(dst, src):
                continue
            if dst.shape != src.shape:
                logger.warning("draft tensor %s is not a copy of the target's %s; left as it is",
                               tuple(dst.shape), tuple(src.shape))
                continue
            dst.data.copy_(src)
