"""verl's synchronous PPO trainer, with drafter co-training statistics in its tracker every RL step.

verl 0.9.1's v1 trainers are chosen by name (`trainer.v1.trainer_mode`) from verl's trainer
registry (`register_trainer`). `activate.py` registers this one as `sglang_rl_sync` once verl's
`verl.trainer.ppo.v1` package is imported. It is verl's `sync` trainer; after each step's weight
update it asks every rollout server for its co-training statistics and hands them to the metrics
verl logs for that step (`cotrain/*`, see `step_metrics`). Its replay buffer looks for finished
rollouts every `trainer.v1.sampler.poll_interval` seconds (0.1 unless set) instead of verl's fixed
2 s, which rounds every rollout up to the next 2 s (a 2.1 s rollout counts, and waits, 4 s).

    trainer.v1.trainer_mode=sglang_rl_sync
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from omegaconf import open_dict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

logger = logging.getLogger(__name__)

TRAINER_MODE = "sglang_rl_sync"
STATS_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.1  # verl's ReplayBuffer default is 2.0 and its trainer passes none


def _last(values: list) -> Optional[float]:
    """The newest non-empty entry of a per-round list (acceptance of a round may not be known yet)."""
    return next((v for v in reversed(values) if v is not None), None)


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def step_metrics(stats: list[dict], rounds_before: int) -> dict[str, float]:
    """verl metrics of one RL step from the co-training statistics of every rollout server
    (GET /drafter_cotrain_stats's JSON); counts are summed over servers, rates averaged."""
    rounds = sum(s["rounds"] for s in stats)
    metrics = {
        "cotrain/rounds": rounds,
        "cotrain/rounds_this_step": rounds - rounds_before,
        "cotrain/rounds_held": sum(s["rounds_held"] for s in stats),  # by the swap check, if on
        "cotrain/policy_version": max(s["policy_version"] for s in stats),
        "cotrain/samples": sum(s["samples"] for s in stats),
        "cotrain/samples_dropped": sum(s["samples_dropped"] for s in stats),
        "cotrain/trainer_alive": float(all(s["trainer_alive"] for s in stats)),
        "cotrain/errors": sum(len(s["errors"]) for s in stats),
        "cotrain/loss": _mean([_last(s["loss"]) for s in stats]),
        "cotrain/top1_agreement": _mean([_last(s["top1_agreement"]) for s in stats]),
        "cotrain/acceptance_length": _mean([_last(s["acceptance_length"]) for s in stats]),
        "cotrain/held_out_acceptance_length": _mean([_last(s["held_out_acceptance_length"]) for s in stats]),
    }
    return {key: float(value) for key, value in metrics.items() if value is not None}


def collect_stats(replicas: list[Any], timeout: float = STATS_TIMEOUT_S) -> list[dict]:
    """Co-training statistics of every server of `replicas` that runs co-training (servers of
    another class, or without --drafter-cotrain, give none)."""
    import ray

    handles = [server for replica in replicas for server in getattr(replica, "servers", [])]
    calls = [server.drafter_cotrain_stats.remote() for server in handles
             if hasattr(server, "drafter_cotrain_stats")]
    return [stats for stats in ray.get(calls, timeout=timeout) if stats is not None]


@register_trainer(TRAINER_MODE)
class SGLangRLTrainerSync(PPOTrainerSync):
    """verl's `sync` trainer plus `cotrain/*` metrics every step (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        # verl branches on trainer_mode == "sync" (replay buffer, refills): this trainer is that mode
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)
        self._cotrain_rounds = 0

    def _build_replay_buffer(self) -> Any:
        """verl's replay buffer, polling for finished rollouts every `poll_interval` seconds."""
        buffer = super()._build_replay_buffer()
        if hasattr(buffer, "poll_interval"):  # verl's own buffers; a custom sampler keeps its own
            buffer.poll_interval = float(self.config.trainer.v1.sampler.get("poll_interval", POLL_INTERVAL_S))
        return buffer

    def on_step_end(self) -> None:
        super().on_step_end()
        manager = getattr(self, "llm_server_manager", None)
        if manager is None:
            return
        try:
            stats = collect_stats(manager.get_replicas())
        except Exception:  # noqa: BLE001 - statistics never stop training
            logger.exception("sglang-rl: drafter co-training statistics not collected this step")
            return
        if not stats:
            return
        metrics = step_metrics(stats, self._cotrain_rounds)
        self._cotrain_rounds = int(metrics["cotrain/rounds"])
        # merged into this step's logged metrics by verl (PPOTrainer._consume_sync_metrics)
        self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}), **metrics}
