"""EAGLE draft attention for sglang's torch_native backend (CPU test stand-in, not the plugin).

sglang's DraftBackendFactory knows no torch_native draft backends. EAGLE's draft model needs two:
- draft decode: `speculative_num_steps - 1` forwards, each of `bs * topk` single-token rows;
  row (request b, branch t) at step i sees the request's committed prefix [0, seq_len) and its
  branch's draft slots req_to_token[r, seq_len + t * num_steps + j] for j <= i (the layout of
  sglang's draft cache locations, page size 1);
- draft extend (DRAFT_EXTEND_V2 after verify, EXTEND after prefill): plain causal extend over
  prefix + new tokens, which TorchNativeAttnBackend.forward_extend already computes from
  extend_prefix_lens / extend_seq_lens / seq_lens.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc


class DraftDecodeStepBackend(TorchNativeAttnBackend):
    """Attention of one draft-decode step; its rows' KV tables are set by the multi-step owner."""

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        self.step_req_to_token: torch.Tensor | None = None  # [rows' table, width]
        self.step_rows: torch.Tensor | None = None  # row of step_req_to_token per query row
        self.step_seq_lens: torch.Tensor | None = None  # visible KV length per query row

    def init_forward_metadata(self, forward_batch) -> None:
        """Metadata comes from TorchNativeMultiStepDraftBackend.init_forward_metadata."""

    def forward_extend(self, *args, **kwargs):
        raise NotImplementedError("a draft-decode step backend only runs decode forwards")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if layer.is_cross_attention or (
            layer.sliding_window_size is not None and layer.sliding_window_size > -1
        ):
            raise NotImplementedError("draft attention stand-in: no cross/sliding-window attention")
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v
            )
        self._run_sdpa_forward_decode(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.step_req_to_token,
            self.step_rows,
            self.step_seq_lens,
            None,
            scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            causal=False,
            is_cross_attn=False,
            sliding_window_size=None,
        )
        return o


class TorchNativeMultiStepDraftBackend:
    """Per-step draft-decode backends (`attn_backends[i]` serves draft step i), as sglang's
    EAGLE worker expects of a multi-step draft backend."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int) -> None:
        if model_runner.token_to_kv_pool_allocator.page_size != 1 and topk > 1:
            raise NotImplementedError("draft attention stand-in: topk > 1 needs page size 1")
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.attn_backends = [
            DraftDecodeStepBackend(model_runner) for _ in range(speculative_num_steps - 1)
        ]

    def init_forward_metadata(self, forward_batch) -> None:
        topk, num_steps = self.topk, self.speculative_num_steps
        req_to_token = self.req_to_token_pool.req_to_token
        seq_lens = forward_batch.seq_lens.to(torch.int64)  # committed prefix per request
        rows = forward_batch.req_pool_indices.to(torch.int64)
        if topk == 1:
            # the branch's draft slots directly follow the prefix in the request's own row
            table = req_to_token
        else:
            table, rows = self._branch_tables(req_to_token, rows, seq_lens)
        per_row_len = seq_lens.repeat_interleave(topk)
        for step, backend in enumerate(self.attn_backends):
            backend.step_req_to_token = table
            backend.step_rows = rows
            backend.step_seq_lens = per_row_len + step + 1

    def _branch_tables(self, req_to_token, rows, seq_lens):
        """One KV table row per (request, branch): the prefix, then the branch's draft slots."""
        topk, num_steps = self.topk, self.speculative_num_steps
        bs = rows.shape[0]
        width = int(seq_lens.max()) + num_steps if bs else num_steps
        table = torch.zeros((bs * topk, width), dtype=req_to_token.dtype, device=req_to_token.device)
        for b, (r, n) in enumerate(zip(rows.tolist(), seq_lens.tolist())):
            for t in range(topk):
                table[b * topk + t, :n] = req_to_token[r, :n]
                start = n + t * num_steps
                table[b * topk + t, n : n + num_steps] = req_to_token[r, start : start + num_steps]
        return table, torch.arange(bs * topk, dtype=torch.int64, device=req_to_token.device)
