"""Seeded sampling: each token a pure function of (seed, position, logits), and its verifier check.

A worker that samples with this rule picks, at absolute position `pos` of the sequence,

    x = argmax over the kept tokens v of  log p(v) / T + G(seed, pos, v)

where `log p` is the model's log-softmax, T the temperature, "kept" the tokens that top-k, top-p
and min-p (sglang's own rules, applied at temperature T) leave, and G a Gumbel variable computed
from an integer hash of (seed, pos, v). This is exactly a draw from sglang's filtered
distribution (the Gumbel-max trick), but reproducible: the noise depends on nothing else (not the
batch, not the device, not the kernel), so a verifier with the same logits recomputes every token.

The verifier knows the top-N log-probs of each position from its own prefill, not all logits, and
its logits differ slightly from the worker's (other kernels, bf16). `check_position` therefore
decides a position only when the answer cannot depend on either: every token whose top-p / top-k /
min-p membership or score could change by a logit error of `epsilon` is treated as a rival, tokens
outside the top N are bounded by the N-th log-prob (their noise is computed exactly), and the
predicted token must beat every rival by more than `2 * epsilon / T`. Undecided positions are left
out; a decided position whose response token differs is a mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

EPSILON = 0.1
"""Logit error (nats) allowed between worker and verifier before a position counts."""

TOP_N = 1024
"""Top log-probs per position the verifier asks sglang for: the more, the more positions decide
(the unseen tail is bounded by the N-th log-prob), most of all where the model is unsure."""

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingClaim:
    """The sampling settings a response claims: sglang's meaning of each value."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or anything >= the vocabulary): no top-k; 1: greedy."""
    min_p: float = 0.0

    def top_k_of(self, vocab: int) -> int:
        return vocab if self.top_k is None or self.top_k < 1 or self.top_k >= vocab else int(self.top_k)


# ------------------------------------------------------------------------------------------
# the noise: 32-bit integer hashing that never overflows int64, so CPU and GPU agree bit for bit


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2^32 for int64 `a` in [0, 2^32): split b so no product exceeds 2^49."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _key(seed: int, position: int, salt: int) -> int:
    """The 32-bit key of (seed, position, salt), in plain Python integers."""
    h = 0x9E3779B9 ^ salt
    for word in (seed & _M32, (seed >> 32) & _M32, position & _M32, (position >> 32) & _M32):
        h = _fmix32_int(((h ^ word) + 0x7F4A7C15) & _M32)
    return h


def _hash32(key: int, tokens: torch.Tensor) -> torch.Tensor:
    h = _fmix32(_mul32(tokens ^ key, 0x9E3779B1) ^ (key >> 1))
    return _fmix32(h ^ key)


def uniform_noise(seed: int, position: int, tokens: torch.Tensor) -> torch.Tensor:
    """U(0, 1) in float64 for each token id at (seed, position): 53 hashed bits, never 0 or 1."""
    if not 0 <= seed < 1 << 64 or not 0 <= position < 1 << 64:
        raise ValueError("seed and position must be 64-bit unsigned integers")
    tokens = tokens.to(torch.int64)
    hi = _hash32(_key(seed, position, 0), tokens) >> 6
    lo = _hash32(_key(seed, position, 1), tokens) >> 5
    return ((hi << 27) + lo).to(torch.float64).add_(0.5).div_(float(1 << 53))


def gumbel_noise(seed: int, position: int, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) in float64 for each token id: a pure function of (seed, position, token)."""
    return uniform_noise(seed, position, tokens).log_().neg_().log_().neg_()


# ------------------------------------------------------------------------------------------
# the sampler (full logits)


def kept_sorted(scores: torch.Tensor, claim: SamplingClaim) -> torch.Tensor:
    """Keep-mask over `scores` (log p / T) sorted descending: sglang's top-k, top-p (a token goes
    when the tempered mass ranked before it exceeds top_p) and min-p rules."""
    vocab = scores.numel()
    keep = torch.ones(vocab, dtype=torch.bool, device=scores.device)
    keep[claim.top_k_of(vocab):] = False
    probs = torch.softmax(scores, dim=-1)
    if claim.top_p < 1.0:
        keep &= (torch.cumsum(probs, dim=-1) - probs) <= claim.top_p
    if claim.min_p > 0.0:
        keep &= probs >= claim.min_p * probs[0]
    return keep


def seeded_token(logits: torch.Tensor, claim: SamplingClaim, seed: int, position: int) -> int:
    """The token at absolute `position` for a row of logits [V]: argmax(log p / T + Gumbel) over
    the tokens the filters keep (ties: the higher-ranked token)."""
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    scores, order = torch.sort(logprobs / claim.temperature, descending=True, stable=True)
    keep = kept_sorted(scores, claim)
    perturbed = scores + gumbel_noise(seed, position, order)
    perturbed[~keep] = -math.inf
    return int(order[int(torch.argmax(perturbed))])


# ------------------------------------------------------------------------------------------
# the verifier check (top-N log-probs, other logits)


def _log_tail_bounds(logprobs: torch.Tensor, vocab: int, temperature: float) -> tuple[float, float]:
    """log of the least and greatest sum of p^(1/T) over the tokens outside the top N, given only
    that each has p <= p_N and that together they hold the rest of the mass."""
    rest = 1.0 - float(torch.exp(logprobs).sum())
    count = max(vocab - logprobs.numel(), 1)
    if rest <= 0.0:
        return -math.inf, -math.inf
    log_rest = math.log(rest)
    packed = log_rest + float(logprobs[-1]) * (1.0 / temperature - 1.0)
    spread = math.log(count) + (log_rest - math.log(count)) / temperature
    return min(packed, spread), max(packed, spread)


def _membership(logprobs: torch.Tensor, vocab: int, claim: SamplingClaim, d: float
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(surely kept, surely dropped) over the top N, and whether any token outside may be kept,
    when every score may be off by `d`."""
    n = logprobs.numel()
    s = logprobs / claim.temperature
    sure_in = torch.ones(n, dtype=torch.bool)
    sure_out = torch.zeros(n, dtype=torch.bool)
    outside = n < vocab
    k = claim.top_k_of(vocab)
    if k < vocab:
        if k <= n:
            ranks = torch.arange(n)
            first_out = s[k] if k < n else s[-1]  # at k == N the first dropped score is unseen
            sure_in &= (ranks < k) & (s - first_out > 2 * d)
            sure_out |= (ranks >= k) & (s[k - 1] - s > 2 * d)
        outside = outside and (k > n or float(s[k - 1] - s[-1]) <= 2 * d)
    if claim.top_p < 1.0:
        e = torch.exp(s - s[0])
        before = torch.cumsum(e, dim=-1) - e
        q_lo, q_hi = _log_tail_bounds(logprobs, vocab, claim.temperature)
        z_lo = float(e.sum()) + math.exp(q_lo - float(s[0]))
        z_hi = float(e.sum()) + math.exp(q_hi - float(s[0]))
        sure_in &= before / z_lo * math.exp(2 * d) <= claim.top_p
        sure_out |= before / z_hi * math.exp(-2 * d) > claim.top_p
        outside = outside and float(e.sum()) / z_hi * math.exp(-2 * d) <= claim.top_p
    if claim.min_p > 0.0:
        ratio = torch.exp(s - s[0])
        sure_in &= ratio * math.exp(-2 * d) >= claim.min_p
        sure_out |= ratio * math.exp(2 * d) < claim.min_p
        outside = outside and float(ratio[-1]) * math.exp(2 * d) >= claim.min_p
    return sure_in & ~sure_out, sure_out, outside


def check_position(top: Sequence[tuple[float, int]], token: int, claim: SamplingClaim, seed: int,
                   position: int, vocab: int, epsilon: float = EPSILON) -> Optional[bool]:
    """Whether `token` is the seeded choice at `position`, from the verifier's top-N (log-prob,
    token id) pairs; None when logit errors up to `epsilon` could change the choice."""
    ranked = sorted(top, key=lambda entry: (-entry[0], entry[1]))
    if not ranked:
        return None
    logprobs = torch.tensor([lp for lp, _ in ranked], dtype=torch.float64)
    ids = torch.tensor([tok for _, tok in ranked], dtype=torch.int64)
    d = epsilon / claim.temperature
    sure_in, sure_out, outside = _membership(logprobs, vocab, claim, d)
    if not bool(sure_in.any()):
        return None
    noise = gumbel_noise(seed, position, torch.arange(vocab, dtype=torch.int64))
    scores = logprobs / claim.temperature + noise[ids]
    best = int(torch.argmax(torch.where(sure_in, scores, torch.tensor(-math.inf, dtype=torch.float64))))
    rivals = scores[~sure_out].clone()
    rivals[int((~sure_out)[:best].sum())] = -math.inf  # the best itself
    rival = float(rivals.max()) if rivals.numel() else -math.inf
    if outside:
        noise[ids] = -math.inf
        rival = max(rival, float(logprobs[-1]) / claim.temperature + float(noise.max()))
    if float(scores[best]) - rival <= 2 * d:
        return None
    return int(ids[best]) == int(token)


@dataclass(frozen=True)
class SeededCheck:
    """The check over one response: decided positions, mismatches among them, undecided ones."""

    checked: int
    mismatches: int
    undecided: int

    @property
    def consistent(self) -> bool:
        return self.checked > 0 and self.mismatches == 0

    def to_dict(self) -> dict:
        return {"seeded_checked": self.checked, "seeded_mismatches": self.mismatches,
                "seeded_undecided": self.undecided, "seeded_consistent": self.consistent}


def seeded_check(tokens: Sequence[int], tops: Sequence[Sequence[tuple[float, int]]], positions: Sequence[int],
                 claim: SamplingClaim, seed: int, vocab: int, epsilon: float = EPSILON) -> SeededCheck:
    """The check over response tokens, their top-N lists and absolute positions."""
    checked = mismatches = undecided = 0
    for token, top, position in zip(tokens, tops, positions):
        verdict = check_position(top, token, claim, seed, position, vocab, epsilon)
        if verdict is None:
            undecided += 1
        else:
            checked += 1
            mismatches += int(not verdict)
    return SeededCheck(checked=checked, mismatches=mismatches, undecided=undecided)
