"""The verification result returned to clients: fingerprint statistics plus token checks.

The scheduler compares the prefill's rows with the proofs, and where it can it also computes the
token checks from the rows and the LM head (`fingerprint.device_tokens`: is each response token
the model's argmax? what log-prob did the model give it? the sampling tests); elsewhere they come
from the prefill's own log-probs, read here. Either way a verifier can check greedy responses
exactly and test that sampled ones were drawn from the model (`sglang_rl.fingerprint.sampling`,
`seeded_sampling`). The result is compact unless the request asked for per-token lists
(`response_token_logprobs`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from sglang_rl.fingerprint.sampling import DEFAULT_MAX_Z, SamplingCheck, sampling_check
from sglang_rl.fingerprint.seeded_sampling import SamplingClaim, SeededCheck, seeded_check
from sglang_rl.fingerprint.verdict import complete_verdict


def _response_indices(report: dict, meta: dict) -> Optional[tuple[list, list, list[tuple[int, int]]]]:
    """(input_token_logprobs, input_top_logprobs, [(position, index into them)]) for the response
    tokens that lie inside the prefill's log-probs; None when the meta has none."""
    entries = meta.get("input_token_logprobs") or []
    tops = meta.get("input_top_logprobs") or []
    prompt_len = meta.get("prompt_tokens")
    start = report.get("response_start")
    n = report.get("response_tokens")
    if not entries or prompt_len is None or start is None or n is None:
        return None
    first_pos = prompt_len - len(entries)
    indices = [(pos, pos - first_pos) for pos in range(start, min(start + n, prompt_len))
               if 0 <= pos - first_pos < len(entries)]
    return entries, tops, indices


def _token_checks(report: dict, meta: dict) -> dict:
    """Argmax matches and log-probs of the response tokens that lie inside the prefill."""
    found = _response_indices(report, meta)
    if found is None:
        return {}
    entries, tops, indices = found
    logprobs: list[Optional[float]] = []
    matches = 0
    checked = 0
    for _, j in indices:
        logprob, token = entries[j][0], entries[j][1]
        logprobs.append(None if logprob is None else float(logprob))
        top = tops[j] if j < len(tops) else None
        if top:
            checked += 1
            matches += int(top[0][1] == token)
    out: dict[str, Any] = {
        "response_token_logprobs": logprobs,
        "argmax_checked": checked,
        "argmax_matches": matches,
        "greedy_consistent": checked > 0 and matches == checked,
    }
    finite = [lp for lp in logprobs if lp is not None and math.isfinite(lp)]
    if finite:
        out["mean_response_logprob"] = sum(finite) / len(finite)
    next_top = (meta.get("output_top_logprobs") or [None])[0]
    if next_top:
        out["next_token_argmax"] = next_top[0][1]
    return out


def _sampling_fields(report: dict, meta: dict, max_z: float) -> dict:
    """The temperature-1 sampling test over the response tokens inside the prefill."""
    found = _response_indices(report, meta)
    if found is None:
        return SamplingCheck(z=0.0, checked=0, max_z=max_z).to_dict()
    entries, tops, indices = found
    tokens, logprobs, top_lists, positions = [], [], [], []
    for pos, j in indices:
        if j < len(tops):
            tokens.append(entries[j][1])
            logprobs.append(entries[j][0])
            top_lists.append([(entry[0], entry[1]) for entry in tops[j] or ()])
            positions.append(pos)
    return sampling_check(tokens, logprobs, top_lists, positions, max_z).to_dict()


TOKEN_CHECKS_KEY = "token_checks"
"""Scheduler report key: the token checks computed on the device (`fingerprint.device_tokens`)."""
TOKEN_LISTS_KEY = "token_lists"
"""Scheduler report key: whether the request asked for per-token lists."""
_LISTS = ("response_token_logprobs",)

# no vocabulary size known: bound the unseen tokens by a larger one (only fewer positions decide)
_FALLBACK_VOCAB = 1 << 18


def _seeded_fields(report: dict, meta: dict, claim: dict) -> dict:
    """The seeded-sampling check over the response tokens inside the prefill (`claim`: the
    claimed temperature, top_p, top_k, min_p, seed and the model's vocabulary size)."""
    found = _response_indices(report, meta)
    if found is None:
        return SeededCheck(checked=0, mismatches=0, undecided=0).to_dict()
    entries, tops, indices = found
    tokens, top_lists, positions = [], [], []
    for pos, j in indices:
        if j < len(tops) and tops[j]:
            tokens.append(entries[j][1])
            top_lists.append([(entry[0], entry[1]) for entry in tops[j] if entry[0] is not None])
            positions.append(pos)
    sampling = SamplingClaim(temperature=claim["temperature"], top_p=claim["top_p"], top_k=claim["top_k"],
                             min_p=claim["min_p"])
    check = seeded_check(tokens, top_lists, positions, sampling, claim["seed"],
                         claim.get("vocab_size") or _FALLBACK_VOCAB)
    return {**check.to_dict(), "seeded_claim": {k: v for k, v in claim.items() if k != "vocab_size"}}


def finalize_report(report: dict, meta: dict, expect_greedy: bool = False, expect_sampled: bool = False,
                    max_sampling_z: float = DEFAULT_MAX_Z, seeded: Optional[dict] = None) -> dict:
    """Complete the scheduler's report; `verified` also requires greedy consistency, a passing
    temperature-1 sampling test or a passing seeded check (`seeded`: the claimed sampling), if
    asked, and the termination check (`verdict`)."""
    out = dict(report)
    device = out.pop(TOKEN_CHECKS_KEY, None)
    token_lists = bool(out.pop(TOKEN_LISTS_KEY, True))
    if "error" in out:
        out["verified"] = False
        return complete_verdict(out, meta)
    out["exp_mismatches"] = out.get("worst_exp_mismatches")
    out["mant_err_mean"] = out.get("worst_mant_err_mean")
    out["mant_err_median"] = out.get("worst_mant_err_median")
    out["fingerprint_verified"] = bool(out.get("verified"))
    if device is not None:
        meta = _eos_meta(out, device)
        out.update({k: v for k, v in device.items() if k != "response_last_logprob"})
    else:
        out.update(_token_checks(out, meta))
    verdict = out["fingerprint_verified"]
    if expect_greedy:
        out["expect_greedy"] = True
        verdict = verdict and bool(out.get("greedy_consistent"))
    if expect_sampled:
        out["expect_sampled"] = True
        if device is None:
            out.update(_sampling_fields(out, meta, max_sampling_z))
        verdict = verdict and bool(out.get("sampling_consistent"))
    if seeded is not None:
        out["expect_seeded"] = True
        if device is None:
            out.update(_seeded_fields(out, meta, seeded))
        else:
            out["seeded_claim"] = {k: v for k, v in seeded.items() if k != "vocab_size"}
        verdict = verdict and bool(out.get("seeded_consistent"))
    if not token_lists:
        for key in _LISTS:
            out.pop(key, None)
    out["verified"] = verdict
    return complete_verdict(out, meta)


def _eos_meta(report: dict, device: dict) -> dict:
    """The last response token's log-prob from the device's checks, in the form the termination
    check reads from sglang's input log-probs (its last entry)."""
    logprob, token = device.get("response_last_logprob"), report.get("response_last_token")
    if logprob is None or token is None:
        return {}
    return {"input_token_logprobs": [(logprob, token, None)]}
