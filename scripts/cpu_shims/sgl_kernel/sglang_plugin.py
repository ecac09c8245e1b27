"""sglang plugin (entry point group "sglang.srt.plugins") shipped with the CPU stand-in.

sglang's torch_native attention backend has no TARGET_VERIFY (speculative verify) path:
it reads forward_batch.extend_prefix_lens, which verify batches don't carry, and it
would ignore the draft-tree mask anyway. The only CPU backend that supports verify
(intel_amx) is forced back to torch_native on CPUs without AMX. This plugin wraps
TorchNativeAttnBackend.forward_extend so verify batches run through SDPA with
"whole prefix + tree ancestors" visibility; every other mode goes to the original.

EAGLE also needs draft-model attention backends, which sglang's DraftBackendFactory does not
build for torch_native: the factory's two constructors are wrapped to return the ones in
draft_attention.py when the draft's backend resolves to torch_native.

Grammar-constrained decoding with the default xgrammar backend allocates its token bitmask with
pin_memory=True and applies it with GPU-only kernels (raising on CPU): the allocation is made
pageable and CPU logits are masked by xgrammar's own CPU kernel, never leaving a row empty.
"""

import torch
from torch.nn.functional import scaled_dot_product_attention

_TARGET = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
)
_DRAFT_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"
_XGRAMMAR = "sglang.srt.constrained.xgrammar_backend"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _forward_extend_with_verify, HookType.AROUND)
    HookRegistry.register(
        f"{_DRAFT_FACTORY}.create_decode_backend", _draft_decode_backend, HookType.AROUND
    )
    HookRegistry.register(
        f"{_DRAFT_FACTORY}.create_draft_extend_backend", _draft_extend_backend, HookType.AROUND
    )
    # pinned memory needs an accelerator and sglang's xgrammar mask kernels are GPU-only
    HookRegistry.register(f"{_XGRAMMAR}._allocate_token_bitmask", _pageable_bitmask, HookType.REPLACE)
    HookRegistry.register(
        f"{_XGRAMMAR}.XGrammarGrammarBackend.apply_vocab_mask", _apply_bitmask, HookType.AROUND
    )
    HookRegistry.register(
        f"{_XGRAMMAR}.XGrammarGrammar.apply_vocab_mask", _apply_grammar_bitmask, HookType.AROUND
    )


def _pageable_bitmask(vocab_size: int, batch_size: int) -> torch.Tensor:
    import xgrammar

    shape = xgrammar.get_bitmask_shape(batch_size, vocab_size)
    return torch.full(shape, -1, dtype=xgrammar.bitmask_dtype)  # -1: every token allowed


def _apply_bitmask(original, logits, vocab_mask):
    if logits.device.type != "cpu":
        return original(logits, vocab_mask)
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))
    # a row with no token left (grammar and min_new_tokens, say) makes the torch sampler's
    # multinomial raise on NaN and kill the scheduler: leave token 0, which the grammar then
    # rejects, aborting only that request (what greedy decoding's argmax does anyway)
    dead = torch.isneginf(logits).all(dim=-1)
    if dead.any():
        logits[dead, 0] = 0.0


def _apply_grammar_bitmask(original, self, logits, vocab_mask):
    return _apply_bitmask(lambda *a: original(self, *a), logits, vocab_mask)


def _draft_backend_name(factory, field: str) -> str:
    """The backend the factory would pick: --speculative-draft-attention-backend, else the
    phase's backend flag, else --attention-backend (as DraftBackendFactory._create_backend)."""
    return (
        factory.draft_attn_backend
        or getattr(factory.server_args, field)
        or factory.server_args.attention_backend
    )


def _draft_decode_backend(original, self):
    if _draft_backend_name(self, "decode_attention_backend") != "torch_native":
        return original(self)
    if self.speculative_num_steps <= 1:
        return None
    from .draft_attention import TorchNativeMultiStepDraftBackend

    return TorchNativeMultiStepDraftBackend(
        self.draft_model_runner, self.topk, self.speculative_num_steps
    )


def _draft_extend_backend(original, self):
    from sglang.srt.runtime_context import get_spec

    field = (
        "decode_attention_backend"
        if get_spec().speculative_attention_mode == "decode"
        else "prefill_attention_backend"
    )
    if _draft_backend_name(self, field) != "torch_native":
        return original(self)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend(self.draft_model_runner)


def _forward_extend_with_verify(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    save_kv_cache = args[0] if args else kwargs.get("save_kv_cache", True)
    return _verify_attention(self, q, k, v, layer, forward_batch, save_kv_cache)


def _verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache):
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if layer.is_cross_attention or (
        layer.sliding_window_size is not None and layer.sliding_window_size > -1
    ):
        raise NotImplementedError("verify attention stand-in: no cross/sliding-window attention")
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v
        )

    n_draft = forward_batch.spec_info.draft_token_num
    bs = forward_batch.batch_size
    seq_lens = forward_batch.seq_lens.tolist()  # verified tokens; drafts come after them
    mask = forward_batch.spec_info.custom_mask.flatten()
    # CPU builds the tree-only mask [bs, D, D]; CUDA-style full masks are [D, seq_len + D] per request.
    tree_only = mask.numel() == bs * n_draft * n_draft

    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o = q.new_empty(q_.shape[0], layer.tp_q_head_num, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    mask_pos = 0
    for i, prefix in enumerate(seq_lens):
        kv_len = prefix + n_draft
        if tree_only:
            req_mask = torch.cat(
                [
                    torch.ones(n_draft, prefix, dtype=torch.bool, device=mask.device),
                    mask[i * n_draft * n_draft : (i + 1) * n_draft * n_draft].view(n_draft, n_draft),
                ],
                dim=1,
            )
        else:
            req_mask = mask[mask_pos : mask_pos + n_draft * kv_len].view(n_draft, kv_len)
            mask_pos += n_draft * kv_len
        slots = req_to_token[forward_batch.req_pool_indices[i], :kv_len]
        qi = q_[i * n_draft : (i + 1) * n_draft].transpose(0, 1)  # [H, D, d]
        ki = k_cache[slots].transpose(0, 1).to(qi.dtype)  # [Hkv, kv_len, d]
        vi = v_cache[slots].transpose(0, 1).to(qi.dtype)
        out = scaled_dot_product_attention(
            qi.unsqueeze(0),
            ki.unsqueeze(0),
            vi.unsqueeze(0),
            attn_mask=req_mask.bool(),
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
        o[i * n_draft : (i + 1) * n_draft] = out.squeeze(0).transpose(0, 1)
    return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
