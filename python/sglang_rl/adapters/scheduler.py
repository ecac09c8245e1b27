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
from sglang.srt.runtime_context import get_server_args

from sglang.srt.managers.schedule_batch import FINISH_ABORT

from sglang_rl.adapters import hidden_states, kcbs, toploc, transport
from sglang_rl.adapters.decode_step import add_decode_rows
from sglang_rl.adapters.last_layer_rows import last_layer_rows, set_last_layer_rows
from sglang_rl.adapters.request_state import RowSink, kcbs_beam_of, kcbs_search_of, peek, state_of
from sglang_rl.adapters.transport import sends_outputs
from sglang_rl.fingerprint.row_store import pick_rows
from sglang_rl.request_options import SEEDED_SAMPLING_KEY, options_of


def server_capture_mode_after(result: CaptureHiddenMode, server_args: Any) -> CaptureHiddenMode:
    """AFTER get_server_return_hidden_states_mode: TOPLOC needs at least LAST for every batch
    (this is also the mode CUDA graphs are captured with, so graphs stay usable)."""
    if getattr(server_args, "toploc_verification", False) or getattr(server_args, "drafter_cotrain", False):
        return max(result, CaptureHiddenMode.LAST)
    return result


def req_init_after(result: None, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Req.__init__: create the request's sglang-rl state and raise its capture mode."""
    if kcbs.is_child_rid(req.rid):
        return
    options = options_of(getattr(req.sampling_params, "custom_params", None))
    search = kcbs.parent_state(options)
    if search is not None:
        # k-CBS output is assembled from its beams: no fingerprint or rows for it
        state_of(req).kcbs_search = kcbs.KcbsSearch(req, *search)
        return
    sends = sends_outputs()
    toploc.adopt(req, options, get_server_args(), sends)
    hidden_states.adopt(req, options, sends)
    if options.get(SEEDED_SAMPLING_KEY):
        state_of(req).seeded_sampling_seed = getattr(req.sampling_params, "sampling_seed", None)


def _row_sinks(req: Any) -> list[RowSink]:
    """The sinks of a request's rows (hidden-state fields, co-training, SpecForge export, ...)."""
    state = peek(req)
    return [] if state is None else state.rows


def max_prefix_len_around(original: Callable, req: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND Req._compute_max_prefix_len: a request that wants prompt rows must recompute them,
    so the radix cache may only serve the prefix before the first wanted row."""
    result = original(req, *args, **kwargs)
    limits = [limit for c in _row_sinks(req) if (limit := c.prefix_limit()) is not None]
    return min([result, *limits])


def update_finish_state_around(original: Callable, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Req.update_finish_state: for return_final_hidden_state, defer a request's finish by
    one decode step so its last token gets a forward pass on its own KV cache; the extra token is
    cut by finished_len, exactly like a speculative overshoot. Only the finish reason waits:
    finished_len stays set through the extra step, because sglang streams an unfinished request's
    `output_ids_through_stop` in that step, and without it a speculative overshoot (tokens of the
    last verify run past the finish) would go out to the client, one token more than the rows."""
    state = peek(req)
    if state is None or not state.wants_final_row:
        return original(req, *args, **kwargs)
    if state.deferred_finish is not None:
        req.finished_reason, req.finished_len = state.deferred_finish
        state.deferred_finish = None
        state.final_row = True
        return None
    result = original(req, *args, **kwargs)
    if (req.finished() and not state.final_row
            and not isinstance(req.finished_reason, FINISH_ABORT) and req.output_ids):
        finished_len = req.finished_len if req.finished_len is not None else len(req.output_ids)
        if finished_len == 0 or req.sampling_params.max_new_tokens == 0:
            return result  # a prefill-only request generated nothing: no final token, no extra step
        state.deferred_finish = (req.finished_reason, finished_len)
        req.finished_reason = None
        req.finished_len = finished_len
    return result


def _hidden_rows(batch: Any, result: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's last-layer rows and its captured rows (the same tensor, except an EAGLE3
    target's: its auxiliary layers, which its co-training rows take), or Nones when no request of
    the batch asked for rows (a server with --enable-return-hidden-states captures every batch)."""
    if not batch.return_hidden_states:
        return None, None
    if result.copy_done is not None:
        result.copy_done.synchronize()
    logits_output = result.logits_output
    if logits_output is None:
        return None, None
    return last_layer_rows(logits_output), logits_output.hidden_states


def _rows_for(collector: RowSink, last: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
    """Co-training rows are what the draft reads (the captured ones); every other collector's are
    the last layer's."""
    return captured if collector.takes_captured_rows else last


def copy_to_cpu_around(original: Callable, result: Any, return_logprob: bool = False,
                       return_hidden_states: bool = True) -> Any:
    """AROUND GenerationBatchResult.copy_to_cpu: on a GPU server whose rows go only to
    fingerprints, whose row store is on the device, the step's rows stay there: a device copy,
    made where sglang would start its page-locked host copy (same stream, same point), instead
    of a host copy that the store would send straight back. Servers with row collectors
    (hidden-state fields, co-training) take sglang's host copy as before. A request's own
    sglang return_hidden_states still works: sglang copies its rows out of the device tensor. The
    result carries its scheduler's pipeline (`toploc.worker_forward_after`)."""
    rows = last_layer_rows(result.logits_output) if return_hidden_states else None
    pipeline = toploc.pipeline_of(result)
    if (rows is not None and pipeline is not None and rows.device == pipeline.device
            and _rows_only_fingerprinted(get_server_args())):
        set_last_layer_rows(result.logits_output, pipeline.keep_rows(rows))
        return_hidden_states = False
    return original(result, return_logprob, return_hidden_states)


def _rows_only_fingerprinted(args: Any) -> bool:
    return bool(getattr(args, "toploc_verification", False)) and not _server_collects_rows(args)


def _rows_wanted(processor: Any) -> bool:
    """Whether this server can have requests that need rows (else the hooks step aside)."""
    return _server_wants_rows(processor.server_args)


def _server_wants_rows(args: Any) -> bool:
    return bool(getattr(args, "toploc_verification", False) or _server_collects_rows(args))


def _server_collects_rows(args: Any) -> bool:
    """Whether requests can have row collectors: hidden-state fields need a server started with
    --enable-return-hidden-states (the API refuses them otherwise), co-training rows need
    --drafter-cotrain, SpecForge export rows --specforge-export-dir."""
    return bool(args.return_hidden_states_mode or getattr(args, "drafter_cotrain", False)
                or getattr(args, "specforge_export_dir", None))


def _take(hidden: torch.Tensor, index: list[int] | range) -> torch.Tensor:
    """Rows of the batch at the given ascending indices, on the CPU (a view or one gather, then
    one host copy)."""
    return pick_rows(hidden, index).to("cpu")


def prefill_result_around(original: Callable, processor: Any, batch: Any, result: Any) -> Any:
    """AROUND process_batch_result_prefill: route prefill rows, then let sglang process the batch."""
    hidden, captured = _hidden_rows(batch, result) if processor.is_generation and _rows_wanted(processor) else (None, None)
    if hidden is not None:
        # FULL capture gives a row per extended token, LAST one per request. Count rows rather
        # than ask the batch's mode: an EAGLE worker captures its target's prefill FULL whatever
        # the requests asked for
        full = hidden.shape[0] >= sum(result.extend_input_len_per_req)
        builders, last_rows = [], []
        offset = 0
        for i, req in enumerate(batch.reqs):
            n = result.extend_input_len_per_req[i] if full else 1
            lo, hi = offset, offset + n
            offset = hi
            state = peek(req)
            if state is None or (req.finished() and req.inflight_middle_chunks <= 0) or req.is_retracted:
                continue
            for collector in state.rows:
                if collector.done or not collector.stores:
                    continue
                last_chunk = req.inflight_middle_chunks <= 0
                end = len(req.origin_input_ids) + len(req.output_ids)  # > prompt after a retraction
                rows = _rows_for(collector, hidden, captured)
                if collector.needs_prompt_rows and full:
                    collector.add_prefill(_take(rows, range(lo, hi)), last_chunk, end)
                elif last_chunk:
                    collector.add_prefill(_take(rows, [hi - 1]), True, end)
            verification, builder = state.verification, state.fingerprint
            if verification is not None and not verification.done and not verification.on_device:
                verification.add_rows(_take(hidden, range(lo, hi)))  # the host path (TP/PP > 1)
            elif builder is not None and not builder.done and req.inflight_middle_chunks <= 0:
                builders.append(builder)
                last_rows.append(hi - 1)
        pipeline = toploc.processor_pipeline(processor)
        if pipeline is not None and (builders or pipeline.holds_requests()):  # a prefill step counts too
            pipeline.add_builder_rows(builders, hidden, _topk(), starts=last_rows)
    return original(processor, batch, result)


def decode_result_around(original: Callable, processor: Any, batch: Any, result: Any) -> Any:
    """AROUND process_batch_result_decode: the row of each running request produced its token.

    Under speculative decoding a request's block of `speculative_num_draft_tokens` rows starts
    with its accepted run (the worker moves the accepted tree path to the front): its first
    `accept_lens[i]` rows are those of the committed tokens, in order."""
    hidden, captured = _hidden_rows(batch, result) if _rows_wanted(processor) else (None, None)
    if hidden is not None:
        stride = result.speculative_num_draft_tokens or 1
        accepted = result.accept_lens.tolist() if result.accept_lens is not None else None
        if _server_collects_rows(processor.server_args):
            builders, starts, counts, collectors = decode_routes(batch.reqs, stride, accepted)
        else:  # a TOPLOC-only server has no row collectors to look for
            builders, starts, counts = toploc.decode_builders(batch.reqs, stride, accepted)
            collectors = []
        pipeline = toploc.processor_pipeline(processor)
        if pipeline is not None and (builders or pipeline.holds_requests()):  # a step even without rows
            pipeline.add_builder_rows(builders, hidden, _topk(), counts, starts)
        # one host copy per kind of rows (two only on an EAGLE3 target: auxiliary and last layer)
        groups: dict[int, tuple[torch.Tensor, list]] = {}
        for item in collectors:
            rows = _rows_for(item[0], hidden, captured)
            groups.setdefault(id(rows), (rows, []))[1].append(item)
        for rows, group in groups.values():
            add_decode_rows(group, _private_host_rows(rows, processor))
    return original(processor, batch, result)


def decode_routes(reqs: list, stride: int, accepted: list[int] | None
                  ) -> tuple[list, list[int], list[int], list]:
    """`toploc.decode_builders` on a server whose requests may also have row sinks (hidden-state
    fields, co-training): those sinks too, each with its run and the run's position."""
    builders, starts, counts, collectors = [], [], [], []
    for i, req in enumerate(reqs):
        state = peek(req)
        if state is None:
            continue
        count = accepted[i] if accepted is not None else 1
        for rows_of in state.rows:
            if rows_of.stores and not rows_of.done and not (req.finished() or req.is_retracted):
                position = len(req.origin_input_ids) + len(req.output_ids) - 1
                collectors.append((rows_of, i * stride, count, position))
        builder = state.fingerprint
        # the deferred step of return_final_hidden_state samples a token that is never
        # returned: its row must not enter the fingerprint, which covers output_ids only
        if (builder is not None and not builder.done
                and not (req.finished() or req.is_retracted)
                and state.deferred_finish is None):
            builders.append(builder)
            starts.append(i * stride)
            counts.append(count)
    return builders, starts, counts, collectors


def _private_host_rows(hidden: torch.Tensor, processor: Any) -> torch.Tensor:
    """The step's rows on the host in a tensor that sglang will not reuse (LAST collectors keep
    references to it): on a GPU that is sglang's own fresh host copy of the batch results; on a
    CPU server the rows are the forward's output itself, so they are copied once."""
    if processor.server_args.device == "cpu":
        return hidden.clone()
    return hidden.to("cpu")


def _topk() -> int:
    return get_server_args().toploc_verification_topk


def stream_output_before(streamer: Any, reqs: list, *args: Any, **kwargs: Any) -> Any:
    """BEFORE SchedulerOutputStreamer.stream_output: drive k-CBS searches (their internal beam
    requests are taken out, finished searches put in), then finalise the rows of every request
    finishing in this batch and start their fingerprints' last proofs. Requests whose proofs
    are still being built are held back from this batch's outputs (the step never waits for
    them) and go out as soon as they are proven (`toploc.next_batch_after`) or with a later
    batch."""
    pipeline = toploc.pipeline_of(streamer)
    if pipeline is not None and pipeline.releasing:  # held outputs released outside a batch's own
        return None
    replaced = None
    if any(kcbs_beam_of(r) is not None or kcbs_search_of(r) is not None for r in reqs):
        reqs = replaced = kcbs.filter_outputs(reqs)
    _finish_rows(reqs, pipeline)
    if pipeline is None or not pipeline.holds_requests():
        return None if replaced is None else ((streamer, reqs, *args), kwargs)
    reqs, args, kwargs = toploc.with_held_outputs(pipeline, reqs, args, kwargs)
    return (streamer, reqs, *args), kwargs


def _finish_rows(reqs: list, pipeline: Any) -> None:
    """Finalise the rows of finishing requests and start their fingerprints' last proofs (in the
    scheduler's `pipeline`)."""
    if not _server_wants_rows(get_server_args()):
        return
    finished = [req for req in reqs if req.finished()]  # this runs at every step, for every request
    if not finished:
        return
    finishing = []
    for req in finished:
        state = peek(req)
        if state is None:
            continue
        if state.adopters:  # each adopter hears of the finish once (the SpecForge export writes it, ...)
            adopted, state.adopters = state.adopters, {}
            for adopter, kept in adopted.items():
                adopter.finished(req, kept)
        builder = state.fingerprint
        if builder is not None and not builder.done:
            finishing.append((builder, req))
    if finishing:
        toploc.finish_builders(pipeline, finishing)


def output_accept_around(original: Callable, accumulator: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND _GenerationStreamAccumulator.accept: finalise results of finished requests, then
    send whatever the request has queued along with this output."""
    req = kwargs.get("req", args[0] if args else None)
    state = peek(req)
    # sglang offers every running request to the accumulator at every step: a generating one's
    # fingerprint is posted by `_finish_rows`, so only verification requests go further here
    if state is not None and state.verification is not None:
        state.verification.post_report(req)
    transport.accept_around(original, accumulator, *args, **kwargs)
