"""Co-training options around the loss: lr schedule over rounds, replay weighted by policy
version, bf16 autocast, option checks, and acceptance per chain position from sglang's histogram."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_rl.drafter import DrafterTrainer
from sglang_rl.drafter.acceptance import merge_histograms, position_accept_rates, tokens_per_step
from sglang_rl.drafter.buffer import HiddenStateReplayBuffer
from sglang_rl.drafter.cotrain import CotrainLoop
from sglang_rl.drafter.schedule import LrSchedule
from test_drafter_cotrain_loop import config, folders, sample  # noqa: F401 - folders is a fixture
from test_drafter_training import rollout_samples, tiny_drafter


def test_lr_schedule_warms_up_decays_and_holds_its_floor() -> None:
    s = LrSchedule.parse("warmup=2,cosine=4,floor=0.2")
    assert s.factor(0.5) == pytest.approx(0.25) and s.factor(2) == pytest.approx(1.0)
    assert s.factor(4) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert s.factor(6) == pytest.approx(0.2) and s.factor(60) == pytest.approx(0.2)
    assert LrSchedule.parse(None).constant and LrSchedule.parse("warmup=0").constant
    assert LrSchedule.parse("cosine=8").floor == 0.1
    factors = [LrSchedule.parse("cosine=8").factor(r / 4) for r in range(1, 33)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


@pytest.mark.parametrize("text", ["warmup", "warmup=x", "decay=3", "floor=2", "warmup=-1"])
def test_bad_lr_schedules_are_refused_with_the_reason(text: str) -> None:
    with pytest.raises(ValueError, match="lr schedule"):
        LrSchedule.parse(text)


def test_trainer_follows_the_schedule_step_by_step() -> None:
    s = LrSchedule.parse("warmup=1,cosine=1,floor=0.5")
    trainer = DrafterTrainer(tiny_drafter(), lr=1e-2, lr_factor=lambda step: s.factor(step / 4))
    lrs = [h["lr"] for h in trainer.train_steps(rollout_samples(2), 12)]
    assert lrs[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert lrs[7:] == pytest.approx([5e-3] * 5) and lrs[4] > lrs[5] > lrs[6] > 5e-3


def test_replay_draws_the_whole_buffer_newer_versions_more_often() -> None:
    buf = HiddenStateReplayBuffer(1 << 20)
    items = [{"v": v, "i": i, "t": torch.zeros(4)} for v in range(4) for i in range(5)]
    for item in items:
        buf.add(item, step=item["v"])
    counts = [0] * 4
    gen = torch.Generator().manual_seed(0)
    fresh = items[-3:]
    for _ in range(400):
        drawn = buf.replay(4, 0.5, fresh, gen)
        assert len(drawn) == 4 and len({id(d) for d in drawn}) == 4
        assert not any(d is f for d in drawn for f in fresh)
        for d in drawn:
            counts[d["v"]] += 1
    assert counts[0] > 0 and counts[0] < counts[1] < counts[2]
    assert buf.replay(100, 0.5, [], gen) and len(buf.replay(100, 0.5, [], gen)) == len(items)
    assert buf.replay(0, 0.5, [], gen) == [] and buf.replay(3, 1.0, items, gen) == []


def test_rounds_replay_older_samples_after_the_fresh_ones(folders) -> None:  # noqa: F811
    loop = CotrainLoop(config(folders, replay_samples=3))
    for i in range(8):
        loop.add(sample(seed=i, version=i // 4))
    chosen = loop.round_samples()
    newest = loop.buffer.get_all()[-4:]
    assert len(chosen) == 7 and all(a is b for a, b in zip(chosen[:4], newest))
    assert not any(c is n for c in chosen[4:] for n in newest)
    assert loop.train_round()[1]["samples_used"] == 7


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("unroll_steps", 0, "unroll_steps"), ("unroll_steps", 9, "unroll_steps"), ("unroll_steps", True, "unroll_steps"),
    ("replay_samples", -1, "replay_samples"), ("replay_decay", 0.0, "replay_decay"),
    ("feature_noise", -0.1, "feature_noise"), ("feature_noise", True, "feature_noise"),
    ("lr_schedule", "warmup=soon", "lr schedule"), ("train_dtype", "int8", "dtype"),
])
def test_bad_training_options_are_refused(folders, field: str, value, reason: str) -> None:  # noqa: F811
    with pytest.raises(ValueError, match=reason):
        config(folders, **{field: value}).check()


def test_unrolled_bf16_round_trains_float32_weights(folders) -> None:  # noqa: F811
    loop = CotrainLoop(config(folders, unroll_steps=3, train_dtype="bfloat16", lr_schedule="warmup=1"))
    before = {n: t.clone() for n, t in loop.trainer.model.state_dict().items()}
    for i in range(4):
        loop.add(sample(seed=i))
    weights, metrics = loop.train_round()
    model = loop.trainer.model
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert {"top1_agreement_step2", "top1_agreement_step3"} <= set(metrics)
    assert metrics["lr"] == pytest.approx(1e-3)  # a full round of warm-up reaches the base rate
    assert all(t.dtype == torch.bfloat16 for _, t in weights)


def test_position_accept_rates_from_sglang_histograms() -> None:
    # request 1: 10 verify steps that accepted 0, 1, 2, 3 drafts 4, 3, 2, 1 times; request 2: 2 x 3 drafts
    hist = merge_histograms([[4, 3, 2, 1], None, [0, 0, 0, 2], []])
    assert hist == [4, 3, 2, 3]
    assert position_accept_rates(hist, 3) == pytest.approx([8 / 12, 5 / 8, 3 / 5])
    assert tokens_per_step(hist) == pytest.approx(1 + (3 + 4 + 9) / 12)
    assert position_accept_rates([5], 3) == [0.0, None, None] and tokens_per_step([]) is None
    with pytest.raises(ValueError):
        position_accept_rates([1, -1], 2)


def _rows_read(trainer: DrafterTrainer, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The rows the drafter's forward got in each of ``steps`` training steps, and the clean ones."""
    seen: list[torch.Tensor] = []
    forward = trainer.model.forward
    trainer.model.forward = lambda ids, rows, *rest, **kw: (seen.append(rows.detach().clone()),
                                                             forward(ids, rows, *rest, **kw))[1]
    batches = trainer.as_batches(rollout_samples(2))
    trainer.train_steps(batches, steps)
    return seen, [batches[i % len(batches)].hidden_states for i in range(steps)]


def test_feature_noise_perturbs_the_rows_read_within_its_bound_and_not_the_targets() -> None:
    seen, clean = _rows_read(DrafterTrainer(tiny_drafter(), lr=1e-3, feature_noise=0.2, seed=3), 3)
    gaps = [(s - c) / c.abs().mean(dim=-1, keepdim=True) for s, c in zip(seen, clean)]
    assert all(g.abs().max() <= 0.2 + 1e-5 and g.abs().mean() > 0.05 for g in gaps), \
        "U(-0.2, 0.2) x each row's mean absolute value"
    assert not torch.equal(gaps[0], gaps[1]), "a fresh draw every step"
    seen0, clean0 = _rows_read(DrafterTrainer(tiny_drafter(), lr=1e-3), 3)
    assert all(torch.equal(s, c) for s, c in zip(seen0, clean0)), "no noise by default"
    # the loss targets are the clean next rows: the same batches train to the same targets either way
    noisy = DrafterTrainer(tiny_drafter(), lr=1e-3, feature_noise=0.2)
    batch = noisy.as_batches(rollout_samples(2))[0]
    target = batch.target.clone()
    noisy.train_steps([batch], 2)
    assert torch.equal(batch.target, target) and torch.equal(noisy._noisy(batch).target, target)


def test_feature_noise_is_checked() -> None:
    with pytest.raises(ValueError, match="feature_noise"):
        DrafterTrainer(tiny_drafter(), feature_noise=-0.1)


def test_rounds_train_with_the_configured_feature_noise(folders) -> None:  # noqa: F811
    loop = CotrainLoop(config(folders, feature_noise=0.05))
    assert loop.trainer.feature_noise == 0.05
    for i in range(4):
        loop.add(sample(seed=i))
    assert loop.train_round()[1]["loss"] > 0
