"""The token checks from rows x LM head (fingerprint/device_tokens.py) against their CPU
implementations (verification_report's readers of sglang's log-probs, sampling.sampling_check,
seeded_sampling.seeded_check): the same counts and verdicts from the same logits, for greedy,
temperature-1, seeded (with top-k / top-p / min-p) and dishonest (colder, shuffled) tokens."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_rl.fingerprint import sampling, seeded_sampling
from sglang_rl.fingerprint.device_tokens import SeededRequest, TokenRequest, position_noise, token_checks
from sglang_rl.fingerprint.seeded_sampling import SamplingClaim, seeded_token
from sglang_rl.verification_report import _sampling_fields, _seeded_fields, _token_checks

HIDDEN, VOCAB = 48, 1200


def head(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)) / HIDDEN**0.5


def rows_for(n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def logprobs_of(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = (rows @ weight.T).float()
    return logits - logits.logsumexp(dim=1, keepdim=True)


def draw(lp: torch.Tensor, how: str, seed: int, first: int, claim: SamplingClaim | None = None) -> list[int]:
    """Response tokens, one per row: greedy, temperature 1, colder (0.3), seeded, or shuffled."""
    generator = torch.Generator().manual_seed(seed)
    if how == "greedy":
        return lp.argmax(dim=1).tolist()
    if how in ("t1", "cold"):
        temperature = 1.0 if how == "t1" else 0.3
        return torch.multinomial(torch.softmax(lp.double() / temperature, dim=1), 1, generator=generator)[:, 0].tolist()
    if how == "seeded":
        return [seeded_token(lp[i].double(), claim, seed, first + i) for i in range(lp.shape[0])]
    return torch.randint(0, VOCAB, (lp.shape[0],), generator=generator).tolist()


def cpu_fields(lp: torch.Tensor, tokens: list[int], start: int, next_row: bool, sampled: bool,
               seeded: tuple[SamplingClaim, int] | None) -> dict:
    """What today's path reports: sglang-shaped log-prob lists read by verification_report."""
    n = len(tokens)
    top_n = seeded_sampling.TOP_N if seeded else sampling.TOP_N if sampled else 1
    tops = []
    for i in range(lp.shape[0]):
        ranked = sorted(zip(lp[i].tolist(), range(VOCAB)), key=lambda e: (-e[0], e[1]))[:top_n]
        tops.append([(value, token, None) for value, token in ranked])
    meta = {"prompt_tokens": start + n, "input_token_logprobs": [(lp[i, t].item(), t, None) for i, t in enumerate(tokens)],
            "input_top_logprobs": tops[:n], "output_top_logprobs": [tops[n]] if next_row else []}
    report = {"response_start": start, "response_tokens": n}
    out = _token_checks(report, meta)
    if sampled:
        out.update(_sampling_fields(report, meta, sampling.DEFAULT_MAX_Z))
    if seeded:
        claim, seed = seeded
        fields = _seeded_fields(report, meta, {"temperature": claim.temperature, "top_p": claim.top_p,
                                               "top_k": claim.top_k, "min_p": claim.min_p, "seed": seed,
                                               "vocab_size": VOCAB})
        fields.pop("seeded_claim")
        out.update(fields)
    out["response_last_logprob"] = meta["input_token_logprobs"][-1][0]
    return out


CASES = [
    # (how, sampled, seeded claim)
    ("greedy", False, None),
    ("t1", True, None),
    ("cold", True, None),
    ("shuffled", True, None),
    ("seeded", False, SamplingClaim()),
    ("seeded", False, SamplingClaim(temperature=0.7, top_p=0.9)),
    ("seeded", False, SamplingClaim(temperature=1.3, top_k=40, min_p=0.02)),
    ("t1", False, SamplingClaim(temperature=0.8, top_k=100)),
]


def test_batched_checks_equal_the_cpu_implementations() -> None:
    weight = head()
    requests, expected = [], []
    for case, (how, sampled, claim) in enumerate(CASES):
        n, start, next_row = 30 + 5 * case, 11 + case, case % 2 == 0
        rows = rows_for(n + int(next_row), seed=case, scale=2.0 + case % 3)
        lp = logprobs_of(rows, weight)
        seed = 1000 + case
        tokens = draw(lp[:n], how, seed, start, claim)
        seeded = None if claim is None else (claim, seed)
        requests.append(TokenRequest(rows, tokens, start, sampled=sampled,
                                     seeded=None if claim is None else SeededRequest(claim, seed),
                                     token_lists=case % 3 == 0))
        expected.append(cpu_fields(lp, tokens, start, next_row, sampled, seeded))
    got = token_checks(requests, weight).results()
    verdicts = []
    for request, mine, cpu in zip(requests, got, expected):
        assert mine.pop("mean_response_logprob") == pytest.approx(cpu.pop("mean_response_logprob"), abs=1e-9)
        lists = cpu.pop("response_token_logprobs")
        if request.token_lists:
            assert mine.pop("response_token_logprobs") == lists
        if request.sampled:
            assert mine.pop("sampling_z") == pytest.approx(cpu.pop("sampling_z"), abs=2e-4)
        assert mine == cpu
        verdicts.append((mine.get("greedy_consistent"), mine.get("sampling_consistent"), mine.get("seeded_consistent")))
    # the cases mean something: greedy passes, colder and shuffled fail, seeded passes (decided > 0)
    assert verdicts[0][0] and verdicts[1][1] and not verdicts[2][1] and not verdicts[3][1]
    assert all(v[2] for v in verdicts[4:7]) and verdicts[7][2] is False


def test_seeded_check_catches_other_tokens() -> None:
    weight = head(1)
    claim = SamplingClaim(temperature=1.0, top_p=0.95)
    rows = rows_for(64, seed=5)
    lp = logprobs_of(rows, weight)
    honest = draw(lp, "seeded", 7, 20, claim)
    other_seed = draw(lp, "seeded", 8, 20, claim)
    results = token_checks([TokenRequest(rows, honest, 20, seeded=SeededRequest(claim, 7)),
                            TokenRequest(rows, other_seed, 20, seeded=SeededRequest(claim, 7))], weight).results()
    assert results[0]["seeded_consistent"] and results[0]["seeded_checked"] > 32
    assert results[1]["seeded_mismatches"] > 10


def test_position_noise_equals_the_scalar_one() -> None:
    positions = torch.randint(0, 2**40, (200,), generator=torch.Generator().manual_seed(0)).numpy()
    tokens = torch.randint(0, 2**20, (200,), generator=torch.Generator().manual_seed(1)).numpy()
    assert position_noise(positions, tokens).tolist() == [sampling.position_noise(int(p), int(t))
                                                          for p, t in zip(positions, tokens)]


def test_rows_must_fit_the_targets() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        TokenRequest(torch.zeros(5, HIDDEN), [1, 2, 3], 0)
    assert math.isfinite(token_checks([TokenRequest(torch.zeros(1, HIDDEN), [], 0)], head()).results()[0]
                         .get("next_token_argmax", 0.0))
