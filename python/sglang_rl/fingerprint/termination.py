"""The termination check of a verified response: did it end where the model would let it end?

It runs when the verification request states the generation's limit (``max_new_tokens``): a
response that ends on an EOS / stop token must have given that token at least ``min_eos_prob`` at
its position under the verifier (a worker that cuts a response short and appends EOS puts it where
the model rarely would); one that ends without it must have used up that limit. Without the limit
nothing is checked: a constrained generation (a grammar) ends where the grammar does, not where the
model would. The probability is the exponential of the last response token's log-prob, from the
prefill's own log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

MAX_NEW_TOKENS_FIELD = "toploc_verification_max_new_tokens"
"""Request field: the max_new_tokens the response was generated with (the claimed limit)."""


def termination_inputs(last_in_prefill: bool, last_token: Optional[int], is_stop: Callable[[int], bool],
                       min_eos_prob: float, max_new_tokens: Optional[int]) -> dict[str, Any]:
    """What the scheduler knows for the check: whether the response's last token is an EOS /
    stop id (only when that token is in the prefill; the chat form leaves a final EOS out), the
    probability bound and the claimed limit."""
    out: dict[str, Any] = {"min_eos_prob": min_eos_prob}
    if max_new_tokens is not None:
        out["max_new_tokens"] = max_new_tokens
    if last_in_prefill and last_token is not None:
        out["response_last_token"] = int(last_token)
        out["ends_on_eos"] = bool(is_stop(int(last_token)))
    return out


def last_token_logprob(report: Mapping[str, Any], meta: Mapping[str, Any]) -> Optional[float]:
    """The log-prob of the response's last token among the prefill's input log-probs (the last
    entry, when it is that token); None when absent."""
    entries = meta.get("input_token_logprobs") or []
    if not entries or "response_last_token" not in report:
        return None
    logprob, token = entries[-1][0], entries[-1][1]
    if token != report["response_last_token"] or logprob is None:
        return None
    return float(logprob)


def check_termination(report: Mapping[str, Any], eos_logprob: Optional[float]
                      ) -> tuple[dict[str, Any], Optional[str]]:
    """The termination fields (``eos_prob``, ``termination_verified``: true, false, or None when
    nothing could be checked) and the reason when it failed."""
    n = report.get("response_tokens")
    limit = report.get("max_new_tokens")
    ends = report.get("ends_on_eos")
    bound = float(report.get("min_eos_prob") or 0.0)
    fields: dict[str, Any] = {}
    if ends and eos_logprob is not None:
        fields["eos_prob"] = math.exp(eos_logprob) if math.isfinite(eos_logprob) else 0.0
    ok: Optional[bool] = None
    reason = None
    if limit is not None and n is not None and n > limit:
        ok, reason = False, f"the response has {n} tokens, more than its max_new_tokens {limit}"
    elif limit is not None and n == limit:
        ok = True
    elif ends and "eos_prob" in fields and bound > 0 and limit is not None:
        ok = fields["eos_prob"] >= bound
        if not ok:
            reason = (f"the response ends on stop token {report.get('response_last_token')}, which the model gave "
                      f"probability {fields['eos_prob']:.3g} there, below {bound:g}")
    elif ends is False and limit is not None:
        ok, reason = False, f"the response ends without an EOS / stop token after {n} tokens, before its max_new_tokens {limit}"
    fields["termination_verified"] = ok
    return fields, reason
