"""The co-training metrics the sglang_rl_sync trainer hands to verl's tracker each RL step."""

from __future__ import annotations

import pytest

from sglang_rl.integrations.verl.trainer import step_metrics


def _stats(rounds: int, loss: list, acceptance: list, held_out: list, version: int = 3, alive: bool = True,
           errors: tuple = ()) -> dict:
    return {"rounds": rounds, "samples": 10 * rounds, "samples_dropped": 1, "policy_version": version,
            "trainer_alive": alive, "errors": list(errors), "loss": loss, "top1_agreement": [0.5] * len(loss),
            "acceptance_length": acceptance, "held_out_acceptance_length": held_out}


def test_counts_add_up_over_servers_and_rates_average_their_newest_rounds() -> None:
    metrics = step_metrics([_stats(2, [3.0, 2.0], [1.1, 1.5, None], [1.0, 1.4, None], version=4),
                            _stats(1, [2.5], [1.2, 1.7], [None, None], version=5)], rounds_before=1)
    assert metrics["cotrain/rounds"] == 3 and metrics["cotrain/rounds_this_step"] == 2
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
