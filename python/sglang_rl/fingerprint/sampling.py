"""Was a response sampled from the model at temperature 1? A randomised probability-integral test.

A TOPLOC fingerprint proves the prefill of prompt + response on the agreed model; it says nothing
about how the response tokens were chosen. A worker could fingerprint honestly but pick tokens
with a cheaper model, edit them, or sample colder than agreed (more likely text, lower variance
of rewards). For temperature-1 sampling from the full distribution (no top-k / top-p / min-p,
the RL default of verl and sglang), the verifier's own prefill gives the distribution p_i at
every response position, and each token x_i can be turned into

    u_i = P_i(tokens ranked before x_i) + V_i * p_i(x_i)

with tokens ranked by probability and V_i uniform. If x_i was drawn from p_i, u_i is exactly
uniform on (0, 1), whatever p_i is, and the u_i of a response are independent (each is uniform
given the tokens before it). So Z = sum_i Phi^-1(u_i) / sqrt(n) is standard normal for honest
work: a two-sided bound |Z| <= z fixes the false-rejection rate at 2 * (1 - Phi(z)) per
response (6.3e-5 at z = 4), with no model-specific calibration. Tokens that the model finds
unlikely push Z up; colder sampling pushes it down.

The verifier knows only the top-N log-probs of each position (sglang returns those) plus the
token's own log-prob. A token outside the top N gets u_i = M + V_i * (1 - M), with M the top-N
mass: conditioned on being outside the top N an honest u_i is then uniform on (M, 1), so u_i
stays exactly uniform. V_i is a fixed pseudo-random function of the position and the token, so a
verdict is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

DEFAULT_MAX_Z = 4.0
"""|Z| bound: a false rejection in 6.3e-5 of honest responses (two-sided normal tail)."""

TOP_N = 20
"""Top log-probs per position the verifier asks sglang for."""

_NORMAL = NormalDist()
_EPS = 1e-12


@dataclass(frozen=True)
class SamplingCheck:
    """The test over one response: Z, how many positions entered it, and the verdict."""

    z: float
    checked: int
    max_z: float

    @property
    def consistent(self) -> bool:
        return self.checked > 0 and abs(self.z) <= self.max_z

    def to_dict(self) -> dict:
        return {"sampling_z": round(self.z, 4), "sampling_checked": self.checked,
                "sampling_max_z": self.max_z, "sampling_consistent": self.consistent}


def position_noise(position: int, token: int) -> float:
    """V_i in (0, 1): a fixed mix (splitmix64) of the position and the token."""
    x = (position * 0x9E3779B97F4A7C15 + token * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return ((x >> 11) + 0.5) / float(1 << 53)


def pit_value(token: int, logprob: float, top: Sequence[tuple[float, int]], noise: float) -> float:
    """u for one position: `token` with log-prob `logprob`, `top` the (log-prob, token) pairs of
    the N most likely tokens, `noise` V in (0, 1). Ties in log-prob are ordered by token id."""
    ranked = sorted(top, key=lambda entry: (-entry[0], entry[1]))
    mass = 0.0
    for lp, tok in ranked:
        if tok == token:
            return min(max(mass + noise * math.exp(logprob), _EPS), 1.0 - _EPS)
        mass += math.exp(lp)
    mass = min(mass, 1.0)
    return min(max(mass + noise * (1.0 - mass), _EPS), 1.0 - _EPS)


def sampling_check(tokens: Sequence[int], logprobs: Sequence[float], tops: Sequence[Sequence[tuple[float, int]]],
                   positions: Sequence[int], max_z: float = DEFAULT_MAX_Z) -> SamplingCheck:
    """The test over response tokens: their log-probs, top-N lists and absolute positions.
    Positions without a finite log-prob or a top list are left out."""
    total, checked = 0.0, 0
    for token, logprob, top, position in zip(tokens, logprobs, tops, positions):
        if logprob is None or not math.isfinite(logprob) or not top:
            continue
        u = pit_value(token, logprob, top, position_noise(position, token))
        total += _NORMAL.inv_cdf(u)
        checked += 1
    z = total / math.sqrt(checked) if checked else 0.0
    return SamplingCheck(z=z, checked=checked, max_z=max_z)


def combined_z(zs: Sequence[float], checked: Sequence[int] | None = None) -> float:
    """One Z over several responses of a worker (Stouffer: sum of Z_k * sqrt(n_k) over
    sqrt(sum n_k), i.e. the Z of all their tokens together). Standard normal for honest work, so
    the same |Z| bound applies; a small per-token bias that one response cannot show (sampling
    at temperature 0.7 instead of 1) grows with the square root of the tokens seen."""
    weights = [1] * len(zs) if checked is None else list(checked)
    total = sum(weights)
    if total == 0:
        return 0.0
    return sum(z * math.sqrt(w) for z, w in zip(zs, weights)) / math.sqrt(total)
