"""One batched k-CBS (top-k-constrained beam search) decoding step, in plain torch.

A step takes every beam of every k-CBS request at once. Each live beam of a request with width k
expands by its k most likely next tokens (ties: lower token id first); the expansion's log-prob is
renormalised inside that set (lp - logsumexp of the k log-probs). A finished beam stays a
candidate with its score unchanged. Each request then keeps its k best candidates, or all of them
when `keep_all` is set (the last step with final_prune=False). Order everywhere: score
descending, then parent beam index ascending, then token rank ascending.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KcbsSelection:
    """Candidates kept by one step, grouped by request (ascending), best first in each group.

    Request r owns rows offsets[r]:offsets[r + 1]. `parent_beam` indexes the beams given to the
    step; `token` is -1 and `finished` True for a finished beam carried over unchanged. `score` is
    the cumulative renormalised log-prob, `raw` the cumulative raw log-prob.
    """

    request: Tensor
    parent_beam: Tensor
    token: Tensor
    score: Tensor
    raw: Tensor
    finished: Tensor
    offsets: Tensor

    def __len__(self) -> int:
        return int(self.request.numel())

    def rows(self, request: int) -> slice:
        """The rows of one request."""
        return slice(int(self.offsets[request]), int(self.offsets[request + 1]))


def ranked_topk(logprobs: Tensor, k_rows: Tensor) -> tuple[Tensor, Tensor]:
    """Top-k tokens of every row with its own k, ordered by (log-prob desc, token id asc).

    Returns (tokens, values), both [rows, max k]; row i is meaningful in its first k_rows[i]
    columns. Ties at the k-th value are resolved towards lower token ids, on any device.
    """
    vocab = logprobs.shape[1]
    device = logprobs.device
    k_max = int(k_rows.max())
    if k_max > vocab or int(k_rows.min()) < 1:
        raise ValueError(f"k must lie in [1, {vocab}], got {k_rows.tolist()}")
    values, tokens = torch.topk(logprobs, k_max, dim=-1)
    kth = values.gather(1, (k_rows - 1).unsqueeze(1))
    n_above = (logprobs > kth).sum(-1)
    n_tied = (logprobs == kth).sum(-1)
    ambiguous = (n_above + n_tied > k_rows).nonzero().squeeze(1)
    if ambiguous.numel() > 0:
        tied = logprobs[ambiguous] == kth[ambiguous]
        tie_rank = tied.cumsum(-1)
        need = (k_rows - n_above)[ambiguous]
        chosen = tied & (tie_rank <= need.unsqueeze(1))
        sub_row, token_id = chosen.nonzero(as_tuple=True)
        slot = n_above[ambiguous][sub_row] + tie_rank[sub_row, token_id] - 1
        tokens = tokens.clone()
        tokens[ambiguous[sub_row], slot] = token_id
    slots = torch.arange(k_max, device=device)
    valid = slots.unsqueeze(0) < k_rows.unsqueeze(1)
    ids, perm = torch.where(valid, tokens, vocab).sort(dim=-1)
    vals = values.gather(1, perm).masked_fill(ids == vocab, float("-inf"))
    vals, perm = vals.sort(dim=-1, descending=True, stable=True)
    return ids.gather(1, perm), vals


def _take(index: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Index several tensors alike."""
    return tuple(t[index] for t in tensors)


def kcbs_step(
    logprobs: Tensor,
    beam_request: Tensor,
    beam_score: Tensor,
    beam_raw: Tensor,
    beam_finished: Tensor,
    k_per_request: Tensor,
    keep_all: Tensor,
) -> KcbsSelection:
    """Expand and prune the beams of all k-CBS requests in one batched step.

    logprobs: [beams, V] log-softmax at temperature 1 (rows of finished beams are ignored).
    beam_request, beam_score, beam_raw, beam_finished: [beams] per-beam state.
    k_per_request: [requests] beam width; keep_all: [requests] keep every candidate (<= k^2).
    Scores are computed in the dtype of beam_score.
    """
    device = beam_score.device
    dtype = beam_score.dtype
    num_requests = int(k_per_request.numel())
    k_per_request = k_per_request.to(device=device, dtype=torch.long)
    keep_all = keep_all.to(device=device, dtype=torch.bool)
    beam_request = beam_request.to(device=device, dtype=torch.long)
    beam_finished = beam_finished.to(device=device, dtype=torch.bool)

    live = (~beam_finished).nonzero().squeeze(1)
    done = beam_finished.nonzero().squeeze(1)
    parents = [done]
    tokens = [torch.full_like(done, -1)]
    scores = [beam_score[done]]
    raws = [beam_raw[done]]
    if live.numel() > 0:
        k_live = k_per_request[beam_request[live]]
        rows = logprobs if live.numel() == logprobs.shape[0] else logprobs[live.to(logprobs.device)]
        ids, vals = ranked_topk(rows, k_live.to(rows.device))
        ids, vals = ids.to(device), vals.to(device=device, dtype=dtype)
        slots = torch.arange(ids.shape[1], device=device).expand_as(ids)
        valid = slots < k_live.unsqueeze(1)
        log_mass = torch.logsumexp(vals.masked_fill(~valid, float("-inf")), dim=-1, keepdim=True)
        parent = live.unsqueeze(1).expand_as(ids)[valid]
        lp = vals[valid]
        parents.append(parent)
        tokens.append(ids[valid])
        scores.append(beam_score[parent] + (lp - log_mass.expand_as(vals)[valid]))
        raws.append(beam_raw[parent] + lp)
    parent, token = torch.cat(parents), torch.cat(tokens)
    score, raw = torch.cat(scores), torch.cat(raws)
    finished = torch.arange(parent.numel(), device=device) < done.numel()

    order = parent.sort(stable=True).indices  # parent asc; each live parent's tokens stay in rank order
    order = order[score[order].sort(descending=True, stable=True).indices]
    order = order[beam_request[parent[order]].sort(stable=True).indices]
    request = beam_request[parent[order]]
    counts = torch.bincount(request, minlength=num_requests)
    starts = counts.cumsum(0) - counts
    position = torch.arange(request.numel(), device=device) - starts[request]
    limit = torch.where(keep_all, counts, k_per_request)
    order = order[position < limit[request]]
    request = beam_request[parent[order]]
    parent, token, score, raw, finished = _take(order, parent, token, score, raw, finished)
    kept = torch.bincount(request, minlength=num_requests)
    offsets = torch.cat([kept.new_zeros(1), kept.cumsum(0)])
    return KcbsSelection(request, parent, token, score, raw, finished, offsets)


def kcbs_initial(
    logprobs_prompt_last: Tensor,
    k_per_request: Tensor,
    keep_all: Tensor,
    score_dtype: torch.dtype = torch.float32,
) -> KcbsSelection:
    """First step from the prompt: one live beam per request with score 0 (parent_beam = request)."""
    num_requests = logprobs_prompt_last.shape[0]
    device = logprobs_prompt_last.device
    zeros = torch.zeros(num_requests, dtype=score_dtype, device=device)
    return kcbs_step(
        logprobs_prompt_last,
        torch.arange(num_requests, device=device),
        zeros,
        zeros.clone(),
        torch.zeros(num_requests, dtype=torch.bool, device=device),
        k_per_request,
        keep_all,
    )
