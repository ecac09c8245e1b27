"""Checked swaps: a round replaces the served drafter only if it scores at least as well on the
rollouts it held back from training; a worse round is held and training goes on from it."""

from __future__ import annotations

import pytest
import torch

from sglang_rl.drafter import DrafterTrainer
from sglang_rl.drafter.cotrain import CotrainLoop
from sglang_rl.drafter.messages import RolloutSample
from sglang_rl.drafter.swap_check import SwapCheck, chain_score
from test_drafter_cotrain_loop import config, folders  # noqa: F401 - folders is a fixture
from test_drafter_training import rollout_samples, tiny_drafter


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_chain_score_is_the_expected_number_of_accepted_drafts() -> None:
    assert chain_score({"top1_agreement": 0.5}) == 0.5
    assert chain_score({"top1_agreement": 0.5, "top1_agreement_step2": 0.5, "top1_agreement_step3": 1.0}) \
        == pytest.approx(0.5 + 0.25 + 0.25)


def test_a_better_round_is_swapped_in_and_a_worse_one_held() -> None:
    samples = rollout_samples(6)
    trainer = DrafterTrainer(tiny_drafter(), lr=1e-2)
    check = SwapCheck(trainer.model, 2)
    train, held = check.hold_back(samples)
    assert len(train) == 4 and all(h is s for h, s in zip(held, samples[-2:]))
    trainer.train_steps(train, 60)
    first = check.decide(trainer, held)
    assert first["swapped"] and first["trained"] > first["served"] and first["samples"] == 2, first
    good = _params(trainer.model)
    assert all(torch.equal(check.served[n], t) for n, t in good.items())
    with torch.no_grad():  # a round that ruins the drafter
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.mul_(-4.0)
    ruined = _params(trainer.model)
    second = check.decide(trainer, held)
    assert not second["swapped"] and second["trained"] < second["served"], second
    assert second["served"] == pytest.approx(first["trained"])
    assert all(torch.equal(check.served[n], t) for n, t in good.items()), "the server keeps the good drafter"
    assert all(torch.equal(p, ruined[n]) for n, p in _params(trainer.model).items()), "training goes on from the round"


def test_held_back_rollouts_without_pairs_to_score_load_the_round() -> None:
    from sglang_rl.drafter.data import sample_from_rows
    from test_drafter_training import H, V

    trainer = DrafterTrainer(tiny_drafter(), lr=1e-2)
    check = SwapCheck(trainer.model, 1)
    prompt_only = sample_from_rows(torch.randint(0, V, (12,)), torch.randn(12, H), response_start=12)
    trainer.train_steps(rollout_samples(3), 5)
    result = check.decide(trainer, [prompt_only])
    assert result["swapped"] and result["served"] is None and result["trained"] is None
    assert all(torch.equal(check.served[n], t) for n, t in _params(trainer.model).items())


def test_unrolled_training_scores_the_whole_chain() -> None:
    trainer = DrafterTrainer(tiny_drafter(), lr=1e-2, unroll_steps=3)
    metrics = trainer.evaluate(rollout_samples(2))
    assert {"top1_agreement_step2", "top1_agreement_step3"} <= set(metrics)
    assert chain_score(metrics) >= metrics["top1_agreement"]


def _rollout(seed: int) -> RolloutSample:
    """A learnable rollout over test_drafter_checkpoint's tiny target shape: row t is a fixed
    random function of token t and row t - 1."""
    from test_drafter_checkpoint import H, V

    gen = torch.Generator().manual_seed(0)
    a, b, embed = torch.randn(H, H, generator=gen) / 4, torch.randn(H, H, generator=gen) / 4, torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(100 + seed))
    rows, prev = [], torch.zeros(H)
    for t in range(30):
        prev = torch.tanh(a @ embed[ids[t]] + b @ prev) * 2
        rows.append(prev)
    return RolloutSample(ids, torch.stack(rows), 4, 0)


def test_loop_holds_back_the_newest_samples_and_sends_no_weights_for_a_held_round(folders) -> None:  # noqa: F811
    loop = CotrainLoop(config(folders, swap_check_samples=1, steps=40, lr=1e-2))
    for i in range(4):
        loop.add(_rollout(i))
    weights, metrics = loop.train_round()
    check = metrics["swap_check"]
    assert metrics["samples_used"] == 3 and check["round"] == 1 and check["samples"] == 1
    assert check["swapped"] and weights is not None, check  # 40 steps on learnable rows beat the random init
    for group in loop.trainer.optimizer.param_groups:  # a round that wrecks the drafter
        group["lr"] = 0.9
    for i in range(4, 8):
        loop.add(_rollout(i))
    weights, metrics = loop.train_round()
    assert weights is None and not metrics["swap_check"]["swapped"], metrics["swap_check"]
    assert metrics["swap_check"]["trained"] < metrics["swap_check"]["served"]


def test_a_server_runtime_counts_the_rounds_its_trainer_held(tmp_path) -> None:
    """The real co-training process behind a server's runtime: a trained drafter, then a round at
    lr 0.9 that wrecks it. The process sends `held` and the server keeps serving its drafter."""
    from sglang_rl.adapters.cotrain import CotrainRuntime
    from sglang_rl.drafter import init_drafter, save_drafter
    from sglang_rl.drafter.cotrain import CotrainConfig
    from sglang_rl.drafter.messages import Held, Sample
    from sglang_rl.server_args import RLServerArgs
    from test_drafter_checkpoint import write_target

    target = write_target(tmp_path / "target")
    save_drafter(init_drafter(target, seed=0), tmp_path / "d0")
    loop = CotrainLoop(CotrainConfig(str(tmp_path / "d0"), str(target), samples_per_round=8, steps=60, lr=1e-2,
                                     window=32, samples_per_step=2))
    for i in range(8):
        loop.add(_rollout(i))
    loop.train_round()
    save_drafter(loop.trainer.model, tmp_path / "good")
    args = RLServerArgs(model_path=str(target), speculative_algorithm="EAGLE", drafter_cotrain=True,
                        speculative_draft_model_path=str(tmp_path / "good"), device="cpu",
                        drafter_cotrain_swap_check_samples=1, drafter_cotrain_samples_per_round=4,
                        drafter_cotrain_steps=20, drafter_cotrain_lr=0.9, drafter_cotrain_window=32,
                        drafter_cotrain_samples_per_step=2, drafter_cotrain_threads=1)
    runtime = CotrainRuntime(args)
    try:
        runtime.handle(None, runtime.outbox.get(timeout=120))
        assert runtime.ready
        for i in range(8, 12):
            runtime.inbox.put(Sample.of(_rollout(i)))
        message = runtime.outbox.get(timeout=120)
        assert isinstance(message, Held), message
        runtime.handle(None, message)
        stats = runtime.stats()
        assert stats["rounds"] == 0 and stats["rounds_held"] == 1 and not stats["errors"], stats
        [check] = stats["swap_checks"]
        assert check["round"] == 1 and not check["swapped"] and check["trained"] < check["served"], check
    finally:
        runtime.shutdown()


@pytest.mark.parametrize("value", [-1, 4, True, 1.5])
def test_swap_check_samples_must_leave_samples_to_train_on(folders, value) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="swap_check_samples"):
        config(folders, swap_check_samples=value).check()
