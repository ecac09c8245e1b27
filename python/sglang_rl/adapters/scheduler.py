"""Scheduler-process adapter: attach per-request state and route last-layer rows to it.

Rows come from `logits_output.hidden_states` (the lm_head input, post final norm), which sglang
captures when the batch's CaptureHiddenMode asks for it; requests that need rows raise their own
`return_hidden_states_mode` without setting `return_hidden_states`, so upstream's per-token
`.tolist()` never runs for them. Rows are routed *before* sglang's own result processing (which
ends by streaming outputs), and per-request results are finalised as each output is sent.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.runtime_context import get_parallel, get_server_args

from sglang_rl.adapters import toploc, transport
from sglang_rl.request_options import options_of

STATE_ATTR = "_sglang_rl_toploc"


def server_capture_mode_after(result: CaptureHiddenMode, server_args: Any) -> CaptureHiddenMode:
    """AFTER get_server_return_hidden_states_mode: TOPLOC needs at least LAST for every batch
    (this is also the mode CUDA graphs are captured with, so graphs stay usable)."""
    if getattr(server_args, "toploc_verification", False):
        return max(result, CaptureHiddenMode.LAST)
    return result


def _sends_outputs() -> bool:
    """Only the first rank of each attention-TP group streams outputs; other ranks hold the same
    rows and skip the work (no host copies, no proofs) on them."""
    try:
        return get_parallel().attn_tp_rank == 0
    except Exception:
        return True


def req_init_after(result: None, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Req.__init__: create the request's sglang-rl state and raise its capture mode."""
    options = options_of(getattr(req.sampling_params, "custom_params", None))
    state = toploc.state_for_request(options, get_server_args())
    if state is None:
        return
    needed = (
        CaptureHiddenMode.FULL
        if isinstance(state, toploc.PrefillVerification)
        else CaptureHiddenMode.LAST
    )
    req.return_hidden_states_mode = max(req.return_hidden_states_mode, needed)
    if _sends_outputs():
        setattr(req, STATE_ATTR, state)


def _hidden_rows(result: Any) -> torch.Tensor | None:
    if result.copy_done is not None:
        result.copy_done.synchronize()
    logits_output = result.logits_output
    return None if logits_output is None else logits_output.hidden_states


def _take(hidden: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows of the batch at the given indices, on the CPU (one gather, one host copy)."""
    idx = torch.tensor(index, dtype=torch.long)
    if hidden.device.type != "cpu":
        idx = idx.to(hidden.device)
    return hidden.index_select(0, idx).to("cpu")


def prefill_result_around(original: Callable, processor: Any, batch: Any, result: Any) -> Any:
    """AROUND process_batch_result_prefill: route prefill rows, then let sglang process the batch."""
    hidden = _hidden_rows(result) if processor.is_generation else None
    if hidden is not None:
        mode = processor._get_prefill_hidden_capture_mode(batch, processor.server_args)
        builders, last_rows = [], []
        offset = 0
        for i, req in enumerate(batch.reqs):
            n = result.extend_input_len_per_req[i] if mode.is_full() else 1
            lo, hi = offset, offset + n
            offset = hi
            state = getattr(req, STATE_ATTR, None)
            if state is None or state.done:
                continue
            if (req.finished() and req.inflight_middle_chunks <= 0) or req.is_retracted:
                continue
            if isinstance(state, toploc.PrefillVerification):
                state.add_rows(_take(hidden, list(range(lo, hi))))
            elif isinstance(state, toploc.FingerprintBuilder) and req.inflight_middle_chunks <= 0:
                builders.append(state)
                last_rows.append(hi - 1)
        if builders:
            toploc.add_builder_rows(builders, _take(hidden, last_rows), _topk())
    return original(processor, batch, result)


def decode_result_around(original: Callable, processor: Any, batch: Any, result: Any) -> Any:
    """AROUND process_batch_result_decode: the row of each running request produced its token."""
    hidden = _hidden_rows(result)
    if hidden is not None:
        stride = result.speculative_num_draft_tokens or 1
        builders, rows = [], []
        for i, req in enumerate(batch.reqs):
            state = getattr(req, STATE_ATTR, None)
            if isinstance(state, toploc.FingerprintBuilder) and not state.done:
                if not (req.finished() or req.is_retracted):
                    builders.append(state)
                    rows.append(i * stride)
        if builders:
            toploc.add_builder_rows(builders, _take(hidden, rows), _topk())
    return original(processor, batch, result)


def _topk() -> int:
    return get_server_args().toploc_verification_topk


def stream_output_before(streamer: Any, reqs: list, *args: Any, **kwargs: Any) -> None:
    """BEFORE SchedulerOutputStreamer.stream_output: finalise the fingerprints of every request
    finishing in this batch together (their last partial chunks are proven in one call)."""
    finishing = []
    for req in reqs:
        state = getattr(req, STATE_ATTR, None)
        if isinstance(state, toploc.FingerprintBuilder) and not state.done and req.finished():
            finishing.append((state, req))
    toploc.finish_builders(finishing)


def output_accept_around(original: Callable, accumulator: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND _GenerationStreamAccumulator.accept: finalise results of finished requests, then
    send whatever the request has queued along with this output."""
    req = kwargs.get("req", args[0] if args else None)
    state = getattr(req, STATE_ATTR, None)
    if state is not None:
        toploc.finish_verification(state, req)
    transport.accept_around(original, accumulator, *args, **kwargs)
