"""The token checks of verification from the response rows and the LM head, on their device.

A verification prefill already holds, on its device, the final-norm rows that produced the
response tokens; their logits (rows x LM head) give everything the token checks need: each
response token's log-prob, whether it is the argmax, the log-prob of the last one (the EOS
probability of the termination check), the temperature-1 sampling test (`sampling`) and the
seeded sampler's recomputation (`seeded_sampling`). Here they come from one batched pass over
several requests' rows, in slices of rows, and only a few numbers per request leave the device
(the per-token log-probs only for requests that ask for them), where sglang's log-prob path
builds per-position Python lists.

The sampling test and the seeded check use the top-N of each position exactly as their CPU
implementations read sglang's top log-probs (N = `sampling.TOP_N`, `seeded_sampling.TOP_N`;
ties in log-prob ordered by token id), so they give the same verdicts from the same logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from sglang_rl.fingerprint import sampling, seeded_sampling
from sglang_rl.fingerprint.device_verify import to_device
from sglang_rl.fingerprint.sampling import DEFAULT_MAX_Z, SamplingCheck
from sglang_rl.fingerprint.seeded_sampling import EPSILON, SamplingClaim, SeededCheck

_LOGIT_ELEMENTS = 2**26
"""Logits computed at once (rows x vocabulary, 256 MiB in fp32): larger batches go in slices."""
_NOISE_ELEMENTS = 2**23
"""Gumbel noise entries (positions x vocabulary) of the seeded check computed at once."""
_EPS = 1e-12
_U64 = np.uint64

# summary columns, one row per request
_MATCHES, _CHECKED, _FINITE, _LP_SUM, _NEXT, _LAST_LP, _Z_SUM, _Z_COUNT, _S_CHECKED, _S_MISMATCH, _S_UNDECIDED = range(11)


@dataclass(frozen=True)
class SeededRequest:
    """The sampling a response claims to have been drawn with (`seeded_sampling`)."""

    claim: SamplingClaim
    seed: int


@dataclass(frozen=True)
class TokenRequest:
    """One request's part of a batch: `rows` [m, H] on the device, row i the one that produced
    `targets[i]` (the response token at absolute position `first_position + i`); a row past the
    targets (m == len(targets) + 1) gives the next token's argmax."""

    rows: torch.Tensor
    targets: Sequence[int]
    first_position: int
    sampled: bool = False
    seeded: Optional[SeededRequest] = None
    token_lists: bool = False

    def __post_init__(self) -> None:
        if self.rows.dim() != 2 or self.rows.shape[0] not in (len(self.targets), len(self.targets) + 1):
            raise ValueError(f"rows {tuple(self.rows.shape)} do not fit {len(self.targets)} targets")


def position_noise(positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`sampling.position_noise` over arrays (uint64 arithmetic wraps as the Python version's
    masks do)."""
    with np.errstate(over="ignore"):
        x = positions.astype(_U64) * _U64(0x9E3779B97F4A7C15) + tokens.astype(_U64) * _U64(0xBF58476D1CE4E5B9) + _U64(1)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return ((x >> _U64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def _ranked_top(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-n (log-prob, token) per row, by log-prob descending then token id ascending (the CPU
    checks' order)."""
    values, ids = logprobs.topk(n, dim=1)
    by_id = ids.argsort(dim=1, stable=True)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=1, descending=True, stable=True)
    return values.gather(1, order), ids.gather(1, order)


def _pit_normals(top_lp: torch.Tensor, top_ids: torch.Tensor, targets: torch.Tensor, logprobs: torch.Tensor,
                 noise: torch.Tensor) -> torch.Tensor:
    """Phi^-1(u) per position (`sampling.pit_value`, from the top-N list), float64."""
    probs = top_lp.double().exp()
    before = probs.cumsum(dim=1) - probs
    hit = top_ids == targets.unsqueeze(1)
    inside = hit.any(dim=1)
    mass_before = (before * hit).sum(dim=1)
    mass = probs.sum(dim=1).clamp(max=1.0)
    u = torch.where(inside, mass_before + noise * logprobs.double().exp(), mass + noise * (1.0 - mass))
    return torch.special.ndtri(u.clamp(_EPS, 1.0 - _EPS))


def _gumbel_at(seed: int, positions: Sequence[int], ids: torch.Tensor, vocab: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded sampler's Gumbel noise at `ids` [P, N] and its largest value over the other
    tokens of the vocabulary [P], per position (`seeded_sampling.gumbel_noise`)."""
    device = ids.device
    tokens = torch.arange(vocab, device=device).unsqueeze(0)
    at, rest = [], []
    step = max(1, _NOISE_ELEMENTS // vocab)
    for i in range(0, len(positions), step):
        part = positions[i: i + step]
        keys = [[seeded_sampling._key(seed, p, salt) for p in part] for salt in (0, 1)]
        hi = seeded_sampling._hash32(to_device(torch.tensor(keys[0]), device).unsqueeze(1), tokens) >> 6
        lo = seeded_sampling._hash32(to_device(torch.tensor(keys[1]), device).unsqueeze(1), tokens) >> 5
        noise = ((hi << 27) + lo).double().add_(0.5).div_(float(1 << 53)).log_().neg_().log_().neg_()
        picked = ids[i: i + step]
        at.append(noise.gather(1, picked))
        rest.append(noise.scatter_(1, picked, -math.inf).max(dim=1).values)
    return torch.cat(at), torch.cat(rest)


def _membership(lp: torch.Tensor, vocab: int, claim: SamplingClaim, d: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`seeded_sampling._membership` for every position at once: (surely kept, surely dropped)
    [P, N] and whether a token outside the top N may be kept [P]."""
    rows, n = lp.shape
    s = lp / claim.temperature
    sure_in = torch.ones_like(s, dtype=torch.bool)
    sure_out = torch.zeros_like(sure_in)
    outside = torch.full((rows,), n < vocab, dtype=torch.bool, device=lp.device)
    k = claim.top_k_of(vocab)
    if k < vocab:
        if k <= n:
            ranks = torch.arange(n, device=lp.device)
            first_out = s[:, k] if k < n else s[:, -1]
            sure_in &= (ranks < k) & (s - first_out.unsqueeze(1) > 2 * d)
            sure_out |= (ranks >= k) & (s[:, k - 1: k] - s > 2 * d)
            outside &= (s[:, k - 1] - s[:, -1]) <= 2 * d
    if claim.top_p < 1.0:
        e = torch.exp(s - s[:, :1])
        before = torch.cumsum(e, dim=1) - e
        q_lo, q_hi = _log_tail_bounds(lp, vocab, claim.temperature)
        total = e.sum(dim=1)
        z_lo = total + torch.exp(q_lo - s[:, 0])
        z_hi = total + torch.exp(q_hi - s[:, 0])
        sure_in &= before / z_lo.unsqueeze(1) * math.exp(2 * d) <= claim.top_p
        sure_out |= before / z_hi.unsqueeze(1) * math.exp(-2 * d) > claim.top_p
        outside &= total / z_hi * math.exp(-2 * d) <= claim.top_p
    if claim.min_p > 0.0:
        ratio = torch.exp(s - s[:, :1])
        sure_in &= ratio * math.exp(-2 * d) >= claim.min_p
        sure_out |= ratio * math.exp(2 * d) < claim.min_p
        outside &= ratio[:, -1] * math.exp(2 * d) >= claim.min_p
    return sure_in & ~sure_out, sure_out, outside


def _log_tail_bounds(lp: torch.Tensor, vocab: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`seeded_sampling._log_tail_bounds` per position [P]."""
    rest = 1.0 - torch.exp(lp).sum(dim=1)
    count = max(vocab - lp.shape[1], 1)
    log_rest = torch.log(rest.clamp(min=1e-300))
    packed = log_rest + lp[:, -1] * (1.0 / temperature - 1.0)
    spread = math.log(count) + (log_rest - math.log(count)) / temperature
    none = torch.full((), -math.inf, dtype=lp.dtype, device=lp.device)
    empty = rest <= 0.0
    return torch.where(empty, none, torch.minimum(packed, spread)), torch.where(empty, none, torch.maximum(packed, spread))


def seeded_counts(top_lp: torch.Tensor, top_ids: torch.Tensor, targets: torch.Tensor, positions: Sequence[int],
                  request: SeededRequest, vocab: int, epsilon: float = EPSILON) -> torch.Tensor:
    """`seeded_sampling.seeded_check` over positions at once, from their ranked top-N log-probs
    [P, N] (float64) and ids: [checked, mismatches, undecided] as float64 on the device."""
    claim = request.claim
    d = epsilon / claim.temperature
    sure_in, sure_out, outside = _membership(top_lp, vocab, claim, d)
    noise_at, noise_rest = _gumbel_at(request.seed, positions, top_ids, vocab)
    scores = top_lp / claim.temperature + noise_at
    minus_inf = torch.full((), -math.inf, dtype=scores.dtype, device=scores.device)
    best = torch.where(sure_in, scores, minus_inf).argmax(dim=1, keepdim=True)
    rivals = ~sure_out
    rivals.scatter_(1, best, False)
    rival = torch.where(rivals, scores, minus_inf).max(dim=1).values
    tail = top_lp[:, -1] / claim.temperature + noise_rest
    rival = torch.where(outside, torch.maximum(rival, tail), rival)
    decided = sure_in.any(dim=1) & (scores.gather(1, best).squeeze(1) - rival > 2 * d)
    wrong = decided & (top_ids.gather(1, best).squeeze(1) != targets)
    checked = decided.sum()
    return torch.stack([checked, wrong.sum(), targets.numel() - checked]).double()


@dataclass
class PendingTokenChecks:
    """A batch's token checks, still on the device (copied to pinned host memory without
    waiting, on CUDA); `results` waits for them."""

    requests: Sequence[TokenRequest]
    summary: torch.Tensor
    lists: torch.Tensor
    max_z: float
    ready: Optional[Any] = None
    _host: Optional[tuple] = field(default=None, repr=False)

    def done(self) -> bool:
        return self.ready is None or self.ready.query()

    def results(self) -> list[dict[str, Any]]:
        """Per request, the verification report's token fields (`verification_report`'s names):
        argmax counts, mean log-prob, the next token's argmax, the last token's log-prob, and the
        sampling and seeded checks where asked; per-token log-probs where asked. Read once."""
        if self._host is not None:
            return self._host[0]
        if self.ready is not None:
            self.ready.synchronize()
        summary, lists = self.summary.tolist(), self.lists.tolist()
        out, offset = [], 0
        for request, row in zip(self.requests, summary):
            n = len(request.targets)
            fields: dict[str, Any] = {
                "argmax_checked": int(row[_CHECKED]),
                "argmax_matches": int(row[_MATCHES]),
                "greedy_consistent": row[_CHECKED] > 0 and row[_MATCHES] == row[_CHECKED],
            }
            if row[_FINITE] > 0:
                fields["mean_response_logprob"] = row[_LP_SUM] / row[_FINITE]
            if request.rows.shape[0] > n:
                fields["next_token_argmax"] = int(row[_NEXT])
            if n:
                fields["response_last_logprob"] = row[_LAST_LP]
            if request.token_lists:
                fields["response_token_logprobs"] = lists[offset: offset + n]
                offset += n
            if request.sampled:
                count = int(row[_Z_COUNT])
                z = row[_Z_SUM] / math.sqrt(count) if count else 0.0
                fields.update(SamplingCheck(z=z, checked=count, max_z=self.max_z).to_dict())
            if request.seeded is not None:
                fields.update(SeededCheck(checked=int(row[_S_CHECKED]), mismatches=int(row[_S_MISMATCH]),
                                          undecided=int(row[_S_UNDECIDED])).to_dict())
            out.append(fields)
        self._host = (out,)
        return out


def token_checks(requests: Sequence[TokenRequest], weight: torch.Tensor, max_z: float = DEFAULT_MAX_Z,
                 epsilon: float = EPSILON, logit_scale: Optional[float] = None,
                 softcap: Optional[float] = None) -> PendingTokenChecks:
    """Start the token checks of several requests in one batched pass: logits = rows x
    `weight`.T ([vocab, H], the LM head, on the rows' device; the rows are the final-norm ones),
    in slices of rows; then times `logit_scale` and soft-capped at `softcap` where the model's
    logits processor does so."""
    device, vocab = weight.device, weight.shape[0]
    counts = [r.rows.shape[0] for r in requests]
    total = sum(counts)
    owner = np.repeat(np.arange(len(requests)), counts)
    targets_np = np.concatenate([np.concatenate([np.asarray(r.targets, dtype=np.int64),
                                                 np.full(c - len(r.targets), -1, dtype=np.int64)])
                                 for r, c in zip(requests, counts)]) if requests else np.zeros(0, np.int64)
    positions_np = np.concatenate([np.arange(c, dtype=np.int64) + r.first_position
                                   for r, c in zip(requests, counts)]) if requests else np.zeros(0, np.int64)
    sampled_np = np.repeat([r.sampled for r in requests], counts) & (targets_np >= 0) if requests else np.zeros(0, bool)
    seeded_np = np.repeat([r.seeded is not None for r in requests], counts) & (targets_np >= 0) \
        if requests else np.zeros(0, bool)
    rows = torch.cat([r.rows for r in requests]) if requests else torch.empty(0, weight.shape[1], device=device)
    targets = to_device(targets_np, device)
    owners = to_device(owner, device)

    logprobs = torch.empty(total, dtype=torch.float32, device=device)
    argmax = torch.empty(total, dtype=torch.int64, device=device)
    summary = torch.zeros(len(requests), 11, dtype=torch.float64, device=device)
    sampled_top: list[tuple[torch.Tensor, torch.Tensor]] = []
    seeded_top: list[tuple[torch.Tensor, torch.Tensor]] = []
    n_sampling = min(sampling.TOP_N, vocab)
    n_seeded = min(seeded_sampling.TOP_N, vocab)
    step = max(1, _LOGIT_ELEMENTS // vocab)
    for lo in range(0, total, step):
        hi = min(lo + step, total)
        logits = (rows[lo:hi].to(weight.dtype) @ weight.T).float()
        if logit_scale is not None:
            logits.mul_(logit_scale)
        if softcap:
            logits.div_(softcap).tanh_().mul_(softcap)
        lse = logits.logsumexp(dim=1, keepdim=True)
        logits.sub_(lse)  # log-probs from here on
        logprobs[lo:hi] = logits.gather(1, targets[lo:hi].clamp(min=0).unsqueeze(1)).squeeze(1)
        argmax[lo:hi] = logits.argmax(dim=1)
        for mask, n, out in ((sampled_np, n_sampling, sampled_top), (seeded_np, n_seeded, seeded_top)):
            picked = np.flatnonzero(mask[lo:hi])
            if picked.size:
                out.append(_ranked_top(logits[to_device(picked, device)], n))

    has_target = targets >= 0
    finite = has_target & torch.isfinite(logprobs)
    summary[:, _MATCHES].index_add_(0, owners, (has_target & (argmax == targets)).double())
    summary[:, _CHECKED].index_add_(0, owners, has_target.double())
    summary[:, _FINITE].index_add_(0, owners, finite.double())
    summary[:, _LP_SUM].index_add_(0, owners, torch.where(finite, logprobs, 0.0).double())
    ends = to_device(np.cumsum(counts) - 1, device)
    summary[:, _NEXT] = argmax[ends].double()
    last_target = to_device(np.cumsum(counts) - np.asarray(counts) + np.asarray(
        [max(len(r.targets) - 1, 0) for r in requests], dtype=np.int64), device)
    summary[:, _LAST_LP] = logprobs[last_target].double()

    if sampled_top:
        picked = np.flatnonzero(sampled_np)
        index = to_device(picked, device)
        noise = to_device(position_noise(positions_np[picked], targets_np[picked]), device)
        top_lp = torch.cat([t[0] for t in sampled_top])
        top_ids = torch.cat([t[1] for t in sampled_top])
        usable = finite[index]
        normals = _pit_normals(top_lp, top_ids, targets[index], logprobs[index], noise)
        summary[:, _Z_SUM].index_add_(0, owners[index], torch.where(usable, normals, 0.0))
        summary[:, _Z_COUNT].index_add_(0, owners[index], usable.double())
    if seeded_top:
        top_lp = torch.cat([t[0] for t in seeded_top]).double()
        top_ids = torch.cat([t[1] for t in seeded_top])
        start = 0
        for item, request in enumerate(requests):
            if request.seeded is None:
                continue
            n = len(request.targets)
            span = slice(start, start + n)
            first = int(np.cumsum(counts)[item] - counts[item])
            positions = positions_np[first: first + n].tolist()
            summary[item, _S_CHECKED:] = seeded_counts(top_lp[span], top_ids[span], targets[first: first + n],
                                                       positions, request.seeded, vocab, epsilon)
            start += n
    wanted = [torch.arange(int(np.cumsum(counts)[i] - counts[i]), int(np.cumsum(counts)[i] - counts[i]) + len(r.targets))
              for i, r in enumerate(requests) if r.token_lists]
    lists = logprobs[to_device(torch.cat(wanted), device)] if wanted else logprobs[:0]
    return _start_copy(requests, summary, lists, max_z)


def _start_copy(requests: Sequence[TokenRequest], summary: torch.Tensor, lists: torch.Tensor,
                max_z: float) -> PendingTokenChecks:
    if summary.device.type != "cuda":
        return PendingTokenChecks(requests, summary.cpu(), lists.cpu(), max_z)
    host_summary = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=True)
    host_lists = torch.empty(lists.shape, dtype=lists.dtype, pin_memory=True)
    host_summary.copy_(summary, non_blocking=True)
    host_lists.copy_(lists, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return PendingTokenChecks(requests, host_summary, host_lists, max_z, event)
