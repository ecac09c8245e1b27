"""Unit tests of the batched k-CBS step on hand-made and tiny synthetic log-probs."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from sglang_rl.kcbs import kcbs_initial, kcbs_step, ranked_topk

NAN = float("nan")


def logs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def tiny_model(vocab: int, salt: int = 0) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """A deterministic prefix -> log-prob table with no ties (float64)."""

    def next_logprobs(prefix: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.sha256(repr((salt, vocab, prefix)).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.log_softmax(2.0 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)

    return next_logprobs


@dataclass
class Beam:
    request: int
    tokens: tuple[int, ...]
    score: float
    raw: float
    reason: str | None


def drive(
    model: Callable[[tuple[int, ...]], torch.Tensor],
    ks: list[int],
    steps: int,
    final_prune: list[bool],
    eos: set[int],
) -> list[list[Beam]]:
    """Run k-CBS for several requests in one batch with kcbs_step; return each request's beams."""
    vocab = model(()).numel()
    beams = [Beam(r, (), 0.0, 0.0, None) for r in range(len(ks))]
    k = torch.tensor(ks)
    for step in range(steps):
        if all(b.reason is not None for b in beams):
            break
        last = step == steps - 1
        lp = torch.full((len(beams), vocab), NAN, dtype=torch.float64)
        for i, b in enumerate(beams):
            if b.reason is None:
                lp[i] = model(b.tokens)
        sel = kcbs_step(
            lp,
            torch.tensor([b.request for b in beams]),
            torch.tensor([b.score for b in beams], dtype=torch.float64),
            torch.tensor([b.raw for b in beams], dtype=torch.float64),
            torch.tensor([b.reason is not None for b in beams]),
            k,
            torch.tensor([last and not fp for fp in final_prune]),
        )
        new = []
        for i in range(len(sel)):
            parent = beams[int(sel.parent_beam[i])]
            assert int(sel.request[i]) == parent.request
            if bool(sel.finished[i]):
                assert int(sel.token[i]) == -1 and float(sel.score[i]) == parent.score
                assert float(sel.raw[i]) == parent.raw
                new.append(parent)
                continue
            token = int(sel.token[i])
            reason = "stop" if token in eos else ("length" if last else None)
            tokens = parent.tokens + (token,)
            new.append(Beam(parent.request, tokens, float(sel.score[i]), float(sel.raw[i]), reason))
        beams = new
    return [[b for b in beams if b.request == r] for r in range(len(ks))]


def enumerate_constrained(
    model: Callable[[tuple[int, ...]], torch.Tensor], k: int, steps: int, eos: set[int]
) -> dict[tuple[int, ...], tuple[float, float]]:
    """Every top-k-constrained sequence of <= steps tokens (ending at EOS or at length steps)."""
    out: dict[tuple[int, ...], tuple[float, float]] = {}

    def grow(prefix: tuple[int, ...], score: float, raw: float) -> None:
        if len(prefix) == steps or (prefix and prefix[-1] in eos):
            out[prefix] = (score, raw)
            return
        lp = model(prefix).tolist()
        top = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[:k]
        log_mass = math.log(sum(math.exp(lp[t]) for t in top))
        for t in top:
            grow(prefix + (t,), score + lp[t] - log_mass, raw + lp[t])

    grow((), 0.0, 0.0)
    return out


def test_renormalisation_by_hand() -> None:
    lp = logs(0.05, 0.5, 0.15, 0.3).unsqueeze(0)
    sel = kcbs_initial(lp, torch.tensor([2]), torch.tensor([False]), score_dtype=torch.float64)
    assert sel.token.tolist() == [1, 3]
    assert sel.parent_beam.tolist() == [0, 0]
    assert sel.request.tolist() == [0, 0]
    assert sel.offsets.tolist() == [0, 2]
    assert sel.finished.tolist() == [False, False]
    expected = torch.tensor([math.log(0.5 / 0.8), math.log(0.3 / 0.8)], dtype=torch.float64)
    torch.testing.assert_close(sel.score, expected)
    torch.testing.assert_close(sel.raw, torch.tensor([math.log(0.5), math.log(0.3)], dtype=torch.float64))
    sel3 = kcbs_initial(lp, torch.tensor([3]), torch.tensor([False]), score_dtype=torch.float64)
    assert sel3.token.tolist() == [1, 3, 2]
    assert sel3.score.exp().sum().item() == pytest.approx(1.0)
    assert sel3.score[2].item() == pytest.approx(math.log(0.15 / 0.95))


def test_step_adds_to_parent_scores() -> None:
    lp = torch.stack([logs(0.6, 0.3, 0.1), logs(0.2, 0.2, 0.6)])
    sel = kcbs_step(
        lp,
        torch.tensor([0, 0]),
        torch.tensor([-0.2, -1.0], dtype=torch.float64),
        torch.tensor([-0.3, -1.5], dtype=torch.float64),
        torch.tensor([False, False]),
        torch.tensor([2]),
        torch.tensor([False]),
    )
    expected = sorted(
        [
            (-0.2 + math.log(0.6 / 0.9), -0.3 + math.log(0.6), 0, 0),
            (-0.2 + math.log(0.3 / 0.9), -0.3 + math.log(0.3), 0, 1),
            (-1.0 + math.log(0.6 / 0.8), -1.5 + math.log(0.6), 1, 2),
            (-1.0 + math.log(0.2 / 0.8), -1.5 + math.log(0.2), 1, 0),
        ],
        key=lambda c: -c[0],
    )[:2]
    assert sel.parent_beam.tolist() == [c[2] for c in expected]
    assert sel.token.tolist() == [c[3] for c in expected]
    torch.testing.assert_close(sel.score, torch.tensor([c[0] for c in expected], dtype=torch.float64))
    torch.testing.assert_close(sel.raw, torch.tensor([c[1] for c in expected], dtype=torch.float64))


@pytest.mark.parametrize("salt", range(4))
def test_k1_equals_greedy(salt: int) -> None:
    model = tiny_model(7, salt)
    eos = {6}
    (beams,) = drive(model, [1], 6, [True], eos)
    prefix: tuple[int, ...] = ()
    raw = 0.0
    while len(prefix) < 6 and not (prefix and prefix[-1] in eos):
        lp = model(prefix)
        raw += float(lp.max())
        prefix += (int(lp.argmax()),)
    assert len(beams) == 1
    assert beams[0].tokens == prefix
    assert beams[0].score == 0.0
    assert beams[0].raw == pytest.approx(raw)


def test_keep_all_gives_k_squared() -> None:
    lp = torch.stack([logs(0.4, 0.3, 0.2, 0.1), logs(0.1, 0.2, 0.3, 0.4), logs(0.25, 0.25, 0.4, 0.1)])
    args = (
        lp,
        torch.tensor([0, 0, 0]),
        torch.tensor([0.0, -0.1, -5.0], dtype=torch.float64),
        torch.zeros(3, dtype=torch.float64),
        torch.tensor([False, False, False]),
        torch.tensor([3]),
    )
    full = kcbs_step(*args, torch.tensor([True]))
    pruned = kcbs_step(*args, torch.tensor([False]))
    assert len(full) == 9 and full.offsets.tolist() == [0, 9]
    assert len(pruned) == 3 and pruned.offsets.tolist() == [0, 3]
    assert full.parent_beam[:3].tolist() == pruned.parent_beam.tolist()
    assert full.token[:3].tolist() == pruned.token.tolist()
    assert bool((full.score[:-1] >= full.score[1:]).all())
    pairs = sorted(zip(full.parent_beam.tolist(), full.token.tolist()))
    assert pairs == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2)]
    assert full.parent_beam[-3:].tolist() == [2, 2, 2]
    assert full.token[-3:].tolist() == [2, 0, 1]


def test_finished_beams_are_carried_over() -> None:
    nan_row = torch.full((3,), NAN, dtype=torch.float64)
    lp = torch.stack([nan_row, logs(0.6, 0.3, 0.1)])
    args = (
        lp,
        torch.tensor([0, 0]),
        torch.tensor([-0.1, -0.5], dtype=torch.float64),
        torch.tensor([-0.7, -0.9], dtype=torch.float64),
        torch.tensor([True, False]),
        torch.tensor([2]),
    )
    sel = kcbs_step(*args, torch.tensor([False]))
    assert sel.parent_beam.tolist() == [0, 1]
    assert sel.token.tolist() == [-1, 0]
    assert sel.finished.tolist() == [True, False]
    assert sel.score.tolist() == [-0.1, pytest.approx(-0.5 + math.log(0.6 / 0.9))]
    assert sel.raw.tolist() == [-0.7, pytest.approx(-0.9 + math.log(0.6))]
    full = kcbs_step(*args, torch.tensor([True]))
    assert full.parent_beam.tolist() == [0, 1, 1]
    assert full.token.tolist() == [-1, 0, 1]
    assert full.finished.tolist() == [True, False, False]
    both_done = torch.tensor([True, True])
    all_done = kcbs_step(lp, args[1], args[2], args[3], both_done, args[5], torch.tensor([True]))
    assert all_done.parent_beam.tolist() == [0, 1] and all_done.token.tolist() == [-1, -1]


def test_tie_breaking() -> None:
    tokens, values = ranked_topk(
        torch.tensor(
            [[-1.0, -1.0, -1.0, -2.0, -3.0], [-2.0, -1.0, -1.0, -1.0, -0.5], [-1.0, -1.0, -1.0, -1.0, -1.0]]
        ),
        torch.tensor([2, 3, 4]),
    )
    assert tokens[0, :2].tolist() == [0, 1]
    assert tokens[1, :3].tolist() == [4, 1, 2]
    assert tokens[2, :4].tolist() == [0, 1, 2, 3]
    assert values[1, :3].tolist() == [-0.5, -1.0, -1.0]
    row = torch.tensor([-1.0, -1.0, -3.0, -3.0])
    child = torch.tensor(-0.5) + (row[0] - torch.logsumexp(row[:2], 0))
    tied = kcbs_step(
        torch.stack([torch.full((4,), NAN), row, row]),
        torch.tensor([0, 0, 0]),
        torch.stack([child, torch.tensor(-0.5), torch.tensor(-0.5)]),
        torch.zeros(3),
        torch.tensor([True, False, False]),
        torch.tensor([2]),
        torch.tensor([True]),
    )
    assert bool((tied.score == child).all())
    assert tied.parent_beam.tolist() == [0, 1, 1, 2, 2]
    assert tied.token.tolist() == [-1, 0, 1, 0, 1]
    pruned = kcbs_step(
        torch.stack([torch.full((4,), NAN), row, row]),
        torch.tensor([0, 0, 0]),
        torch.stack([child, torch.tensor(-0.5), torch.tensor(-0.5)]),
        torch.zeros(3),
        torch.tensor([True, False, False]),
        torch.tensor([2]),
        torch.tensor([False]),
    )
    assert pruned.parent_beam.tolist() == [0, 1] and pruned.token.tolist() == [-1, 0]
    finished_last = kcbs_step(
        torch.stack([row, row, torch.full((4,), NAN)]),
        torch.tensor([0, 0, 0]),
        torch.stack([torch.tensor(-0.5), torch.tensor(-0.5), child]),
        torch.zeros(3),
        torch.tensor([False, False, True]),
        torch.tensor([2]),
        torch.tensor([True]),
    )
    assert finished_last.parent_beam.tolist() == [0, 0, 1, 1, 2]
    assert finished_last.token.tolist() == [0, 1, 0, 1, -1]


def test_low_precision_logprobs() -> None:
    lp = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.bfloat16), -1)
    sel = kcbs_initial(lp, torch.tensor([2]), torch.tensor([False]))
    assert sel.token.tolist() == [1, 2] and sel.score.dtype == torch.float32
    assert sel.score.exp().sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_mixed_k_batch_equals_each_request_alone(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = 9
    ks = [1, 3, 2, 4]
    keep_all = [False, True, False, seed % 2 == 0]
    beam_request = torch.tensor([1, 0, 3, 2, 1, 3, 1, 2, 3, 3])
    n = beam_request.numel()
    logprobs = torch.log_softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
    score = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    raw = score - torch.rand(n, generator=gen, dtype=torch.float64)
    finished = torch.rand(n, generator=gen) < 0.3
    logprobs[finished] = NAN
    k, keep = torch.tensor(ks), torch.tensor(keep_all)
    together = kcbs_step(logprobs, beam_request, score, raw, finished, k, keep)
    for r in range(len(ks)):
        idx = (beam_request == r).nonzero().squeeze(1)
        alone = kcbs_step(
            logprobs[idx], torch.zeros(idx.numel(), dtype=torch.long), score[idx], raw[idx], finished[idx],
            torch.tensor([ks[r]]), torch.tensor([keep_all[r]]),
        )
        part = together.rows(r)
        assert together.request[part].tolist() == [r] * len(alone)
        assert together.parent_beam[part].tolist() == idx[alone.parent_beam].tolist()
        assert together.token[part].tolist() == alone.token.tolist()
        assert together.finished[part].tolist() == alone.finished.tolist()
        assert torch.equal(together.score[part], alone.score)
        assert torch.equal(together.raw[part], alone.raw)
        live = int((~finished[idx]).sum())
        expected = live * ks[r] + int(finished[idx].sum())
        assert len(alone) == (expected if keep_all[r] else min(ks[r], expected))


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("final_prune", [True, False])
@pytest.mark.parametrize("salt", range(3))
def test_two_steps_equal_exhaustive_enumeration(k: int, final_prune: bool, salt: int) -> None:
    model = tiny_model(5, salt)
    eos = {int(model(()).argsort(descending=True)[1])}
    space = enumerate_constrained(model, k, 2, eos)
    ranked = sorted(space.items(), key=lambda kv: -kv[1][0])
    expected = ranked[:k] if final_prune else ranked
    (beams,) = drive(model, [k], 2, [final_prune], eos)
    assert [b.tokens for b in beams] == [seq for seq, _ in expected]
    for b, (seq, (score, raw)) in zip(beams, expected):
        assert b.score == pytest.approx(score, abs=1e-12)
        assert b.raw == pytest.approx(raw, abs=1e-12)
        assert b.reason == ("stop" if seq[-1] in eos else "length")


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("final_prune", [True, False])
@pytest.mark.parametrize("salt", range(3))
def test_three_steps_match_beam_semantics_on_enumeration(k: int, final_prune: bool, salt: int) -> None:
    steps = 3
    model = tiny_model(5, 10 + salt)
    eos = {int(model(()).argsort(descending=True)[1])}
    spaces = {t: enumerate_constrained(model, k, t, eos) for t in range(1, steps + 1)}
    kept: list[tuple[int, ...]] = [()]
    for t in range(1, steps + 1):
        pool = [seq for seq in spaces[t] if seq[:-1] in kept or seq in kept]
        pool.sort(key=lambda seq: -spaces[t][seq][0])
        kept = pool if (t == steps and not final_prune) else pool[:k]
    (beams,) = drive(model, [k], steps, [final_prune], eos)
    assert [b.tokens for b in beams] == kept
    for b in beams:
        assert b.score == pytest.approx(spaces[steps][b.tokens][0], abs=1e-12)
        assert b.raw == pytest.approx(spaces[steps][b.tokens][1], abs=1e-12)
    best = max(spaces[steps].values())[0]
    assert beams[0].score <= best + 1e-12
    assert len(beams) <= (k if final_prune else k * k)


def test_batched_requests_match_single_runs() -> None:
    shared = tiny_model(6, 20)
    ks, prune = [3, 1, 2], [False, True, False]
    batch = drive(shared, ks, 3, prune, {5})
    for r in range(3):
        (alone,) = drive(shared, [ks[r]], 3, [prune[r]], {5})
        assert [(b.tokens, b.score, b.raw, b.reason) for b in batch[r]] == [
            (b.tokens, b.score, b.raw, b.reason) for b in alone
        ]
