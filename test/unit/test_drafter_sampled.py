"""The sampled objective (drafter/sampled.py): the TV term against hand-computed values, its
gradient's sign, and its wiring into the EAGLE-1/2 and EAGLE3 losses and the trainer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sglang_rl.drafter import DrafterTrainer, EagleLossConfig, eagle_loss, sample_from_rows
from sglang_rl.drafter.eagle3_model import load_eagle3_drafter
from sglang_rl.drafter.sampled import acceptance_metrics, tv_rows
from sglang_rl.drafter.target_weights import load_target_head
from test_drafter_eagle3_train import random_folder

P = [0.5, 0.3, 0.2]
Q = [0.2, 0.25, 0.55]


def logs(values: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(v) for v in values]])


def test_tv_term_is_one_minus_the_overlap_by_hand() -> None:
    # T = 1: min(.5,.2) + min(.3,.25) + min(.2,.55) = 0.65
    assert float(tv_rows(logs(Q), torch.tensor([P]), 1.0)) == pytest.approx(0.35, abs=1e-6)
    # T = 0.5 squares and renormalises q: (0.04, 0.0625, 0.3025) / 0.405; p given at that T
    p_half = [v * v / 0.38 for v in P]
    q_half = [v * v / 0.405 for v in Q]
    by_hand = 1 - sum(min(a, b) for a, b in zip(p_half, q_half))
    assert float(tv_rows(logs(Q), torch.tensor([p_half]), 0.5)) == pytest.approx(by_hand, abs=1e-6)
    assert by_hand == pytest.approx(1 - (0.04 / 0.405 + 0.0625 / 0.405 + 0.04 / 0.38), abs=1e-9)


def test_tv_gradient_raises_the_draft_only_where_it_is_below_the_target() -> None:
    z = logs(Q).requires_grad_(True)
    tv_rows(z, torch.tensor([P]), 1.0).sum().backward()
    # d tv / dz_j = -(q_j [q_j < p_j] - q_j * sum_{q < p} q), sum_{q < p} q = 0.45
    expected = [-0.2 * 0.55, -0.25 * 0.55, 0.55 * 0.45]
    torch.testing.assert_close(z.grad[0], torch.tensor(expected), atol=1e-6, rtol=0)
    assert (z.grad[0, :2] < 0).all() and z.grad[0, 2] > 0
    with torch.no_grad():
        stepped = z - 0.5 * z.grad
    assert float(tv_rows(stepped, torch.tensor([P]), 1.0)) < 0.35


def test_acceptance_metrics_on_a_draft_vocabulary_by_hand() -> None:
    # target over 4 ids, draft over target ids (0, 2): p's mass on 1 and 3 is never accepted
    target = logs([0.4, 0.1, 0.3, 0.2])
    draft = logs([0.6, 0.4])
    got = acceptance_metrics(target, draft, 1.0, draft_ids=torch.tensor([0, 2]))
    assert got["sampled"] == pytest.approx(0.4 + 0.3, abs=1e-6)
    assert got["target_only"] == pytest.approx(0.4, abs=1e-6)
    assert got["greedy"] == 1.0


@pytest.mark.parametrize("mode", [{}, {"soft_topk": 3}, {"vocab_subset": [0, 1, 2]}])
def test_eagle_loss_adds_the_weighted_tv_term(mode: dict) -> None:
    """Head = identity, so logits are the rows: the sampled loss is the greedy one plus
    tv_weight x the hand-computed TV at T = 0.5, in every soft-vocabulary mode."""
    head = torch.eye(3)
    pred, target = logs(Q).repeat(2, 1), logs(P).repeat(2, 1)
    mask = torch.tensor([1.0, 0.0])
    greedy = eagle_loss(pred, target, mask, head, EagleLossConfig(**mode))
    sampled = eagle_loss(pred, target, mask, head,
                         EagleLossConfig(objective="sampled", temperature=0.5, tv_weight=2.0, **mode))
    tv = 1 - (0.04 / 0.405 + 0.0625 / 0.405 + 0.04 / 0.38)
    assert greedy.tv_loss == 0.0 and sampled.tv_loss == pytest.approx(tv, abs=1e-5)
    assert float(sampled.loss) == pytest.approx(float(greedy.loss) + 2.0 * tv, abs=1e-5)
    assert sampled.prob_loss == pytest.approx(greedy.prob_loss, abs=1e-6)


def test_bad_objective_or_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="objective"):
        EagleLossConfig(objective="tv")
    with pytest.raises(ValueError, match="temperature"):
        EagleLossConfig(objective="sampled", temperature=0.0)


def test_eagle3_sampled_objective_reads_the_final_rows_and_lowers_the_tv(tmp_path: Path) -> None:
    """Rows [aux | final]: the drafter reads aux, p_T comes from the target head over the final
    part of the next row; the trainer's tv_loss equals 1 - acceptance_metrics' sampled value."""
    folder, target_dir = random_folder(tmp_path)
    model = load_eagle3_drafter(folder, target_dir)
    head = load_target_head(target_dir).lm_head
    width, hidden = model.feature_width, model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    samples = []
    for _ in range(3):  # each next token is the target's argmax over the row before: labels agree with p
        rows = torch.randn(16, width + hidden, generator=gen)
        ids = torch.cat((torch.zeros(1, dtype=torch.long), F.linear(rows[:-1, width:], head).argmax(-1)))
        samples.append(sample_from_rows(ids, rows, 2))
    config = EagleLossConfig(objective="sampled", temperature=0.7)
    with pytest.raises(ValueError, match="target_head"):
        DrafterTrainer(model, loss=config)
    trainer = DrafterTrainer(model, lr=3e-3, loss=config, target_head=head)
    with pytest.raises(ValueError, match=r"\[aux \| final\]"):
        trainer.as_batches([sample_from_rows(torch.arange(8), torch.randn(8, width), 2)])
    batch = trainer.as_batches(samples)[0]
    before = trainer.evaluate(batch)
    keep = batch.loss_mask > 0
    with torch.no_grad():
        logits = model.logits(model(batch.input_ids, batch.hidden_states, batch.position_ids, batch.cu_seqlens))
        rows = torch.cat([s.hidden_states[1:] for s in samples]).bfloat16().float()  # the batch packs bf16
        target_logits = F.linear(rows[keep][:, width:], head)
    hot = model.to_target_ids(torch.arange(model.draft_vocab_size))
    oracle = acceptance_metrics(target_logits, logits[keep], 0.7, draft_ids=hot)
    assert before["tv_loss"] == pytest.approx(1 - oracle["sampled"], abs=1e-5)
    trainer.train_steps(batch, 15)
    assert trainer.evaluate(batch)["tv_loss"] < before["tv_loss"] - 0.01


@pytest.mark.parametrize("unroll", [1, 2])
def test_cotrain_round_trains_the_sampled_objective(tmp_path: Path, unroll: int) -> None:
    """A co-training round under `objective="sampled"` reports its TV term, and the same round
    under the greedy objective reports none: the option reaches the trainer, unrolled or not."""
    from sglang_rl.drafter import init_drafter, save_drafter
    from sglang_rl.drafter.cotrain import CotrainConfig, CotrainLoop
    from test_drafter_cotrain_loop import sample
    from test_drafter_checkpoint import write_target

    target = write_target(tmp_path / "target")
    save_drafter(init_drafter(target, seed=0), tmp_path / "draft")
    tv = {}
    for objective in ("greedy", "sampled"):
        loop = CotrainLoop(CotrainConfig(str(tmp_path / "draft"), str(target), samples_per_round=2, steps=2,
                                         window=24, objective=objective, temperature=0.7, unroll_steps=unroll))
        for i in range(2):
            loop.add(sample(seed=i))
        tv[objective] = loop.train_round()[1]["tv_loss"]
    assert tv["greedy"] == 0.0 and 0.0 < tv["sampled"] < 1.0


def test_cotrain_loop_refuses_sampled_for_an_eagle3_drafter(tmp_path: Path) -> None:
    """A shared trainer sees no server flags: it refuses the sampled objective for EAGLE3 itself."""
    from sglang_rl.drafter.cotrain import CotrainConfig, CotrainLoop

    folder, target_dir = random_folder(tmp_path)
    CotrainLoop(CotrainConfig(str(folder), str(target_dir)))
    with pytest.raises(ValueError, match="objective sampled needs EAGLE-1/2"):
        CotrainLoop(CotrainConfig(str(folder), str(target_dir), objective="sampled"))
