"""The hook table: every place where sglang-rl touches sglang, registered in one visible list.

sglang calls `register()` through the entry point group `sglang.srt.plugins` in every process it
starts (launcher, Engine, schedulers). Each row names the sglang function or class, the hook kind,
our function, and why. Nothing else in the package patches sglang.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_rl import __version__

logger = logging.getLogger(__name__)

SRT = "sglang.srt"
SCHED = f"{SRT}.managers.scheduler_components"
OPENAI = f"{SRT}.entrypoints.openai"


class Hook(NamedTuple):
    target: str
    kind: HookType
    fn: Callable
    why: str


def hook_table() -> list[Hook]:
    """All hooks of the plugin (imports are local so that importing this module stays cheap)."""
    from sglang_rl.adapters import api, hidden_states_api, kcbs, last_layer_rows, openai, scheduler, speculative
    from sglang_rl.adapters import cotrain, cotrain_api, cotrain_parallel, drafter_weights, drafter_weights_api
    from sglang_rl.adapters import drafter_save, drafter_save_api
    from sglang_rl.adapters import seeded_sampling, specforge_export, speculative_switch, toploc, toploc_metrics
    from sglang_rl.server_args import RLServerArgs

    REPLACE, AROUND, BEFORE, AFTER = HookType.REPLACE, HookType.AROUND, HookType.BEFORE, HookType.AFTER
    return [
        # --- flags -------------------------------------------------------------------------
        Hook(f"{SRT}.server_args.ServerArgs", REPLACE, RLServerArgs,
             "add the sglang-rl flags to the CLI and to the args pickled to schedulers"),
        Hook(f"{SRT}.entrypoints.engine.Engine.server_args_class", REPLACE, RLServerArgs,
             "Engine binds its args class at class definition: let sgl.Engine(**kw) take our flags"),
        # --- request fields in -------------------------------------------------------------
        Hook(f"{SRT}.managers.io_struct.GenerateReqInput", REPLACE, api.RLGenerateReqInput,
             "/generate accepts the sglang-rl fields at top level"),
        Hook(f"{OPENAI}.protocol.ChatCompletionRequest", REPLACE, openai.RLChatCompletionRequest,
             "/v1/chat/completions keeps the sglang-rl extra fields instead of dropping them"),
        Hook(f"{OPENAI}.protocol.CompletionRequest", REPLACE, openai.RLCompletionRequest,
             "/v1/completions keeps the sglang-rl extra fields instead of dropping them"),
        *(Hook(f"{SRT}.entrypoints.engine.Engine.{method}", AROUND, api.engine_generate_around,
               f"sgl.Engine.{method} accepts the sglang-rl fields as keyword arguments")
          for method in ("generate", "async_generate")),
        Hook(f"{OPENAI}.serving_chat.OpenAIServingChat._convert_to_internal_request", BEFORE,
             openai.chat_convert_before,
             "a chat verification request continues the assistant reply instead of closing it"),
        Hook(f"{OPENAI}.serving_chat.OpenAIServingChat._convert_to_internal_request", AFTER,
             openai.chat_convert_after, "copy the fields; locate the reply inside the prefill"),
        Hook(f"{OPENAI}.serving_completions.OpenAIServingCompletion._convert_to_internal_request",
             AFTER, openai.completion_convert_after, "copy the fields to the internal request"),
        Hook(f"{SRT}.managers.tokenizer_manager.TokenizerManager._handle_batch_output", BEFORE,
             hidden_states_api.orphaned_output_before,
             "sglang drops outputs of requests whose client went away: unlink their row files"),
        Hook(f"{SRT}.managers.tokenizer_manager.TokenizerManager.generate_request", AROUND,
             api.generate_request_around,
             "one place for all entry points: validate fields (400), ship them in custom_params, "
             "turn scheduler payloads into meta_info fields, keep rollout records for an "
             "in-process caller that asked (verl's server)"),
        # --- scheduler ---------------------------------------------------------------------
        Hook(f"{SRT}.model_executor.forward_batch_info.get_server_return_hidden_states_mode", AFTER,
             scheduler.server_capture_mode_after,
             "with --toploc-verification every batch (and every CUDA graph) captures LAST rows"),
        Hook(f"{SCHED}.output_streamer.SchedulerOutputStreamer", REPLACE, toploc.RLOutputStreamer,
             "sglang's streamer has slots: ours has a field for the scheduler's fingerprint pipeline"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.__init__", AFTER, toploc.scheduler_init_after,
             "--toploc-verification: this scheduler's fingerprint pipeline, on the scheduler and the "
             "parts whose hooks use it (output streamer, workers)"),
        Hook(f"{SRT}.managers.tp_worker.TpModelWorker.forward_batch_generation", AFTER,
             toploc.worker_forward_after, "the batch result carries the pipeline to its copy_to_cpu hook; "
             "a prefill's verifications are checked on the device from its rows"),
        *(Hook(f"{SRT}.speculative.{worker}.forward_batch_generation", AFTER, toploc.worker_forward_after,
               f"the same for {step} step's result")
          for worker, step in (("eagle_worker_v2.EAGLEWorkerV2", "an EAGLE / NEXTN"),
                               ("multi_layer_eagle_worker_v2.MultiLayerEagleWorkerV2", "a multi-layer EAGLE"),
                               ("ngram_worker.NGRAMWorker", "an NGRAM"))),
        Hook(f"{SRT}.managers.scheduler.Scheduler.__init__", AFTER, specforge_export.scheduler_init_after,
             "--specforge-export-dir: the scheduler's export and its writer thread"),
        Hook(f"{SRT}.managers.scheduler.Scheduler._add_request_to_queue", BEFORE, specforge_export.add_request_before,
             "--specforge-export-dir: the export adopts each queued generation (its two row windows)"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.__init__", AFTER, kcbs.scheduler_init_after,
             "the scheduler keeps this process's k-CBS searches (a KcbsManager, also on its model runner)"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.abort_request", AROUND, kcbs.abort_request_around,
             "an abort of a k-CBS request (by rid prefix, or all) ends its search and its beams"),
        Hook(f"{SRT}.managers.scheduler.Scheduler._abort_on_waiting_timeout", AROUND,
             kcbs.waiting_timeout_around, "a beam request dropped for waiting too long ends its search"),
        Hook(f"{SRT}.managers.scheduler.Scheduler._add_request_to_queue", AROUND,
             kcbs.add_request_to_queue_around,
             "a queued k-CBS request joins the scheduler's searches; a beam request evicted from a full "
             "queue (priority scheduling) ends its search"),
        Hook(f"{SRT}.managers.schedule_policy.PrefillAdder.add_one_req", AROUND, kcbs.add_one_req_around,
             "the k beam requests of a search enter a batch together or wait together"),
        Hook(f"{SRT}.managers.tp_worker.TpModelWorker.forward_batch_generation", AROUND,
             kcbs.worker_forward_around, "tell the sample hook which requests the batch holds"),
        Hook(f"{SRT}.model_executor.model_runner.ModelRunner.sample", AROUND, kcbs.sample_around,
             "a k-CBS step for the beams in the batch: chosen tokens replace the sampled ones, "
             "beam rows fork in req_to_token"),
        Hook(f"{SRT}.managers.tp_worker.TpModelWorker.forward_batch_generation", AROUND,
             seeded_sampling.worker_forward_around,
             "seeded sampling: the sample hook needs the batch's requests (sglang's sampler sees tensors)"),
        Hook(f"{SRT}.model_executor.model_runner.ModelRunner.sample", AROUND, seeded_sampling.sample_around,
             "seeded sampling: a request that asked gets the token of (seed, position, logits), "
             "the same on any batch layout or device, so a verifier can recompute it"),
        Hook(f"{SRT}.mem_cache.common.release_kv_cache", AROUND, kcbs.release_kv_cache_around,
             "a search's beam KV slots go back into its rows once, so sglang frees each once"),
        Hook(f"{SRT}.managers.schedule_batch.Req.__init__", AFTER, scheduler.req_init_after,
             "attach per-request state; raise only that request's capture mode"),
        Hook(f"{SRT}.managers.schedule_batch.Req._compute_max_prefix_len", AROUND,
             scheduler.max_prefix_len_around,
             "requests that want prompt rows recompute them instead of taking them from the cache"),
        Hook(f"{SRT}.managers.schedule_batch.Req.update_finish_state", AROUND,
             scheduler.update_finish_state_around,
             "return_final_hidden_state: one deferred decode step gives the last token its row"),
        Hook(f"{SCHED}.batch_result_processor.SchedulerBatchResultProcessor"
             ".process_batch_result_prefill", AROUND, scheduler.prefill_result_around,
             "route prefill rows to fingerprint builders / verifications"),
        Hook(f"{SCHED}.batch_result_processor.SchedulerBatchResultProcessor"
             ".process_batch_result_decode", AROUND, scheduler.decode_result_around,
             "route each decode step's rows (a speculative step's accepted run) to fingerprint "
             "builders and hidden-state requests"),
        Hook(f"{SRT}.managers.utils.GenerationBatchResult.copy_to_cpu", AROUND,
             scheduler.copy_to_cpu_around,
             "a GPU server whose rows feed only fingerprints keeps each step's rows on the device "
             "(the row store is there) instead of copying them to the host and back"),
        Hook(f"{SRT}.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation", AROUND,
             speculative.prefill_rows_around,
             "an EAGLE prefill's prompt rows (all captured for the draft) are cut to each request's "
             "last row when no request wants more, so sglang copies [requests, H] to the host"),
        Hook(f"{SRT}.layers.logits_processor.LogitsProcessor._get_hidden_states_to_store", AROUND,
             last_layer_rows.store_rows_around,
             "an EAGLE3 target captures auxiliary layers for its draft: also pick the last layer's "
             "rows, which fingerprints and hidden-state fields are defined on"),
        Hook(f"{SRT}.layers.logits_processor.LogitsProcessor.forward", AFTER, last_layer_rows.logits_forward_after,
             "those last-layer rows ride on the step's logits output beside the auxiliary ones"),
        Hook(f"{SRT}.speculative.eagle_worker_common._finalize_accept_tree_path", AROUND,
             last_layer_rows.accept_tree_path_around,
             "a tree step (topk > 1) moves each accepted path to the front of its block: the "
             "last-layer rows move with the captured ones"),
        Hook(f"{SRT}.speculative.eagle_utils.eagle_sample", AROUND, speculative.ngram_sample_around,
             "an NGRAM verify step's accepted rows move to the front of each request's block, "
             "where EAGLE's worker puts them"),
        Hook(f"{SCHED}.output_streamer.SchedulerOutputStreamer.stream_output", BEFORE,
             scheduler.stream_output_before,
             "drive k-CBS searches (hide beam requests, release finished searches); encode the "
             "rows of requests finishing in this batch; start their last proofs and hold their "
             "outputs until the proofs are done (the step never waits), releasing finished ones"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.get_next_batch_to_run", AFTER,
             toploc.next_batch_after,
             "stream held outputs once their proofs are done, not a step later with the next "
             "batch; with nothing to launch, wait for those proofs (the loop would wait anyway)"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.on_idle", BEFORE, toploc.idle_before,
             "loops that idle without that schedule (disaggregation, multiplexing): wait for the "
             "held outputs' proofs and stream them"),
        Hook(f"{SCHED}.output_streamer._GenerationStreamAccumulator.accept", AROUND,
             scheduler.output_accept_around,
             "finalise verification reports and send queued results with the request's output"),
        # --- speculation switch ------------------------------------------------------------
        Hook(f"{SRT}.managers.scheduler.Scheduler.__init__", AFTER, speculative_switch.scheduler_init_after,
             "--speculative-switch: the switch (and the target's plain-decode graph) on the EAGLE worker"),
        Hook(f"{SRT}.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation", AROUND,
             speculative_switch.forward_around,
             "a decode step the switch turns off runs the target's plain decode and keeps its rows; the "
             "first drafting step after it catches the draft up with draft extends over those rows"),
        Hook(f"{SRT}.model_executor.forward_batch_info.get_server_return_hidden_states_mode", AFTER,
             speculative_switch.server_capture_mode_after,
             "with the switch every batch (and the plain-decode graph) captures LAST rows, which off steps keep"),
        Hook(f"{SCHED}.batch_result_processor.SchedulerBatchResultProcessor._resolve_spec_v2_tokens", AFTER,
             speculative_switch.resolve_tokens_after,
             "each drafting step's accept lengths, once on the host, feed the switch's rolling acceptance"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.get_internal_state", AFTER, speculative_switch.internal_state_after,
             "the switch's state in /get_server_info"),
        # --- draft-only weight updates ----------------------------------------------------
        Hook(f"{SRT}.managers.scheduler.Scheduler.init_request_dispatcher", AFTER,
             drafter_weights.request_dispatcher_after,
             "the scheduler decodes the draft-only weight requests and dispatches them to the draft"),
        Hook(f"{SCHED}.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_tensor", AROUND,
             drafter_weights.target_update_from_tensor_around,
             "with an EAGLE draft, a target update goes to the target only (sglang also feeds its "
             "names to the draft: an EAGLE3 draft's layers.0 would take the target's), then the "
             "draft's shared tensors are re-checked"),
        Hook(f"{SCHED}.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_disk", AROUND,
             drafter_weights.target_update_from_disk_around,
             "with an EAGLE draft, the target's checkpoint loads into the target only (sglang "
             "also reads it into the draft and repoints the draft's model_path)"),
        Hook(f"{SRT}.entrypoints.engine.Engine._launch_subprocesses", AFTER,
             drafter_weights_api.launch_subprocesses_after,
             "sgl.Engine gains update_draft_weights_from_tensor/_from_disk, get_draft_weights_by_name "
             "(plugins load inside Engine.__init__, too late to replace the class)"),
        Hook(f"{SRT}.entrypoints.engine.Engine._launch_subprocesses", AFTER,
             drafter_weights_api.add_http_routes_after,
             "the HTTP launcher's app gains /update_draft_weights_from_tensor, "
             "/update_draft_weights_from_disk and /get_draft_weights_by_name before uvicorn starts"),
        # --- saving the served drafter -------------------------------------------------------
        Hook(f"{SRT}.managers.scheduler.Scheduler.init_request_dispatcher", AFTER,
             drafter_save.request_dispatcher_after,
             "the scheduler, which holds the draft's parameters, answers the save request by writing the folder"),
        Hook(f"{SRT}.entrypoints.engine.Engine._launch_subprocesses", AFTER,
             drafter_save_api.launch_subprocesses_after,
             "POST /save_draft_weights and sgl.Engine.save_draft_weights(path)"),
        # --- drafter co-training ---------------------------------------------------------------
        Hook(f"{SRT}.managers.scheduler.Scheduler.__init__", AFTER, cotrain.scheduler_init_after,
             "--drafter-cotrain: start the co-training process (or connect to the trainer) beside the "
             "scheduler, which keeps its runtime; with TP on every rank, which all load each round"),
        Hook(f"{SRT}.entrypoints.engine.Engine._launch_subprocesses", BEFORE,
             cotrain_parallel.launch_subprocesses_before,
             "--drafter-cotrain with several schedulers (TP/DP): start the server's one trainer hub "
             "before the schedulers, which connect to it"),
        Hook(f"{SRT}.managers.scheduler.Scheduler._add_request_to_queue", BEFORE, cotrain.add_request_before,
             "the co-training runtime adopts each queued request: its rows, and its count at finish"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.init_request_dispatcher", AFTER,
             cotrain.request_dispatcher_after,
             "the scheduler answers the co-training stats request, and with TP its rank 0's swap order"),
        Hook(f"{SRT}.managers.scheduler.Scheduler.process_input_requests", BEFORE,
             cotrain.process_input_requests_before,
             "load finished training rounds into the draft between batches, where sglang applies "
             "its own weight updates"),
        Hook(f"{SCHED}.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_tensor", AFTER,
             cotrain.weight_update_after, "a target update (an RL step) starts a new policy version"),
        Hook(f"{SCHED}.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_disk", AFTER,
             cotrain.weight_update_after, "a target update from disk starts a new policy version"),
        Hook(f"{SCHED}.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_distributed",
             AFTER, cotrain.weight_update_after, "a distributed target update starts a new policy version"),
        Hook(f"{SRT}.entrypoints.engine.Engine._launch_subprocesses", AFTER,
             cotrain_api.launch_subprocesses_after,
             "GET /drafter_cotrain_stats and sgl.Engine.get_drafter_cotrain_stats()"),
        # --- responses out -----------------------------------------------------------------
        Hook(f"{OPENAI}.serving_chat.OpenAIServingChat._build_chat_response", AFTER,
             openai.chat_response_after, "add the fields to choices[i].message"),
        Hook(f"{OPENAI}.serving_chat.OpenAIServingChat._generate_chat_stream", AROUND,
             openai.chat_stream_around, "add the fields to the final chunk's delta of each choice"),
        Hook(f"{OPENAI}.serving_completions.OpenAIServingCompletion._build_completion_response",
             AFTER, openai.completion_response_after, "add the fields to choices[i]"),
        Hook(f"{OPENAI}.serving_completions.OpenAIServingCompletion._generate_completion_stream",
             AROUND, openai.completion_stream_around, "add the fields to each choice's final chunk"),
        # --- observability -------------------------------------------------------------------
        Hook(f"{SRT}.entrypoints.engine.Engine._launch_subprocesses", AFTER, server_started,
             "once per server, with sglang's logging set up: the plugin's load line (`server_started`), "
             "then the uncalibrated-bounds warning and the tokenizer manager's TOPLOC metrics "
             "(--enable-metrics)"),
    ]


def server_started(result: Any, engine_cls: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Engine._launch_subprocesses, in the launcher's process once its logging is set up
    (plugins load before that, where an INFO line would be dropped): the plugin's load line, then
    TOPLOC's start (`toploc_metrics.server_started`)."""
    from sglang_rl.adapters import toploc_metrics

    server_args = kwargs.get("server_args", args[0] if args else None)
    if server_args is not None:
        toploc = bool(getattr(server_args, "toploc_verification", False))
        metrics = bool(getattr(server_args, "enable_metrics", False)) and toploc
        logger.info("sglang-rl %s loaded (%d hooks): TOPLOC verification %s, drafter co-training %s, "
                    "TOPLOC metrics %s", __version__, len(hook_table()), _on(toploc),
                    _on(getattr(server_args, "drafter_cotrain", False)), _on(metrics))
    toploc_metrics.server_started(result, engine_cls, *args, **kwargs)


def _on(flag: Any) -> str:
    return "on" if flag else "off"


def register() -> None:
    """Entry point of the plugin: register every hook of the table with sglang's HookRegistry, once
    per process (an install that Python finds twice lists the entry point twice, and a hook
    registered twice would run twice)."""
    if getattr(HookRegistry, "_sglang_rl_registered", False):
        logger.warning("sglang-rl: the plugin's entry point was called again; its hooks are registered once")
        return
    HookRegistry._sglang_rl_registered = True
    for hook in hook_table():
        HookRegistry.register(hook.target, hook.fn, hook.kind)
