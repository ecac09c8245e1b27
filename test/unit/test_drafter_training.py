"""Drafter loss, data path and trainer (sglang_rl.drafter.loss/data/trainer) on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sglang_rl.drafter import (
    DrafterConfig,
    DrafterTrainer,
    EagleDrafter,
    EagleLossConfig,
    TargetHead,
    batches_from_samples,
    eagle_loss,
    sample_from_rows,
    soft_targets,
)
from sglang_rl.drafter import build_eagle_batch

H, V = 16, 50


def tiny_drafter(seed: int = 0) -> EagleDrafter:
    raw = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": V, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "hidden_act": "silu", "rope_theta": 10000.0,
    }
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=gen)
    model = EagleDrafter(DrafterConfig.from_dict(raw), TargetHead(embed=embed, lm_head=embed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def rollout_samples(n_samples: int = 3, seed: int = 0) -> list:
    """Rows of a fixed random 'target': row t = tanh(A @ embed(x_t) + B @ row_{t-1}), so the
    next row is a learnable function of the current row and the next token."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(0))
    a, b = torch.randn(H, H, generator=gen) / 4, torch.randn(H, H, generator=gen) / 4
    out = []
    for i in range(n_samples):
        n = 20 + 5 * i
        ids = torch.randint(0, V, (n,), generator=gen)
        rows, prev = [], torch.zeros(H)
        for t in range(n):
            prev = torch.tanh(a @ embed[ids[t]] + b @ prev) * 2
            rows.append(prev)
        out.append(sample_from_rows(ids, torch.stack(rows), response_start=6))
    return out


def reference_loss(pred, target, mask, head, wv, wp):
    """The EAGLE loss written out directly (no masking shortcuts)."""
    value = F.smooth_l1_loss(pred, target, reduction="none").mean(-1)
    p = (target @ head.T).softmax(-1)
    logp = (pred @ head.T).log_softmax(-1)
    prob = -(p * logp).sum(-1)
    return wv * (mask * value).sum() / mask.sum() + wp * (mask * prob).sum() / mask.sum()


def test_loss_matches_written_out_formula_and_default_weights() -> None:
    assert (EagleLossConfig().value_weight, EagleLossConfig().prob_weight) == (1.0, 0.1)
    gen = torch.Generator().manual_seed(1)
    pred, target = torch.randn(12, H, generator=gen), torch.randn(12, H, generator=gen)
    head = torch.randn(V, H, generator=gen)
    mask = (torch.rand(12, generator=gen) > 0.4).float()
    for wv, wp in ((1.0, 0.1), (0.5, 0.5)):
        out = eagle_loss(pred, target, mask, head, EagleLossConfig(value_weight=wv, prob_weight=wp))
        torch.testing.assert_close(out.loss, reference_loss(pred, target, mask, head, wv, wp))
        assert out.num_tokens == float(mask.sum())


def test_masked_pairs_contribute_nothing() -> None:
    gen = torch.Generator().manual_seed(2)
    head = torch.randn(V, H, generator=gen)
    target = torch.randn(10, H, generator=gen)
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 0], dtype=torch.float32)
    changed = target.clone()
    changed[mask == 0] = 100.0
    grads = []
    for tgt in (target, changed):
        pred = torch.randn(10, H, generator=torch.Generator().manual_seed(3)).requires_grad_()
        out = eagle_loss(pred, tgt, mask, head)
        out.loss.backward()
        grads.append((out.loss.detach(), pred.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])
    assert torch.all(grads[0][1][mask == 0] == 0) and torch.any(grads[0][1][mask == 1] != 0)
    empty = eagle_loss(torch.randn(4, H, requires_grad=True), target[:4], torch.zeros(4), head)
    assert float(empty.loss.detach()) == 0.0 and empty.num_tokens == 0.0


def test_reduced_vocabulary_soft_loss() -> None:
    gen = torch.Generator().manual_seed(4)
    pred, target = torch.randn(8, H, generator=gen), torch.randn(8, H, generator=gen)
    head = torch.randn(V, H, generator=gen)
    mask = torch.ones(8)
    full = eagle_loss(pred, target, mask, head, EagleLossConfig(prob_weight=1.0))
    # top-N with N = V, or the whole vocabulary as the subset, is the full loss
    for cfg in (EagleLossConfig(prob_weight=1.0, soft_topk=V), EagleLossConfig(prob_weight=1.0, vocab_subset=range(V))):
        torch.testing.assert_close(eagle_loss(pred, target, mask, head, cfg).loss, full.loss)
    # top-N: both distributions renormalised over each row's N largest target logits
    n = 5
    top = eagle_loss(pred, target, mask, head, EagleLossConfig(value_weight=0.0, prob_weight=1.0, soft_topk=n))
    tl, pl = target @ head.T, pred @ head.T
    ids = tl.topk(n, dim=-1).indices
    expected = -(tl.gather(1, ids).softmax(-1) * pl.gather(1, ids).log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(top.loss, expected)
    # fixed subset
    subset = torch.tensor([3, 7, 11, 40])
    sub = eagle_loss(pred, target, mask, head, EagleLossConfig(value_weight=0.0, prob_weight=1.0, vocab_subset=subset))
    expected = -(tl[:, subset].softmax(-1) * pl[:, subset].log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(sub.loss, expected)
    soft = soft_targets(target, head, EagleLossConfig(soft_topk=n))
    torch.testing.assert_close(soft.probs.sum(-1), torch.ones(8))
    assert torch.equal(soft.top1, tl.argmax(-1))


def test_loss_config_is_validated() -> None:
    with pytest.raises(ValueError, match="alternatives"):
        EagleLossConfig(soft_topk=4, vocab_subset=[1, 2])
    with pytest.raises(ValueError, match="soft_topk"):
        EagleLossConfig(soft_topk=0)
    with pytest.raises(ValueError, match="non-negative"):
        EagleLossConfig(prob_weight=-1.0)
    with pytest.raises(ValueError, match="vocab_subset"):
        eagle_loss(torch.zeros(2, H), torch.zeros(2, H), torch.ones(2), torch.zeros(V, H), EagleLossConfig(vocab_subset=[V]))


def test_sample_from_rows_builds_the_verl_sample() -> None:
    ids, rows = torch.arange(7), torch.randn(7, H)
    s = sample_from_rows(ids, rows, response_start=3)
    assert s.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert bool(s.row_mask.all()) and s.hidden_states.dtype == torch.bfloat16
    batch = build_eagle_batch([s])
    # pair t: token x_{t+1}, row h_t, target h_{t+1}; loss where x_{t+1} is a response token
    assert batch["input_ids"][0].tolist() == list(range(1, 7))
    assert torch.equal(batch["hidden_states"][0], rows[:-1].to(torch.bfloat16))
    assert torch.equal(batch["target"][0], rows[1:].to(torch.bfloat16))
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="hidden_states"):
        sample_from_rows(ids, rows[:6], 3)
    with pytest.raises(ValueError, match="response_start"):
        sample_from_rows(ids, rows, 9)
    with pytest.raises(ValueError, match="NaN"):
        sample_from_rows(ids, torch.full((7, H), float("nan")), 3)
    assert len(batches_from_samples(rollout_samples(3), samples_per_batch=2)) == 2


def test_training_lowers_the_loss_and_raises_agreement() -> None:
    torch.manual_seed(0)
    model = tiny_drafter()
    trainer = DrafterTrainer(model, lr=1e-2, loss=EagleLossConfig(prob_weight=0.5))
    samples = rollout_samples(3)
    before = trainer.evaluate(samples)
    history = trainer.train_steps(samples, 80)
    after = trainer.evaluate(samples)
    assert len(history) == 80 and history[-1]["step"] == 80.0
    assert after["loss"] < 0.5 * before["loss"]
    assert after["top1_agreement"] > before["top1_agreement"]
    assert history[0]["num_loss_pairs"] == float(sum(s.input_ids.numel() - 6 for s in samples))
    assert all(math.isfinite(h["grad_norm"]) and h["skipped"] == 0.0 for h in history)


def test_reduced_vocabulary_training_lowers_the_loss() -> None:
    torch.manual_seed(0)
    trainer = DrafterTrainer(tiny_drafter(), lr=1e-2, loss=EagleLossConfig(soft_topk=8))
    history = trainer.train_steps(rollout_samples(2), 40)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert all(0.0 <= h["top1_agreement"] <= 1.0 for h in history)


def test_samples_and_batch_dicts_give_the_same_step() -> None:
    samples = rollout_samples(2)
    results = []
    for data in (samples, build_eagle_batch(samples), [build_eagle_batch(samples)]):
        torch.manual_seed(0)
        trainer = DrafterTrainer(tiny_drafter(), lr=1e-3)
        results.append(trainer.train_steps(data, 2))
    for other in results[1:]:
        assert [h["loss"] for h in other] == [h["loss"] for h in results[0]]


def test_a_batch_without_loss_pairs_changes_nothing() -> None:
    ids, rows = torch.randint(0, V, (9,)), torch.randn(9, H)
    prompt_only = sample_from_rows(ids, rows, response_start=9)
    model = tiny_drafter()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    history = DrafterTrainer(model, lr=1.0).train_steps([prompt_only], 3)
    assert all(h["skipped"] == 1.0 and h["loss"] == 0.0 for h in history)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="no training pairs"):
        DrafterTrainer(model).train_steps([sample_from_rows(ids[:1], rows[:1], 0)], 1)
    with pytest.raises(TypeError):
        DrafterTrainer(model).train_steps([prompt_only, build_eagle_batch([prompt_only])], 1)


def test_masked_pairs_do_not_steer_training() -> None:
    """Changing the targets of prompt pairs (no loss) leaves the trained weights identical."""
    samples = rollout_samples(2)
    batch = build_eagle_batch(samples)
    other = dict(batch)
    other["target"] = batch["target"].clone()
    other["target"][batch["loss_mask"] == 0] = 7.0
    weights = []
    for data in (batch, other):
        model = tiny_drafter()
        DrafterTrainer(model, lr=1e-2).train_steps(data, 3)
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_chunked_soft_loss_equals_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_rl.drafter import loss as loss_module

    gen = torch.Generator().manual_seed(7)
    target, head = torch.randn(40, H, generator=gen), torch.randn(V, H, generator=gen)
    mask = (torch.rand(40, generator=gen) > 0.3).float()
    for config in (EagleLossConfig(prob_weight=1.0), EagleLossConfig(prob_weight=1.0, soft_topk=6)):
        results = []
        for full_chunk, topk_elements in ((10_000, 1 << 30), (7, 6 * H * 7)):
            monkeypatch.setattr(loss_module, "FULL_VOCAB_CHUNK", full_chunk)
            monkeypatch.setattr(loss_module, "TOPK_GATHER_ELEMENTS", topk_elements)
            pred = torch.randn(40, H, generator=torch.Generator().manual_seed(8)).requires_grad_()
            out = eagle_loss(pred, target, mask, head, config)
            out.loss.backward()
            results.append((out.loss.detach(), pred.grad, out.pred_top1))
        torch.testing.assert_close(results[0][0], results[1][0])
        torch.testing.assert_close(results[0][1], results[1][1])
        assert (results[0][2] is None and results[1][2] is None) or torch.equal(results[0][2], results[1][2])
