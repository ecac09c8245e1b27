"""Unrolled drafter training (sglang_rl.drafter.unroll, DrafterTrainer(unroll_steps=...)):
each unrolled step is what chained drafting computes, its loss is the written-out one, gradients
reach the fed rows, and unrolled training lowers the error of later chain steps."""

from __future__ import annotations

import torch

from sglang_rl.drafter import DrafterTrainer, EagleLossConfig, eagle_loss, sample_from_rows
from sglang_rl.drafter.unroll import unroll_valid, unrolled_predictions
from test_drafter_training import H, V, rollout_samples, tiny_drafter


def packed(lengths: list[int], seed: int = 0, width: int = H, vocab: int = V,
           dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """(ids, rows, positions, cu_seqlens) of random sequences of ``lengths``, packed."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    rows = torch.randn(n, width, generator=gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n_) for n_ in lengths])
    return ids, rows, pos, cu


def chained_row(model, ids, rows, start: int, t: int, step: int) -> torch.Tensor:
    """Draft step ``step + 1`` at position ``t`` the way serving computes it: a teacher-forced
    extend over the committed pairs, then draft decode steps fed their own output rows."""
    m = t - start - step + 1  # committed pairs of this chain
    seq_ids, seq_rows = ids[start:start + m], rows[start:start + m]
    last = model(seq_ids, seq_rows, torch.arange(m))[-1]
    for s in range(1, step + 1):
        seq_ids = torch.cat((seq_ids, ids[start + m - 1 + s].reshape(1)))
        seq_rows = torch.cat((seq_rows, last.reshape(1, -1)))
        last = model(seq_ids, seq_rows, torch.arange(seq_ids.numel()))[-1]
    return last


def assert_steps_are_chained(preds: list, chained, segments: tuple = ((0, 7), (7, 16))) -> None:
    """Every unrolled step's output at every position with a whole chain equals
    ``chained(start, t, step)``, the serving-style chain computed one step at a time."""
    for step, pred in enumerate(preds):
        for a, b in segments:
            for t in range(a + step, b):
                torch.testing.assert_close(pred[t], chained(a, t, step), rtol=1e-10, atol=1e-10)


def test_every_unrolled_step_is_the_chained_draft_step() -> None:
    model = tiny_drafter().double()
    ids, rows, pos, cu = packed([7, 9])
    preds = unrolled_predictions(model, ids, rows, pos, cu, 3)
    assert torch.equal(preds[0], model(ids, rows, pos, cu))
    assert_steps_are_chained(preds, lambda a, t, step: chained_row(model, ids, rows, a, t, step))
    valid = unroll_valid(cu, 16, 2)
    assert valid.tolist() == [0, 0] + [1] * 5 + [0, 0] + [1] * 7


def test_unrolled_loss_is_the_decayed_sum_of_step_losses_and_one_step_is_todays() -> None:
    samples = rollout_samples(3)
    plain = DrafterTrainer(tiny_drafter(), lr=1e-3)
    one = DrafterTrainer(tiny_drafter(), lr=1e-3, unroll_steps=1)
    three = DrafterTrainer(tiny_drafter(), lr=1e-3, unroll_steps=3, unroll_decay=0.8)
    batch = plain.as_batches(samples)[0]
    model = three.model
    pred = model(batch.input_ids, batch.hidden_states, batch.position_ids, batch.cu_seqlens)
    today = eagle_loss(pred, batch.target, batch.loss_mask, model.head_weight)
    assert plain.evaluate(samples)["loss"] == one.evaluate(samples)["loss"]
    assert abs(one.evaluate(samples)["loss"] - float(today.loss.detach())) < 1e-6
    preds = unrolled_predictions(model, batch.input_ids, batch.hidden_states, batch.position_ids, batch.cu_seqlens, 3)
    want = 0.0
    for step, p in enumerate(preds):
        mask = batch.loss_mask * unroll_valid(batch.cu_seqlens, batch.num_pairs, step)
        want += 0.8 ** step * float(eagle_loss(p, batch.target, mask, model.head_weight).loss.detach())
    got = three.evaluate(samples)["loss"]
    assert abs(got - want) < 1e-5 * max(1.0, want) and got > float(today.loss.detach())


def test_gradients_reach_the_fed_rows() -> None:
    """Step 3's loss alone moves the parameters through the rows steps 1 and 2 produced: its
    gradient differs from the one with those rows detached."""
    model = tiny_drafter().double()
    ids, rows, pos, cu = packed([12, 10], seed=1)
    target = torch.randn_like(rows)

    def grads(detach: bool) -> torch.Tensor:
        model.zero_grad()
        preds = (_detached_chain if detach else unrolled_predictions)(model, ids, rows, pos, cu, 3)
        mask = unroll_valid(cu, 22, 2).double()
        ((preds[2] - target).pow(2).sum(-1) * mask).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    full = grads(False)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    detached = grads(True)
    assert (full - detached).abs().max() > 1e-6 * full.abs().max()


def _detached_chain(model, ids, rows, pos, cu, steps: int) -> list[torch.Tensor]:
    """The same unroll with every fed row detached (a hook on the model's feature input)."""
    import sglang_rl.drafter.unroll as unroll

    original = unroll._shift_rows
    unroll._shift_rows = lambda pred, r, bounds: original(pred.detach(), r, bounds)
    try:
        return unrolled_predictions(model, ids, rows, pos, cu, steps)
    finally:
        unroll._shift_rows = original


def chain_errors(trainer: DrafterTrainer, samples: list) -> list[float]:
    """Mean squared row error of chain steps 1..3 on ``samples`` (loss-masked pairs)."""
    batch = trainer.as_batches(samples)[0]
    with torch.no_grad():
        preds = unrolled_predictions(trainer.model, batch.input_ids, batch.hidden_states, batch.position_ids,
                                     batch.cu_seqlens, 3)
    out = []
    for step, p in enumerate(preds):
        mask = batch.loss_mask * unroll_valid(batch.cu_seqlens, batch.num_pairs, step)
        err = (p.float() - batch.target.float()).pow(2).mean(-1)
        out.append(float((err * mask).sum() / mask.sum()))
    return out


def contracting_rollouts(n_samples: int, seed: int, n: int = 24) -> list:
    """Rows of a toy target with memory: ``row_t = tanh(1.2 Q row_{t-1} + embed(x_t) / 2)``
    (Q orthogonal), so an error in a fed row carries into every later one."""
    gen = torch.Generator().manual_seed(seed)
    fixed = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=fixed)
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=fixed))
    out = []
    for _ in range(n_samples):
        ids = torch.randint(0, V, (n,), generator=gen)
        rows, prev = [], torch.zeros(H)
        for t in range(n):
            prev = torch.tanh(1.2 * q @ prev + 0.5 * embed[ids[t]])
            rows.append(prev)
        out.append(sample_from_rows(ids, torch.stack(rows), response_start=4))
    return out


def test_unrolled_training_lowers_later_chain_steps_error_on_held_out_rollouts() -> None:
    """The drafter's own row errors compound along the chain; the same number of optimizer
    steps with the unrolled loss brings chain step 3 closer to the target on unseen rollouts."""
    train, held = contracting_rollouts(6, seed=1), contracting_rollouts(4, seed=2)
    value_only = EagleLossConfig(prob_weight=0.0)
    results = {}
    # three[2] / one[2] after 60, 100, 120, 200 steps: 0.86, 0.75, 0.72, 0.70 (one[2] / one[0]: 1.6-1.9)
    for unroll in (1, 3):
        trainer = DrafterTrainer(tiny_drafter(seed=3), lr=1e-2, loss=value_only, unroll_steps=unroll)
        trainer.train_steps(trainer.as_batches(train), 120)
        results[unroll] = chain_errors(trainer, held)
    one, three = results[1], results[3]
    assert one[2] > 1.2 * one[0], results  # errors compound under teacher-forced training
    assert three[2] < 0.85 * one[2], results
