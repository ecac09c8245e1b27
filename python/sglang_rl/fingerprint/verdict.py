"""A verification report's verdict band: the worst of its checks' bands, with the reasons.

The fingerprint gives pass, suspect or fail (``verify.fingerprint_band``); a requested token
check (``expect_greedy``, ``expect_sampled``) or the termination check that fails makes the
response fail, and so does a check that could not run. ``verified`` is true exactly for pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_rl.fingerprint.termination import check_termination, last_token_logprob
from sglang_rl_client.bands import FAIL, PASS


def complete_verdict(out: dict[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``verdict``, ``verdict_reasons`` and the termination fields to a finished report
    (``meta``: the request's meta_info, with the prefill's input log-probs)."""
    if "error" in out:
        out.update(verdict=FAIL, verdict_reasons=[str(out["error"])], verified=False)
        return out
    band = out.get("fingerprint_verdict") or (PASS if out.get("fingerprint_verified") else FAIL)
    reasons = [out.pop("fingerprint_reason")] if out.get("fingerprint_reason") else []
    if out.get("expect_greedy") and not out.get("greedy_consistent"):
        band = FAIL
        checked = out.get("argmax_checked") or 0
        reasons.append(f"{checked - (out.get('argmax_matches') or 0)} of {checked} response tokens are not "
                       "the model's argmax (expect_greedy)")
    if out.get("expect_sampled") and not out.get("sampling_consistent"):
        band = FAIL
        reasons.append(f"sampling test Z = {out.get('sampling_z', 0.0):.2f}, beyond "
                       f"+-{out.get('sampling_max_z')} (expect_sampled)")
    if out.get("expect_seeded") and not out.get("seeded_consistent"):
        band = FAIL
        reasons.append(f"{out.get('seeded_mismatches', 0)} of {out.get('seeded_checked', 0)} decided response "
                       "tokens are not the seeded sampler's (expect_seeded)")
    fields, reason = check_termination(out, last_token_logprob(out, meta))
    out.update(fields)
    if reason is not None:
        band = FAIL
        reasons.append(reason)
    out.update(verdict=band, verdict_reasons=reasons, verified=band == PASS)
    return out
