"""Scheduler side of `--drafter-cotrain`: rows of finished rollouts in, new draft weights out.

The scheduler keeps its `CotrainRuntime` (`runtime_of`), and every request it queues is adopted
by it: counted when it finishes, and (unless it sets `drafter_cotrain: false`) given a
`CotrainRows` collector (`adapters/cotrain_rows.py`): the last `window` rows the target computed
for it anyway (EAGLE's target captures them for its draft), routed by the same prefill/decode
hooks as user-requested rows, never limiting the radix cache. A finished request's ids, rows and
policy version become a sample for the co-training process (`sglang_rl.drafter.cotrain`), which
trains in rounds off the scheduler loop; samples are built and posted between batches, when the
scheduler is idle or a round's worth waits. Between two batches the scheduler also takes finished
rounds from the outbox and loads them through the draft-only weight update
(`adapters.drafter_weights`). Acceptance per round: `adapters/cotrain_acceptance.py`.
"""

from __future__ import annotations

import logging
import queue
import time
from functools import partial
from typing import Any, Optional

import torch

from sglang.srt.managers.io_struct import GetWeightsByNameReqInput, GetWeightsByNameReqOutput
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sglang_rl.adapters.cotrain_acceptance import RoundCounts, acceptance_stats
from sglang_rl.adapters.cotrain_metrics import CotrainMetrics
from sglang_rl.adapters import cotrain_parallel as parallel
from sglang_rl.adapters.cotrain_rows import CotrainRows
from sglang_rl.adapters.request_state import kcbs_beam_of, kcbs_search_of, state_of
from sglang_rl.adapters.cotrain_config import config_from_args
from sglang_rl.adapters.cotrain_idle import idle_event, note_idle, weights_released
from sglang_rl.drafter.cotrain import inbox_size, start_cotrain_process
from sglang_rl.drafter.messages import Error, Held, Ready, Round, Sample, Stop, TargetHead, from_wire, to_wire
from sglang_rl.drafter.trainer_client import RemoteTrainer
from sglang_rl.request_options import options_of

logger = logging.getLogger(__name__)

OPT_OUT_KEY = "cotrain_opt_out"
STATS_NAME = "__sglang_rl_drafter_cotrain_stats__"
ATTR = "_sglang_rl_cotrain"


def _checksum(embed: torch.Tensor, head: torch.Tensor) -> tuple[float, ...]:
    """A cheap fingerprint of the target's embedding and head: sums over a strided sample of
    about a million entries of each (an RL step changes nearly every entry), never a full copy."""
    def one(t: torch.Tensor) -> tuple[float, float]:
        flat = t.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1_000_000)].float()
        return float(sample.sum()), float(sample.square().sum())

    return one(embed) + one(head)


class CotrainRuntime:
    """One scheduler's co-training: the training process, its queues and the statistics. With
    tensor parallelism every TP rank has one; only rank 0 (``sends_rows``) sends rollouts."""

    def __init__(self, server_args: Any, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0) -> None:
        self.config = config_from_args(server_args)
        self.window = self.config.window
        self.sends_rows, self.tp_size, self.dp_rank = tp_rank == 0, tp_size, dp_rank
        self.swap: Optional[parallel.TpSwap] = None  # set by scheduler_init_after when tp_size > 1
        self.idle: Optional[Any] = None  # set while the scheduler is idle (train_in_gaps)
        address, authkey = parallel.trainer_address(server_args)
        if address:  # a shared trainer (sglang-rl drafter trainer) or this server's own hub
            self.process = RemoteTrainer(address, inbox_size(self.config), authkey)
            self.inbox, self.outbox = self.process.inbox, self.process.outbox
        else:
            self.idle = idle_event() if self.config.train_in_gaps else None
            self.process, self.inbox, self.outbox = start_cotrain_process(
                self.config, "sglang-rl-drafter-cotrain", self.idle)
        self.policy_version = 0
        # a run of target updates with no rollout between them is one RL step; the first run
        # (verl's initial push) starts version 1
        self.served_since_update = True
        self.head_pending = False
        self.head_checksum: Optional[tuple[float, ...]] = None
        self.target_head_updates = 0
        self.samples = 0
        self.pending: list[CotrainRows] = []  # finished requests whose samples are not built yet
        self.dropped = 0
        self.rows_sent = 0
        self.skipped_busy = 0
        self.ready = False
        self.errors: list[str] = []
        self.rounds: list[dict] = []
        self.swap_checks: list[dict] = []  # every round the trainer checked, loaded or held
        self.acceptance = [RoundCounts()]  # index r: requests served by round r's weights
        self.held_out = [RoundCounts()]
        self.saved: Optional[dict] = None  # the last POST /save_draft_weights (adapters/drafter_save.py)
        self.metrics = CotrainMetrics.create(server_args, dp_rank) if self.sends_rows else CotrainMetrics({})

    @property
    def draft_round(self) -> int:
        return len(self.rounds)

    def adopt(self, req: Any) -> None:
        """A request the scheduler queues: count it when it finishes, and collect its rows unless
        it opted out (a k-CBS request has none: its output is assembled from its beams, which are
        internal requests and never counted). A retracted request queued again keeps its own."""
        state = state_of(req)
        if not self.sends_rows or self in state.adopters or kcbs_beam_of(req) is not None:
            return
        rows = None
        options = options_of(getattr(req.sampling_params, "custom_params", None))
        if kcbs_search_of(req) is None and not options.get(OPT_OUT_KEY):
            rows = CotrainRows(len(req.origin_input_ids), self.window)
            state.add_rows(rows)
            req.return_hidden_states_mode = max(req.return_hidden_states_mode, CaptureHiddenMode.LAST)
        state.adopters[self] = rows

    def finished(self, req: Any, rows: Optional[CotrainRows]) -> None:
        """Count the request's acceptance; post its sample (`rows`, None when it opted out) unless
        it was aborted."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if isinstance(req.finished_reason, FINISH_ABORT):
            return
        self.served_since_update = True
        steps = int(getattr(req, "spec_verify_ct", 0) or 0)
        tokens = len(req.output_ids_through_stop)
        (self.held_out if rows is None else self.acceptance)[-1].add(req, tokens, steps)
        if rows is None or rows.done:
            return
        rows.close(req, self.policy_version)
        self.pending.append(rows)  # posted by the next poll that finds the server idle or a round's worth

    def send_pending(self, scheduler: Any, released: bool) -> None:
        """Post what the trainer is owed: a changed target head first (the samples after it were
        made by it), then the samples of finished requests. `poll` runs it when the scheduler is
        idle, off the rollout's path, or once a round's worth of samples waits (a server that
        never idles). A head is read only while the weights are in memory (not `released`)."""
        if not released and (self.head_checksum is None or (self.head_pending and self.served_since_update)):
            self.send_target_head(scheduler)
        pending, self.pending = self.pending, []
        for rows in pending:
            sample = rows.sample()
            if sample is None or sample.input_ids.numel() < 2:
                self.dropped += 1
                continue
            self.rows_sent += int(sample.input_ids.numel())
            try:
                self.inbox.put_nowait(Sample.of(sample))
            except queue.Full:
                self.skipped_busy += 1
                continue
            self.samples += 1

    def policy_updated(self) -> None:
        """A target weight update. verl pushes one RL step as several updates (a bucket each),
        back to back: updates with no rollout finished between them are one policy version."""
        if self.served_since_update:
            self.policy_version += 1
            self.served_since_update = False
        self.head_pending = True

    def send_target_head(self, scheduler: Any) -> None:
        """Once rollouts ran on the updated target, give the trainer the target's embedding and
        LM head if the update changed them (training reads them from disk only at start)."""
        from sglang_rl.adapters.eagle_draft import find_eagle_draft, is_eagle3, same_tensor

        eagle, _ = find_eagle_draft(getattr(scheduler, "draft_worker", None))
        # with TP each rank holds a vocabulary shard of the embedding: the trainer keeps its own
        if eagle is None or self.tp_size > 1:
            self.head_pending = False
            return
        embed, head = eagle.target_worker.model_runner.model.get_embed_and_head()
        checksum = _checksum(embed, head)
        if checksum == self.head_checksum or not self.head_pending:
            self.head_checksum, self.head_pending = checksum, False
            return
        # an EAGLE3 drafter trains its own head over the draft vocabulary: the embedding is enough
        embed_only = same_tensor(embed, head) or is_eagle3(eagle)
        message = TargetHead(to_wire(embed), None if embed_only else to_wire(head))
        try:
            self.inbox.put(message, timeout=1.0)
        except queue.Full:
            return  # the trainer is behind: the next poll tries again
        self.head_checksum, self.head_pending = checksum, False
        self.target_head_updates += 1

    def poll(self, scheduler: Any) -> None:
        """Apply finished rounds (between batches, where sglang applies its own weight updates)."""
        released = weights_released(scheduler)
        idle = released or scheduler.is_fully_idle()
        if self.idle is not None:
            note_idle(self.idle, idle)
        # between batches: after an RL step's last rollout, its outputs have gone out already
        if idle or len(self.pending) >= self.config.samples_per_round:
            self.send_pending(scheduler, released)
        if released:
            return  # rounds wait in the outbox until resume: the draft's memory is unmapped now
        while True:
            try:
                message = self.outbox.get_nowait()
            except queue.Empty:
                break
            self.handle(scheduler, message)
        if self.swap is not None:
            self.swap.ask()
        if self.metrics.gauges:  # stats() is a dict of lists: built only for a server with metrics
            self.metrics.publish(self.stats())

    def handle(self, scheduler: Any, message: Any) -> None:
        """One outbox message; a round is loaded now, or with TP stashed until rank 0's swap order."""
        match message:
            case Ready():
                self.ready = True
            case Error(text):
                self.errors.append(text[-2000:])
                logger.error("sglang-rl drafter co-training: %s", text)
            case Held(metrics):
                self.swap_checks.append(metrics["swap_check"])
            case Round(wired, metrics):
                if "swap_check" in metrics:
                    self.swap_checks.append(metrics["swap_check"])
                weights = [(name, from_wire(w)) for name, w in wired]
                if self.swap is not None:
                    self.swap.received(weights, metrics)
                else:
                    self.apply(scheduler, weights, metrics)

    def apply(self, scheduler: Any, weights: list, metrics: dict) -> None:
        from sglang_rl.adapters import drafter_weights

        start = time.perf_counter()
        try:
            message = drafter_weights.load_draft_tensors(scheduler, weights)
        except Exception as exc:  # noqa: BLE001 - serving goes on with the previous draft
            self.errors.append(f"round {metrics.get('round')} not applied: {exc}")
            logger.exception("sglang-rl drafter co-training: round not applied")
            return
        self.rounds.append({**metrics, "applied_seconds": time.perf_counter() - start, "message": message,
                            "forward_ct": getattr(scheduler, "forward_ct", None)})
        self.acceptance.append(RoundCounts())
        self.held_out.append(RoundCounts())

    def stats(self) -> dict:
        """What GET /drafter_cotrain_stats returns (one list entry per round; index 0 is the
        drafter the server started with)."""
        return {
            "dp_rank": self.dp_rank,
            "rounds": self.draft_round,
            "samples": self.samples,
            "samples_dropped": self.dropped,
            "samples_skipped_busy": self.skipped_busy,
            "rows_sent": self.rows_sent,
            "trainer_received": self.rounds[-1]["received"] if self.rounds else 0,
            "policy_version": self.policy_version,
            "target_head_updates": self.target_head_updates,
            "trainer_ready": self.ready,
            "trainer_alive": self.process.is_alive(),
            "loss": [r["loss"] for r in self.rounds],
            "top1_agreement": [r["top1_agreement"] for r in self.rounds],
            "round_seconds": [r["seconds"] for r in self.rounds],
            "round_swap_seconds": [r["applied_seconds"] for r in self.rounds],
            "rounds_held": sum(not c["swapped"] for c in self.swap_checks),
            "swap_checks": self.swap_checks,
            **({"round_gap_wait_s": [r.get("gap_wait_s", 0.0) for r in self.rounds]} if self.idle is not None else {}),
            "round_policy_version": [r["policy_version"] for r in self.rounds],
            **acceptance_stats(self.acceptance, self.held_out),
            "tv_loss": [r.get("tv_loss") for r in self.rounds],
            "buffer_samples": self.rounds[-1]["buffer_samples"] if self.rounds else 0,
            "buffer_bytes": self.rounds[-1]["buffer_bytes"] if self.rounds else 0,
            "trainer_peak_rss_bytes": self.rounds[-1].get("trainer_peak_rss_bytes") if self.rounds else None,
            "trainer_peak_device_bytes": self.rounds[-1].get("trainer_peak_device_bytes") if self.rounds else None,
            "errors": self.errors[-5:],
            "saved": self.saved,
        }

    def shutdown(self) -> None:
        if self.swap is not None:
            self.swap.close()
        if self.process.is_alive():
            self.inbox.put(Stop())
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()


def runtime_of(scheduler: Any) -> Optional[CotrainRuntime]:
    """The co-training runtime a scheduler keeps (None when it does not co-train)."""
    return getattr(scheduler, ATTR, None)


# --- hooks ---------------------------------------------------------------------------------------


def scheduler_init_after(result: Any, scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: start the co-training process (one GPU) or connect to the
    trainer; with TP every rank does (each loads every round), rank 0 alone sends rollouts."""
    if not getattr(server_args, "drafter_cotrain", False) or runtime_of(scheduler) is not None:
        return
    ps = scheduler.ps
    tp_rank, tp_size, dp_rank = ps.tp_rank, ps.tp_size, ps.dp_rank or 0
    if parallel.needs_hub(server_args) and parallel.trainer_address(server_args)[0] is None:
        raise RuntimeError("--drafter-cotrain with TP/DP: this launcher started no trainer hub; "
                           "give --drafter-cotrain-trainer HOST:PORT")
    if tp_size > 1:
        parallel.check_tp_agree(scheduler)
    runtime = CotrainRuntime(server_args, tp_rank, tp_size, dp_rank)
    if tp_size > 1:
        runtime.swap = parallel.TpSwap(scheduler, leader=tp_rank == 0)
    setattr(scheduler, ATTR, runtime)


def add_request_before(scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler._add_request_to_queue: the scheduler's runtime adopts the request (the
    first point where a new request and its scheduler meet; its rows start with its prefill)."""
    runtime = runtime_of(scheduler)
    if runtime is not None:
        runtime.adopt(req)


class CotrainStatsReqInput(GetWeightsByNameReqInput, kw_only=True):
    """Ask the scheduler for the co-training statistics (answered as a GetWeightsByName reply)."""


def stats_request(scheduler: Any, req: CotrainStatsReqInput) -> GetWeightsByNameReqOutput:
    """The scheduler's answer to the stats request (None on a server that does not co-train)."""
    rt = runtime_of(scheduler)
    if rt is None:
        return GetWeightsByNameReqOutput(parameter=None)
    rt.poll(scheduler)
    stats = rt.stats()
    if rt.swap is not None:  # every TP rank answers this request in the same iteration
        stats["tp_ranks"] = parallel.gather_tp_stats(scheduler, rt)
    return GetWeightsByNameReqOutput(parameter=stats)


def swap_request(scheduler: Any, req: parallel.CotrainSwapReqInput) -> None:
    """Every TP rank, in the same iteration: load the round its rank 0 asked for."""
    rt = runtime_of(scheduler)
    if rt is not None and rt.swap is not None:
        rt.swap.swap(rt, scheduler, req.draft_round)


def request_dispatcher_after(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.init_request_dispatcher: answer the stats request."""
    from sglang.srt.managers.io_struct import hook_custom_types
    from sglang.utils import TypeBasedDispatcher

    hook_custom_types(CotrainStatsReqInput, parallel.CotrainSwapReqInput)
    scheduler._request_dispatcher += TypeBasedDispatcher([
        (CotrainStatsReqInput, partial(stats_request, scheduler)),
        (parallel.CotrainSwapReqInput, partial(swap_request, scheduler))])


def process_input_requests_before(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.process_input_requests: load finished training rounds into the draft."""
    rt = runtime_of(scheduler)
    if rt is not None:
        rt.poll(scheduler)


def weight_update_after(result: Any, updater: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER sglang's target weight updates (SchedulerWeightUpdaterManager, which knows its
    scheduler): a successful one starts a new policy version."""
    rt = runtime_of(getattr(updater, "scheduler", None))
    if rt is not None and getattr(result, "success", False):
        rt.policy_updated()
    return result
