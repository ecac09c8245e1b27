"""The temperature-1 sampling test: exact uniformity of u, honest Z ~ N(0, 1), colder sampling,
another model and edited tokens caught. Distributions are random, the full vocabulary is known
here, and the check sees only what a verifier gets from sglang (top-N log-probs + the token's)."""

from __future__ import annotations

import math

import torch

from sglang_rl.fingerprint.sampling import TOP_N, pit_value, position_noise, sampling_check

VOCAB = 300


def _distributions(n: int, seed: int, sharpness: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(sharpness * torch.randn(n, VOCAB, generator=gen), dim=-1)


def _response(logp: torch.Tensor, seed: int, temperature: float = 1.0) -> list[int]:
    """One token per position, sampled from softmax(logp / temperature)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(logp / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()


def _verifier_view(logp: torch.Tensor, tokens: list[int]):
    top = logp.topk(TOP_N, dim=-1)
    tops = [list(zip(v.tolist(), i.tolist())) for v, i in zip(top.values, top.indices)]
    logprobs = [float(logp[i, t]) for i, t in enumerate(tokens)]
    return logprobs, tops


def _z(logp: torch.Tensor, tokens: list[int], start: int = 100) -> float:
    logprobs, tops = _verifier_view(logp, tokens)
    return sampling_check(tokens, logprobs, tops, range(start, start + len(tokens))).z


def test_u_is_uniform_for_honest_tokens_inside_and_outside_the_top_n() -> None:
    logp = _distributions(20000, 1, sharpness=1.0)  # flat: many tokens fall outside the top N
    tokens = _response(logp, 2)
    logprobs, tops = _verifier_view(logp, tokens)
    us = sorted(pit_value(t, lp, top, position_noise(i, t)) for i, (t, lp, top) in enumerate(zip(tokens, logprobs, tops)))
    outside = sum(t not in {tok for _, tok in top} for t, top in zip(tokens, tops))
    assert outside > 2000
    ks = max(abs((k + 1) / len(us) - u) for k, u in enumerate(us))
    assert ks < 1.36 / math.sqrt(len(us)) * 1.5  # Kolmogorov-Smirnov, well inside the 5% band x1.5


def test_honest_z_is_standard_normal_and_never_beyond_the_bound() -> None:
    zs = []
    for seed in range(400):
        logp = _distributions(64, 1000 + seed)
        zs.append(_z(logp, _response(logp, 5000 + seed)))
    mean = sum(zs) / len(zs)
    sd = math.sqrt(sum((z - mean) ** 2 for z in zs) / len(zs))
    assert abs(mean) < 0.2 and 0.85 < sd < 1.15
    assert max(abs(z) for z in zs) < 4.0


def test_colder_or_hotter_sampling_and_another_model_are_caught() -> None:
    for seed in range(20):
        logp = _distributions(64, 2000 + seed)
        assert _z(logp, _response(logp, seed, temperature=0.5)) < -4.0  # too likely: colder
        assert _z(logp, _response(logp, seed, temperature=2.0)) > 4.0  # too unlikely: hotter
        other = _distributions(64, 9000 + seed)  # another model's choices
        assert _z(logp, _response(other, seed)) > 4.0


def test_edited_tokens_move_z_up() -> None:
    """Each edit to an unlikely token adds at most about Phi^-1 of a tail u (tokens outside the
    top N are lumped together), so it takes a quarter of the tokens to pass the bound here."""
    logp = _distributions(128, 3)
    tokens = _response(logp, 4)
    honest = _z(logp, tokens)
    shifts = []
    for every in (8, 4):
        edited = list(tokens)
        for i in range(0, 128, every):  # replaced by the model's least likely token
            edited[i] = int(logp[i].argmin())
        shifts.append(_z(logp, edited) - honest)
    assert 2.0 < shifts[0] < shifts[1] and _z(logp, tokens) + shifts[1] > 4.0


def test_verdict_fields_and_positions_without_log_probs() -> None:
    check = sampling_check([5, 6], [None, float("-inf")], [[(-0.1, 5)], [(-0.1, 6)]], [1, 2])
    assert check.checked == 0 and not check.consistent
    logp = _distributions(32, 7)
    tokens = _response(logp, 8)
    logprobs, tops = _verifier_view(logp, tokens)
    result = sampling_check(tokens, logprobs, tops, range(32)).to_dict()
    assert result["sampling_checked"] == 32 and result["sampling_consistent"] is True
    assert result["sampling_max_z"] == 4.0
    assert sampling_check(tokens, logprobs, tops, range(32)) == sampling_check(tokens, logprobs, tops, range(32))


def test_combined_z_is_the_z_of_all_tokens_together() -> None:
    from sglang_rl.fingerprint.sampling import combined_z

    logp = _distributions(90, 11)
    tokens = _response(logp, 12, temperature=0.8)
    parts = [(0, 30), (30, 50), (50, 90)]
    checks = [sampling_check(tokens[a:b], *[x[a:b] for x in _verifier_view(logp, tokens)], range(a, b))
              for a, b in parts]
    whole = sampling_check(tokens, *_verifier_view(logp, tokens), range(90)).z
    assert abs(combined_z([c.z for c in checks], [c.checked for c in checks]) - whole) < 1e-9
    assert combined_z([]) == 0.0 and abs(combined_z([3.0, 3.0, 3.0, 3.0]) - 6.0) < 1e-12
