"""The sglang_rl_sync trainer: the co-training metrics it hands to verl's tracker each RL step, and
how often its replay buffer looks for finished rollouts."""

from __future__ import annotations

import pytest
from omegaconf import open_dict

from sglang_rl.integrations.verl.trainer import POLL_INTERVAL_S, step_metrics
from verl_example import example_config


def _stats(rounds: int, loss: list, acceptance: list, held_out: list, version: int = 3, alive: bool = True,
           errors: tuple = (), held: int = 0) -> dict:
    return {"rounds": rounds, "rounds_held": held, "samples": 10 * rounds, "samples_dropped": 1, "policy_version": version,
            "trainer_alive": alive, "errors": list(errors), "loss": loss, "top1_agreement": [0.5] * len(loss),
            "acceptance_length": acceptance, "held_out_acceptance_length": held_out}


def test_counts_add_up_over_servers_and_rates_average_their_newest_rounds() -> None:
    metrics = step_metrics([_stats(2, [3.0, 2.0], [1.1, 1.5, None], [1.0, 1.4, None], version=4),
                            _stats(1, [2.5], [1.2, 1.7], [None, None], version=5, held=2)], rounds_before=1)
    assert metrics["cotrain/rounds"] == 3 and metrics["cotrain/rounds_this_step"] == 2
    assert metrics["cotrain/rounds_held"] == 2
    assert metrics["cotrain/samples"] == 30 and metrics["cotrain/samples_dropped"] == 2
    assert metrics["cotrain/policy_version"] == 5
    assert metrics["cotrain/loss"] == pytest.approx((2.0 + 2.5) / 2)
    # a round whose acceptance is not measured yet falls back to the newest measured one
    assert metrics["cotrain/acceptance_length"] == pytest.approx((1.5 + 1.7) / 2)
    assert metrics["cotrain/held_out_acceptance_length"] == pytest.approx(1.4)
    assert metrics["cotrain/trainer_alive"] == 1.0 and metrics["cotrain/errors"] == 0
    assert all(isinstance(v, float) for v in metrics.values())


def test_before_any_round_there_is_no_loss_and_a_dead_trainer_shows() -> None:
    metrics = step_metrics([_stats(0, [], [None], [None], alive=False, errors=("boom",))], rounds_before=0)
    assert "cotrain/loss" not in metrics and "cotrain/acceptance_length" not in metrics
    assert metrics["cotrain/trainer_alive"] == 0.0 and metrics["cotrain/errors"] == 1


def _replay_buffer(mode: str, model_path: str, poll_interval: float | None = None):
    """The replay buffer verl's trainer of `mode` builds from the example's config."""
    from sglang_rl.integrations.verl.activate import load_plugins_first

    load_plugins_first()
    from verl.trainer.ppo.v1 import get_trainer_cls

    cls = get_trainer_cls(mode)
    trainer = cls.__new__(cls)  # only the buffer: no Ray, no workers
    trainer.config, trainer.trainer_mode = example_config("cotrain", model_path, "/drafter"), "sync"
    if poll_interval is not None:
        with open_dict(trainer.config):
            trainer.config.trainer.v1.sampler.poll_interval = poll_interval
    return trainer._build_replay_buffer()


def test_replay_buffer_polls_often_enough_not_to_round_rollouts_up(model_path: str) -> None:
    # verl's sync sample loop sleeps poll_interval between looks: 2 s rounds a 2.1 s rollout up to 4 s
    verls, ours = _replay_buffer("sync", model_path), _replay_buffer("sglang_rl_sync", model_path)
    assert verls.poll_interval == 2.0
    assert type(ours) is type(verls) and ours.poll_interval == POLL_INTERVAL_S < 0.5
    assert _replay_buffer("sglang_rl_sync", model_path, poll_interval=0.5).poll_interval == 0.5
