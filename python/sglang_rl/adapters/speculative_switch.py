"""The speculation switch in sglang's EAGLE worker (spec v2): a decode step that would not gain
from drafting runs the target's plain decode.

An off step is sglang's non-speculative decode (ForwardMode.DECODE through the target worker,
one token per request) dressed as a spec-v2 result of one draft token per request: accept
length 1, the sampled token as the next bonus token, zero stubs for the draft fields the overlap
scheduler stashes. No draft forward, no draft extend; the step's target rows are kept on the
device (the newest --speculative-switch-catch-up-tokens steps). The first drafting step after
off steps is a catch-up step: the same plain decode, then draft extends over the kept rows and
this step's (no target recompute), so the next step drafts from a caught-up draft. The
decision itself is the engine-agnostic `sglang_rl.speculation.SpeculationSwitch`, kept on the
worker; it learns the acceptance from each drafting step's accept lengths once the scheduler has
them on the host (`resolve_tokens_after`).
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Any, Callable, Optional

import torch

from sglang_rl.speculation import BreakEvenTable, OffRows, SpeculationSwitch, SwitchConfig, plan_chunks

logger = logging.getLogger(__name__)

ATTR = "_sglang_rl_speculation_switch"
"""The EAGLE worker's attribute holding its `SwitchRuntime`."""

PUBLISH_EVERY = 16
"""decode steps between two metric updates (and at every flip)"""


class SwitchRuntime:
    """The switch of one spec worker, what the next step needs to know, and its metrics."""

    def __init__(self, switch: SpeculationSwitch, metrics: "SwitchMetrics", catch_up_tokens: int = 0) -> None:
        self.switch = switch
        self.metrics = metrics
        self.off_rows = OffRows(catch_up_tokens)
        self.behind = False  # the draft missed the last step(s): the next drafting step catches up
        self.catch_ups = 0
        self.plain_steps_in_graph = 0  # plain steps that replayed the plain-decode CUDA graph (the rest ran eagerly)
        self.plain_graph: Any = None  # the target's plain-decode graph runner (GPU), None: eager
        self.error: Optional[str] = None  # why plain steps stopped (the server then drafts as sglang does)

    def stats(self) -> dict:
        return {**self.switch.stats(), "catch_ups": self.catch_ups, "catch_up_tokens": self.off_rows.capacity,
                "error": self.error, "plain_steps_in_graph": self.plain_steps_in_graph,
                "plain_decode_graph": self.plain_graph is not None}


def switch_of(worker: Any) -> Optional[SwitchRuntime]:
    return getattr(worker, ATTR, None)


def drafter_changed(worker: Any) -> None:
    """New draft weights were loaded into this worker's draft: the switch measures them at the next
    step that may draft (`SpeculationSwitch.drafter_changed`)."""
    runtime = switch_of(worker)
    if runtime is not None:
        runtime.switch.drafter_changed()


def scheduler_init_after(result: Any, scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: --speculative-switch puts a switch on the scheduler's EAGLE worker."""
    if not getattr(server_args, "speculative_switch", False):
        return
    worker = getattr(scheduler, "draft_worker", None)
    if worker is None or not hasattr(worker, "_draft_worker") or not hasattr(worker, "_stub_skipped_draft_extend"):
        raise RuntimeError("--speculative-switch needs sglang's EAGLE worker (spec v2); this scheduler runs "
                           f"{type(worker).__name__}")
    table = BreakEvenTable.load(server_args.speculative_switch_table)
    config = SwitchConfig(window=server_args.speculative_switch_window,
                          probe_interval=server_args.speculative_switch_probe_interval,
                          probe_steps=server_args.speculative_switch_probe_steps,
                          probe_backoff=server_args.speculative_switch_probe_backoff,
                          probe_reach=server_args.speculative_switch_probe_reach)
    runtime = SwitchRuntime(SpeculationSwitch(table, config),
                            SwitchMetrics.create(server_args, getattr(scheduler.ps, "dp_rank", 0) or 0),
                            server_args.speculative_switch_catch_up_tokens)
    from sglang_rl.adapters.speculative_switch_graph import capture_plain_decode_graph

    runtime.plain_graph = capture_plain_decode_graph(worker)
    setattr(worker, ATTR, runtime)
    logger.info("speculation switch on: break-even table %s, %s, plain decode %s",
                runtime.switch.table.to_dict()["break_even_tokens_per_step"], config,
                "in a CUDA graph" if runtime.plain_graph is not None else "eager")


def forward_around(original: Callable, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND EAGLEWorkerV2.forward_batch_generation: a decode step the switch turns off runs the
    target's plain decode; the first drafting step after off steps catches the draft up."""
    runtime = switch_of(worker)
    mode = getattr(batch, "forward_mode", None)
    if (runtime is None or runtime.error is not None or mode is None or mode.is_extend() or mode.is_idle()
            or batch.is_extend_in_batch or batch.spec_info is None or batch.return_logprob or batch.has_grammar):
        return original(worker, batch, *args, **kwargs)  # sglang's own step (logprobs, grammar: drafting)
    switch = runtime.switch
    on = switch.decide(int(batch.seq_lens.shape[0]))
    if switch.steps_on + switch.steps_off == 1 or (switch.steps_on + switch.steps_off) % PUBLISH_EVERY == 0 \
            or switch.flips != runtime.metrics.flips_seen:
        runtime.metrics.publish(runtime.stats())
    if on and not runtime.behind:
        return original(worker, batch, *args, **kwargs)
    on_publish = kwargs.get("on_publish")
    try:
        result = plain_decode(worker, batch, runtime, on_publish, rows_for_draft=on)
        if on:
            catch_up(worker, batch, result, runtime.off_rows)
    except Exception as exc:  # the step again as sglang runs it (it rewrites the same KV slots and republishes)
        logger.exception("speculation switch: a plain step failed; drafting in every step from now on")
        runtime.error = f"{type(exc).__name__}: {exc}"
        return original(worker, batch, *args, **kwargs)
    if on:
        runtime.off_rows.clear()
        runtime.behind = False
        runtime.catch_ups += 1
    else:
        worker._stub_skipped_draft_extend(batch, result)  # shapes the overlap scheduler stashes
        rows = result.logits_output.hidden_states
        if rows is not None and rows.shape[0] == batch.seq_lens.shape[0]:
            runtime.off_rows.add(batch.req_pool_indices, batch.seq_lens, rows, result.next_token_ids)
        runtime.behind = True
    return result


def plain_decode(worker: Any, batch: Any, runtime: SwitchRuntime, on_publish: Optional[Callable],
                 rows_for_draft: bool = False) -> Any:
    """One plain decode step of the target for a spec-v2 batch (seq_lens: lengths before the
    step, spec_info.bonus_tokens: the tokens to feed), as a spec-v2 result of width 1. It captures
    rows as the server's decode does (LAST with the switch: `server_capture_mode_after`), and
    at least LAST (in a decode step: every row) when a catch-up follows."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    seq_lens = batch.seq_lens
    bs = int(seq_lens.shape[0])
    decode = copy.copy(batch)  # the scheduler's batch keeps its spec-v2 fields
    decode.forward_mode = ForwardMode.DECODE
    decode.spec_algorithm = SpeculativeAlgorithm.NONE
    decode.spec_info = None
    decode.input_ids = batch.spec_info.bonus_tokens.to(torch.int64)
    req_to_token = worker.req_to_token_pool.req_to_token
    decode.out_cache_loc = req_to_token[batch.req_pool_indices.to(torch.long), seq_lens.to(torch.long)].to(torch.int64)
    decode.seq_lens = seq_lens + 1  # a decode forward counts the fed token
    if batch.seq_lens_cpu is not None:
        decode.seq_lens_cpu = batch.seq_lens_cpu + 1
    if batch.seq_lens_sum is not None:
        decode.seq_lens_sum = batch.seq_lens_sum + bs
    runner = worker.target_worker.model_runner
    verify_graph, verify_backend = runner.decode_cuda_graph_runner, runner.attn_backend
    # the verify graph feeds draft_token_num tokens per request: plain steps use their own (or none)
    runner.decode_cuda_graph_runner = None if runtime.plain_graph is None else runtime.plain_graph.runner
    if runtime.plain_graph is not None:
        runner.attn_backend = runtime.plain_graph.attn_backend
    try:
        result = worker.target_worker.forward_batch_generation(
            decode, capture_hidden_mode=CaptureHiddenMode.LAST if rows_for_draft else None)
    finally:
        runner.decode_cuda_graph_runner, runner.attn_backend = verify_graph, verify_backend
    runtime.plain_steps_in_graph += bool(getattr(result, "can_run_cuda_graph", False))
    read_done = getattr(runner, "war_fastpath_read_done_event", None)
    if read_done is not None:  # the scheduler's WAR barrier waits on the worker's last graph read, as plain sglang's
        runner.war_fastpath_read_done_event = None
        worker.war_fastpath_runner.war_fastpath_read_done_event = read_done
    predict = result.next_token_ids
    result.accept_lens = torch.ones(bs, dtype=torch.int32, device=seq_lens.device)
    result.new_seq_lens = seq_lens + 1
    result.speculative_num_draft_tokens = 1  # the result processor's stride
    result.next_draft_input = EagleDraftInput(bonus_tokens=predict.to(torch.int32))
    if on_publish is not None:
        on_publish(result.new_seq_lens)
    return result


def catch_up(worker: Any, batch: Any, result: Any, off_rows: OffRows) -> None:
    """Draft extends over the kept rows of the plain steps and this step's row: the draft's KV at
    those positions and its next input (top-k, hidden state), as verify steps would have left
    them. Each extend takes a chunk of at most `speculative_num_draft_tokens` tokens per request,
    its rows and tokens at the front of blocks of that width, where a verify step's draft extend
    finds its accepted run (`speculation.plan_chunks`: oldest first, the last ends at this step)."""
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_uniform_func
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context, speculative_moe_backend_context

    width = worker.speculative_num_draft_tokens
    bs = int(batch.seq_lens.shape[0])
    position = batch.seq_lens.to(torch.long)
    rows, tokens = result.logits_output.hidden_states, result.next_token_ids.to(torch.int64)
    all_rows, all_tokens, counts = off_rows.gather(batch.req_pool_indices.to(torch.long), position, rows, tokens)
    chunks = plan_chunks(counts, width, len(off_rows) + 1)
    requests = torch.arange(bs, device=position.device)[:, None]
    draft = worker._draft_worker
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        start = position - chunk.newest_age
        extend = copy.copy(batch)
        extend.seq_lens = start.to(batch.seq_lens.dtype)
        if batch.seq_lens_cpu is not None and len(chunks) > 1:  # a wait for the device, once per catch-up
            extend.seq_lens_cpu = start.cpu().to(batch.seq_lens_cpu.dtype)
            extend.seq_lens_sum = int(extend.seq_lens_cpu.sum())
        extend.out_cache_loc = assign_extend_cache_locs_uniform_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=worker.req_to_token_pool.req_to_token,
            start_offset=extend.seq_lens, batch_size=bs, draft_token_num=width, device=batch.device)
        view = types.SimpleNamespace(
            logits_output=types.SimpleNamespace(hidden_states=all_rows[chunk.ages, requests].reshape(bs * width, -1)),
            accept_lens=chunk.count.to(torch.int32), next_token_ids=all_tokens[chunk.ages, requests].reshape(-1),
            next_draft_input=result.next_draft_input if last else types.SimpleNamespace())
        with draft.draft_tp_context(draft.draft_runner.tp_group), speculative_moe_backend_context(), \
                speculative_moe_a2a_backend_context():
            draft._draft_extend_for_decode(extend, view)


def server_capture_mode_after(result: Any, server_args: Any) -> Any:
    """AFTER get_server_return_hidden_states_mode: with the switch every batch captures at least
    LAST rows (the plain-decode graph too), which off steps keep for the catch-up."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    if getattr(server_args, "speculative_switch", False) and getattr(server_args, "speculative_switch_catch_up_tokens", 0):
        return max(result, CaptureHiddenMode.LAST)
    return result


def resolve_tokens_after(tokens: Any, processor: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER SchedulerBatchResultProcessor._resolve_spec_v2_tokens: a drafting step's accept
    lengths, now on the host, feed the switch's rolling acceptance (plain steps have width 1)."""
    runtime = switch_of(getattr(processor, "model_worker", None))
    if runtime is not None and (result.speculative_num_draft_tokens or 1) > 1:
        runtime.switch.record(n + 1 for n in result.num_correct_drafts_per_req_cpu)
    return tokens


def internal_state_after(state: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler.get_internal_state: the switch's state in /get_server_info."""
    runtime = switch_of(getattr(scheduler, "draft_worker", None))
    fields = getattr(state, "internal_state", state)  # a GetInternalStateReqOutput
    if runtime is not None and isinstance(fields, dict):
        fields["speculation_switch"] = runtime.stats()
    return state


class SwitchMetrics:
    """Prometheus gauges of the switch (only with --enable-metrics)."""

    NAMES = {"on": "1 while the speculation switch drafts, 0 while it decodes plainly",
             "steps_on": "Decode steps the speculation switch drafted in",
             "steps_off": "Decode steps the speculation switch decoded plainly",
             "flips": "Times the speculation switch turned drafting on or off",
             "probes": "Probes of the drafter's acceptance while the speculation switch was off",
             "acceptance": "Rolling tokens per verify step the speculation switch decides on"}

    def __init__(self, gauges: dict, labels: Optional[dict] = None) -> None:
        self.gauges, self.labels, self.flips_seen = gauges, labels, 0

    @classmethod
    def create(cls, server_args: Any, dp_rank: int = 0) -> "SwitchMetrics":
        if not getattr(server_args, "enable_metrics", False):
            return cls({})
        from prometheus_client import Gauge

        per_replica = int(getattr(server_args, "dp_size", 1) or 1) > 1
        labelnames = ("dp_rank",) if per_replica else ()
        return cls({key: Gauge(f"sglang_rl:speculation_switch_{key}", doc, labelnames, multiprocess_mode="mostrecent")
                    for key, doc in cls.NAMES.items()}, {"dp_rank": str(dp_rank)} if per_replica else None)

    def publish(self, stats: dict) -> None:
        self.flips_seen = stats["flips"]
        for key, gauge in self.gauges.items():
            value = stats[key]
            if value is not None:
                (gauge.labels(**self.labels) if self.labels else gauge).set(float(value))
