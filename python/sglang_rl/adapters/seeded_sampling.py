"""Scheduler side of seeded sampling: the tokens of requests that asked are drawn by the core's
seeded sampler (`fingerprint/seeded_sampling.py`) instead of sglang's, every other row untouched.

Two hooks: the worker's forward shows the batch's requests to the model runner (sglang's sampler
sees only tensors), and the sampling step replaces the opted-in rows' tokens and their log-probs.
The request fields are validated in `request_options.validate_seeded_sampling`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from sglang_rl.fingerprint.seeded_sampling import SamplingClaim, seeded_token
from sglang_rl.adapters.request_state import peek

_BATCH = "_sglang_rl_seeded_batch"
"""Attribute on the scheduler's model runner: the batch whose forward is running, while it runs."""


def _seed_of(req: Any) -> Optional[int]:
    """The request's sglang sampling_seed when it asked for seeded sampling, else None (kept on its
    state by `scheduler.req_init_after`, so a decode step reads no request options)."""
    state = peek(req)
    return None if state is None else state.seeded_sampling_seed


def worker_forward_around(original: Callable, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    """AROUND TpModelWorker.forward_batch_generation: a batch holding a seeded request is visible
    to `sample_around` during its forward (and its deferred sampling, if sglang defers it)."""
    reqs = getattr(batch, "reqs", None) or ()
    if not any(_seed_of(req) is not None for req in reqs):
        return original(worker, batch, *args, **kwargs)
    runner = worker.model_runner
    setattr(runner, _BATCH, batch)
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        setattr(runner, _BATCH, None)
    deferred = getattr(result, "delay_sample_func", None)
    if deferred is not None:
        def sample_later() -> Any:
            setattr(runner, _BATCH, batch)
            try:
                return deferred()
            finally:
                setattr(runner, _BATCH, None)
        result.delay_sample_func = sample_later
    return result


def _claim(params: Any) -> SamplingClaim:
    return SamplingClaim(temperature=float(params.temperature), top_p=float(params.top_p),
                         top_k=int(params.top_k), min_p=float(params.min_p))


def sample_around(original: Callable, runner: Any, logits_output: Any, forward_batch: Any,
                  *args: Any, **kwargs: Any) -> Any:
    """AROUND ModelRunner.sample: sglang samples the batch, then each seeded row's token becomes
    the seeded sampler's, at the absolute position the token takes (the row's sequence length)."""
    batch = getattr(runner, _BATCH, None)
    logits = getattr(logits_output, "next_token_logits", None)
    reqs = list(getattr(batch, "reqs", None) or ())
    rows = [(i, req, _seed_of(req)) for i, req in enumerate(reqs)]
    rows = [(i, req, seed) for i, req, seed in rows if seed is not None]
    if not rows or logits is None or logits.shape[0] != len(reqs):
        return original(runner, logits_output, forward_batch, *args, **kwargs)
    index = torch.tensor([i for i, _, _ in rows], device=logits.device)
    # read before sglang samples: sampling scales the logits in place
    picked = logits.index_select(0, index).float()
    positions = forward_batch.seq_lens.index_select(0, index.to(forward_batch.seq_lens.device)).tolist()
    next_ids = original(runner, logits_output, forward_batch, *args, **kwargs)
    claims = [_claim(req.sampling_params) for _, req, _ in rows]
    tokens = [seeded_token(picked[j], claim, int(seed), int(pos))
              for j, ((_, _, seed), claim, pos) in enumerate(zip(rows, claims, positions))]
    chosen = torch.tensor(tokens, dtype=torch.int64, device=picked.device)
    next_ids[index.to(next_ids.device)] = chosen.to(next_ids.device, next_ids.dtype)
    _fix_logprobs(logits_output, index, picked, claims, chosen)
    return next_ids


def _fix_logprobs(logits_output: Any, index: torch.Tensor, picked: torch.Tensor, claims: list[SamplingClaim],
                  chosen: torch.Tensor) -> None:
    """The returned log-prob of a replaced token is sglang's kind (log-softmax at the request's
    temperature) of the new token, not of the token sglang drew."""
    out = getattr(logits_output, "next_token_logprobs", None)
    if out is None:
        return
    temps = torch.tensor([c.temperature for c in claims], dtype=torch.float32, device=picked.device)
    logprobs = torch.log_softmax(picked / temps.view(-1, 1), dim=-1)
    values = logprobs.gather(1, chosen.view(-1, 1)).view(-1)
    out[index.to(out.device)] = values.to(out.device, out.dtype)
