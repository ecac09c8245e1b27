"""Seeded sampling core: the noise is a pure function of (seed, position, token), the sampler
draws from sglang's filtered distribution, and the verifier's check never convicts honest tokens
whose logits moved by less than its epsilon."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_rl.fingerprint.seeded_sampling import (
    EPSILON,
    SamplingClaim,
    SeededCheck,
    check_position,
    gumbel_noise,
    seeded_check,
    seeded_token,
    uniform_noise,
)
from sglang_rl.request_options import RequestOptionError, seeded_claim, validate_seeded_sampling

M32 = 0xFFFFFFFF


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = h * 0x85EBCA6B % (1 << 32)
    h ^= h >> 13
    h = h * 0xC2B2AE35 % (1 << 32)
    return h ^ (h >> 16)


def _reference_uniform(seed: int, position: int, token: int) -> float:
    """The same hash in unbounded Python integers (no int64 tricks)."""
    words = []
    for salt in (0, 1):
        key = 0x9E3779B9 ^ salt
        for word in (seed % 2**32, seed >> 32, position % 2**32, position >> 32):
            key = _fmix(((key ^ word) + 0x7F4A7C15) % 2**32)
        h = _fmix(((token ^ key) * 0x9E3779B1 % 2**32) ^ (key >> 1))
        words.append(_fmix(h ^ key))
    return ((words[0] >> 6) * 2**27 + (words[1] >> 5) + 0.5) / 2**53


@pytest.mark.parametrize("seed,position", [(0, 0), (1234, 77), (2**64 - 1, 2**40 + 3), (2**33 + 5, 1)])
def test_noise_equals_plain_integer_arithmetic(seed, position) -> None:
    tokens = torch.tensor([0, 1, 2, 1000, 49151, 2**31 - 1, 2**32 - 1])
    got = uniform_noise(seed, position, tokens).tolist()
    assert got == [_reference_uniform(seed, position, t) for t in tokens.tolist()]


def test_noise_is_gumbel_and_depends_on_each_input() -> None:
    g = gumbel_noise(7, 10, torch.arange(200_000))
    assert abs(float(g.mean()) - 0.5772) < 0.01 and abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.01
    ids = torch.tensor([5, 17, 40_000])
    base = gumbel_noise(7, 10, ids)
    assert torch.equal(base, g[ids])  # a token's noise does not depend on which others are asked
    assert not torch.equal(base, gumbel_noise(8, 10, ids))
    assert not torch.equal(base, gumbel_noise(7, 11, ids))


def _expected(logits: torch.Tensor, claim: SamplingClaim) -> torch.Tensor:
    """sglang's filtered distribution, written out for a small vocabulary."""
    probs = torch.softmax(logits.double() / claim.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    kept = torch.zeros_like(probs)
    before = 0.0
    for rank, tok in enumerate(order.tolist()):
        p = float(probs[tok])
        if (claim.top_k < 1 or rank < claim.top_k) and before <= claim.top_p and p >= claim.min_p * float(probs.max()):
            kept[tok] = p
        before += p
    return kept / kept.sum()


@pytest.mark.parametrize("claim", [
    SamplingClaim(temperature=1.0),
    SamplingClaim(temperature=0.5),
    SamplingClaim(temperature=0.7, top_p=0.8),
    SamplingClaim(temperature=1.3, top_k=3),
    SamplingClaim(temperature=1.0, min_p=0.3),
])
def test_draws_follow_the_filtered_distribution(claim) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -2.0])
    expected = _expected(logits, claim)
    n = 6000
    counts = torch.bincount(torch.tensor([seeded_token(logits, claim, 99, p) for p in range(n)]),
                            minlength=logits.numel()).double()
    assert counts[expected == 0].sum() == 0  # filtered tokens are never drawn
    sd = torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((counts / n - expected).abs() <= 4.5 * sd + 1e-12), (counts / n, expected)


def test_the_draw_depends_only_on_seed_position_and_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    claim = SamplingClaim(temperature=0.7, top_p=0.9)
    alone = [seeded_token(logits[i], claim, 5, 100 + i) for i in range(4)]
    reordered = [seeded_token(logits[[3, 2, 1, 0]][3 - i], claim, 5, 100 + i) for i in range(4)]
    assert alone == reordered
    assert alone == [seeded_token(logits[i].double(), claim, 5, 100 + i) for i in range(4)]  # any float dtype
    assert len({seeded_token(logits[0], claim, s, 100) for s in range(40)}) > 1  # the seed matters


def _lm_logits(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A peaked row like a language model's: a few likely tokens over a flat tail."""
    logits = torch.randn(vocab, generator=gen) * 2
    heads = torch.randint(0, vocab, (30,), generator=gen)
    logits[heads] += torch.randn(30, generator=gen) * 3 + 12
    return logits


def _top(logits: torch.Tensor, n: int = 64) -> list[tuple[float, int]]:
    values, ids = torch.log_softmax(logits.double(), dim=-1).topk(n)
    return list(zip(values.tolist(), ids.tolist()))


def test_honest_tokens_never_mismatch_under_logit_errors_below_epsilon() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab, claim = 8000, SamplingClaim(temperature=0.7, top_p=0.9, top_k=40)
    decided = 0
    for pos in range(150):
        logits = _lm_logits(vocab, gen)
        token = seeded_token(logits, claim, 3, pos)
        moved = logits + (torch.rand(vocab, generator=gen) - 0.5) * EPSILON  # |error| <= epsilon / 2
        verdict = check_position(_top(moved), token, claim, 3, pos, vocab)
        assert verdict is not False, pos
        decided += verdict is True
    assert decided > 100


def test_without_the_tolerance_logit_errors_convict_honest_tokens() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab, claim = 8000, SamplingClaim(temperature=0.7, top_p=0.9)
    wrong = 0
    for pos in range(300):
        logits = _lm_logits(vocab, gen)
        token = seeded_token(logits, claim, 3, pos)
        moved = logits + torch.randn(vocab, generator=gen) * 0.5
        wrong += check_position(_top(moved), token, claim, 3, pos, vocab, epsilon=0.0) is False
    assert wrong > 0


def test_other_claims_are_caught() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab, honest = 8000, SamplingClaim(temperature=0.7, top_p=0.9)
    rows = [_lm_logits(vocab, gen) for _ in range(120)]
    tokens = [seeded_token(row, honest, 11, pos) for pos, row in enumerate(rows)]
    tops, positions = [_top(row) for row in rows], list(range(120))
    assert seeded_check(tokens, tops, positions, honest, 11, vocab).mismatches == 0
    for claim, seed in [(SamplingClaim(temperature=1.0, top_p=0.9), 11), (SamplingClaim(temperature=0.7), 11),
                        (honest, 12)]:
        check = seeded_check(tokens, tops, positions, claim, seed, vocab)
        assert check.mismatches > 0 and not check.consistent, (claim, seed, check)


def test_full_logits_decide_every_position_exactly() -> None:
    gen = torch.Generator().manual_seed(4)
    claim = SamplingClaim(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01)
    for pos in range(40):
        logits = _lm_logits(200, gen)
        token = seeded_token(logits, claim, 8, pos)
        assert check_position(_top(logits, 200), token, claim, 8, pos, 200, epsilon=0.0) is True


def test_consistency_needs_a_decided_position_and_no_mismatch() -> None:
    assert SeededCheck(checked=49, mismatches=0, undecided=3).consistent
    assert not SeededCheck(checked=200, mismatches=1, undecided=0).consistent
    assert not SeededCheck(checked=0, mismatches=0, undecided=5).consistent


def test_request_validation() -> None:
    class Args:
        speculative_algorithm = None

    ok = {"max_new_tokens": 8, "sampling_seed": 3, "temperature": 0.7}
    validate_seeded_sampling(ok, None, Args())
    for bad, reason in [({**ok, "sampling_seed": None}, "sampling_seed"), ({**ok, "sampling_seed": -1}, "2^63"),
                        ({**ok, "n": 2}, "n > 1"), ({**ok, "repetition_penalty": 1.2}, "repetition_penalty"),
                        ({**ok, "logit_bias": {"5": 1.0}}, "logit_bias"), ({**ok, "regex": "a+"}, "grammar")]:
        with pytest.raises(RequestOptionError, match=reason.replace("^", r"\^")):
            validate_seeded_sampling(bad, None, Args())
    assert seeded_claim({"sampling_seed": 9, "temperature": 0.7, "top_p": 0.9}) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "seed": 9}
    for bad in [{"temperature": 0.7}, {"sampling_seed": 1, "temperature": 0.0}, {"sampling_seed": 1, "top_p": 0.0},
                {"sampling_seed": 1, "top_k": 0}]:
        with pytest.raises(RequestOptionError):
            seeded_claim(bad)
