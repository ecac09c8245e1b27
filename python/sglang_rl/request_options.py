"""Per-request fields of sglang-rl, their validation, and how they travel to the scheduler.

Every field is validated here, once (the hidden-state values by the core's
`HiddenStatesOptions.from_request`, called from `validate_hidden_states`); a bad value raises
`RequestOptionError`, a ValueError that the API turns into a 400 with the reason.

Users set them as OpenAI extra fields, as top-level `/generate` fields, as `sgl.Engine.generate`
keyword arguments, or inside `sampling_params`. Whatever the entry, they are validated once in
the tokenizer manager and moved into `sampling_params.custom_params["sglang_rl"]`, a flat dict of
JSON scalars: the one channel that sglang already carries from the API to every scheduler `Req`.
"""

from __future__ import annotations

from typing import Any, Optional

CUSTOM_PARAMS_KEY = "sglang_rl"

# Public field name -> internal key inside custom_params["sglang_rl"].
TOPLOC_FIELDS = (
    "toploc_verification_fingerprint_to_validate",
    "toploc_verification_expect_greedy",
    "toploc_verification_expect_sampled",
    "toploc_verification_max_new_tokens",
    "toploc_verification_seeded_sampling",
    "toploc_verification_expect_seeded",
    "toploc_verification_return_token_logprobs",
)
IDS_FIELDS = ("return_input_ids", "return_output_ids")
HIDDEN_STATES_FIELDS = (
    "hidden_states_format",
    "hidden_states_scope",
    "hidden_states_last_n",
    "return_final_hidden_state",
)
KCBS_FIELDS = ("kcbs_enabled", "kcbs_beam_width", "kcbs_final_prune", "kcbs_steps")
COTRAIN_FIELDS = ("drafter_cotrain",)
ALL_FIELDS = TOPLOC_FIELDS + IDS_FIELDS + HIDDEN_STATES_FIELDS + KCBS_FIELDS + COTRAIN_FIELDS

KCBS_MAX_BEAM_WIDTH = 32
KCBS_MAX_STEPS = 1024

# Response fields of a request's hidden-state rows. They are named apart from upstream's
# `hidden_states` (meta_info, OpenAI choices), which a request that uses these fields turns off.
HIDDEN_STATES_ROWS_FIELD = "hidden_states_rows"
HIDDEN_STATES_POSITIONS_FIELD = "hidden_states_positions"
HIDDEN_STATES_ERROR_FIELD = "hidden_states_error"

# Response fields of TOPLOC verification: a response's fingerprints, and a verification's result.
FINGERPRINTS_FIELD = "toploc_verification_fingerprints"
RESULT_FIELD = "toploc_verification_fingerprint_validation_result"
TOKEN_LOGPROBS_FIELD = "toploc_verification_return_token_logprobs"
"""Request field: a verification's result with per-token lists (response_token_logprobs)."""

# Internal keys set by the API layer, never by users.
RESPONSE_START_KEY = "toploc_response_start"
DEVICE_CHECKS_KEY = "toploc_device_checks"
"""A verification's token checks run in the scheduler, on the device: what they compute."""


class RequestOptionError(ValueError):
    """A sglang-rl request field has a bad value; the message says which and why."""


class InvalidFingerprintError(RequestOptionError):
    """The fingerprint of a verification request is malformed (counted apart in the metrics)."""


# Speculative algorithms whose verify-step rows follow the committed tokens (adapters/speculative.py).
SUPPORTED = ("EAGLE", "EAGLE3", "NEXTN", "NGRAM")
_REFUSALS = {
    "STANDALONE": "a STANDALONE target does not capture rows in its prefill",
}


def unsupported_reason(algorithm: Optional[str]) -> Optional[str]:
    """Why a server's speculative rows cannot follow the committed tokens, or None when they do
    (also None without speculative decoding)."""
    if not algorithm or str(algorithm).upper() in SUPPORTED:
        return None
    name = str(algorithm).upper()
    reason = _REFUSALS.get(name, "its verify step's rows are not known to follow the committed tokens")
    return f"{reason} (supported: {', '.join(SUPPORTED)})"


def check_rows_supported(algorithm: Optional[str]) -> None:
    """Refuse hidden-state fields on a server whose speculative rows cannot follow the committed
    tokens (None: no speculative decoding)."""
    reason = unsupported_reason(algorithm)
    if reason is not None:
        raise RequestOptionError(
            f"hidden_states_* fields are not supported with --speculative-algorithm "
            f"{str(algorithm).upper()}: {reason}"
        )


def pop_fields(source: dict) -> dict:
    """Remove the sglang-rl fields from a dict (e.g. sampling_params) and return them."""
    return {name: source.pop(name) for name in ALL_FIELDS if name in source}


def validate_fields(fields: dict, server_args: Any) -> dict:
    """Check types and server support of the TOPLOC and id fields; return the custom_params
    entry (hidden-state fields are validated by sglang_rl.hidden_states)."""
    out: dict = {}
    fp = fields.get("toploc_verification_fingerprint_to_validate")
    if fp is not None:
        if not getattr(server_args, "toploc_verification", False):
            raise RequestOptionError(
                "toploc_verification_fingerprint_to_validate was given but this server was started "
                "without --toploc-verification"
            )
        if not isinstance(fp, str):
            raise InvalidFingerprintError(
                "toploc_verification_fingerprint_to_validate must be a string (the last element of "
                "toploc_verification_fingerprints)"
            )
        out["toploc_verification_fingerprint_to_validate"] = fp
    expects = [n for n in EXPECT_FIELDS if fields.get(n) is True]
    if len(expects) > 1:
        raise RequestOptionError(
            f"{' and '.join(expects)} exclude each other: a response was decoded greedily, sampled "
            "at temperature 1, or sampled with a seed"
        )
    for name in EXPECT_FIELDS + (SEEDED_SAMPLING_KEY, TOKEN_LOGPROBS_FIELD) + IDS_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise RequestOptionError(f"{name} must be true or false, got {value!r}")
        if value:
            out[name] = True
    cotrain = fields.get("drafter_cotrain")
    if cotrain is not None:
        if not isinstance(cotrain, bool):
            raise RequestOptionError(f"drafter_cotrain must be true or false, got {cotrain!r}")
        if cotrain and not getattr(server_args, "drafter_cotrain", False):
            raise RequestOptionError("drafter_cotrain=true needs a server started with --drafter-cotrain")
        if not cotrain:
            out["cotrain_opt_out"] = True  # sglang_rl.adapters.cotrain.OPT_OUT_KEY
    return out


EXPECT_FIELDS = ("toploc_verification_expect_greedy", "toploc_verification_expect_sampled",
                 "toploc_verification_expect_seeded")
SEEDED_SAMPLING_KEY = "toploc_verification_seeded_sampling"
# sampling_params values that change the logits in ways a verifier's prefill cannot see
_SEEDED_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                   "min_new_tokens": 0, "logit_bias": None}


def _seed(params: dict, field: str) -> int:
    seed = params.get("sampling_seed")
    if seed is None:
        raise RequestOptionError(f"{field} needs sglang's sampling_params.sampling_seed (OpenAI: seed)")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise RequestOptionError(f"sampling_seed must be an integer in [0, 2^63), got {seed!r}")
    return seed


def validate_seeded_sampling(params: dict, custom_logit_processor: Any, server_args: Any) -> None:
    """A generation that samples with the seeded sampler: it needs a seed, and nothing that moves
    its logits away from the model's (which the verifier recomputes) or repeats its draws."""
    field = SEEDED_SAMPLING_KEY
    _seed(params, field)
    if params.get("max_new_tokens") == 0:
        raise RequestOptionError(f"{field} is for generations (max_new_tokens > 0)")
    for name, neutral in _SEEDED_NEUTRAL.items():
        if params.get(name) not in (None, neutral):
            raise RequestOptionError(f"{field} cannot be combined with {name}: the verifier sees only "
                                     "the model's logits")
    if any(params.get(name) is not None for name in GRAMMAR_PARAMS) or custom_logit_processor:
        raise RequestOptionError(f"{field} cannot be combined with a grammar or a custom logit processor")
    if (params.get("n") or 1) > 1:
        raise RequestOptionError(f"{field} with n > 1 would draw the same tokens n times: send one "
                                 "request per seed")
    if getattr(server_args, "speculative_algorithm", None):
        raise RequestOptionError(f"{field} is not supported with speculative decoding")


def seeded_claim(params: dict) -> dict:
    """The sampling a verified response claims (expect_seeded): the verification request's own
    temperature, top_p, top_k, min_p and sampling_seed, in sglang's meaning."""
    field = "toploc_verification_expect_seeded"
    seed = _seed(params, field)
    temperature = params.get("temperature", 1.0)
    top_p = params.get("top_p", 1.0)
    top_k = params.get("top_k", -1)
    min_p = params.get("min_p", 0.0)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestOptionError(f"{name} must be a number, got {value!r}")
    if not 0 < temperature <= 100:
        raise RequestOptionError(f"{field} needs a temperature in (0, 100], got {temperature} "
                                 "(greedy responses: toploc_verification_expect_greedy)")
    if not 0 < top_p <= 1 or not 0 <= min_p <= 1:
        raise RequestOptionError(f"top_p must be in (0, 1] and min_p in [0, 1], got {top_p}, {min_p}")
    if top_k is None:
        top_k = -1
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise RequestOptionError(f"top_k must be -1 or a positive integer, got {top_k!r}")
    return {"temperature": float(temperature), "top_p": float(top_p), "top_k": top_k,
            "min_p": float(min_p), "seed": seed}


# sglang's own grammar fields of sampling_params.
GRAMMAR_PARAMS = ("regex", "json_schema", "ebnf", "structural_tag")


def validate_grammar(params: dict) -> None:
    """Refuse the grammar values that kill sglang's scheduler instead of failing one request: a
    value that is not a string (an unhashable grammar cache key) and a NUL character, raw or
    JSON-escaped (xgrammar 0.2.1 crashes the process on it)."""
    for name in GRAMMAR_PARAMS:
        value = params.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RequestOptionError(f"{name} must be a string, got {type(value).__name__}")
        if "\x00" in value or "\\u0000" in value:
            raise RequestOptionError(f"{name} must not contain a NUL character")


def validate_hidden_states(fields: dict, requested: Any, server_args: Any, in_process: bool) -> Optional[Any]:
    """The hidden-state fields of a request (`requested`: its `return_hidden_states`), as
    `HiddenStatesOptions` when the request wants rows (None when not): the values are checked by
    the core's parser, the server's support here."""
    from sglang_rl.hidden_states import HiddenStatesOptions

    opts = HiddenStatesOptions.from_request(requested, **fields, allow_tensor_format=in_process)
    if not opts.enabled:
        return None
    allowed = getattr(server_args, "return_hidden_states_mode", None)
    if allowed is None or (opts.mode.value == "full" and allowed != "full"):
        raise RequestOptionError(
            f"return_hidden_states={requested!r} needs a server started with "
            "--enable-return-hidden-states (or --return-hidden-states-mode full)"
        )
    check_rows_supported(getattr(server_args, "speculative_algorithm", None))
    return opts


def validate_fingerprint_to_validate(value: str, server_args: Any) -> Any:
    """The decoded fingerprint of a verification request (an untrusted proof: checked here before
    anything reaches toploc's verifier)."""
    from sglang_rl.fingerprint import FingerprintError, decode_fingerprint

    try:
        return decode_fingerprint(value, expected_topk=server_args.toploc_verification_topk)
    except FingerprintError as exc:
        raise InvalidFingerprintError(f"invalid toploc_verification_fingerprint_to_validate: {exc}") from exc


def validate_verification_span(n_rows: int, params: dict, prompt_len: Optional[int],
                               response_start: Optional[int]) -> Optional[int]:
    """Check that a verification request is one prefill whose response span holds the
    fingerprint's `n_rows` tokens; return where the response starts (None when unknown)."""
    if params.get("max_new_tokens") not in (0,):
        raise RequestOptionError(
            "a verification request must be prefill-only: set max_tokens=0 (max_new_tokens=0)"
        )
    if response_start is not None and prompt_len is not None and prompt_len - response_start not in (n_rows, n_rows - 1):
        raise RequestOptionError(
            f"the reply re-tokenizes to {prompt_len - response_start} tokens but the fingerprint covers "
            f"{n_rows} generated tokens, so its rows cannot be aligned; verify with the exact-token "
            "form (input_ids + output_ids, from return_input_ids / return_output_ids)"
        )
    if response_start is None and prompt_len is not None:
        if prompt_len < n_rows + 1:
            raise RequestOptionError(
                f"the fingerprint covers {n_rows} response tokens but the prompt has only "
                f"{prompt_len} tokens: send input_ids + output_ids"
            )
        response_start = prompt_len - n_rows
    return response_start


def validate_combination(entry: dict, kcbs_entry: dict, wants_rows: bool) -> None:
    """Fields that each pass alone but not together."""
    if not kcbs_entry:
        return
    if "toploc_verification_fingerprint_to_validate" in entry:
        raise RequestOptionError("a k-CBS request cannot also be a verification request")
    if wants_rows:
        # the candidates are assembled from beam requests: there is no single row sequence
        raise RequestOptionError("k-CBS returns candidates, not hidden-state rows: send the rows "
                                 "request separately")


KCBS_STREAM_ERROR = "k-CBS does not support streaming: set stream=false"


def _int_field(fields: dict, name: str, default: Any, default_name: str, low: int, high: int) -> int:
    value = fields.get(name)
    label = name
    if value is None:
        if default is None:
            raise RequestOptionError(f"k-CBS needs {name}: set it, or set {default_name} (its default)")
        value = default
        label = f"{default_name} (the default of {name})"
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestOptionError(f"{label} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise RequestOptionError(f"{name} must be between {low} and {high}, got {value}")
    return value


def validate_kcbs(fields: dict, params: dict, stream: bool, server_args: Any) -> dict:
    """Check the k-CBS fields of a request; return the custom_params entry (empty if off)."""
    enabled = fields.get("kcbs_enabled")
    if enabled is None or enabled is False:
        extra = [n for n in KCBS_FIELDS if n != "kcbs_enabled" and fields.get(n) is not None]
        if extra:
            raise RequestOptionError(f"{', '.join(extra)} given without kcbs_enabled=true")
        return {}
    if enabled is not True:
        raise RequestOptionError(f"kcbs_enabled must be true or false, got {enabled!r}")
    top_k = params.get("top_k")
    k = _int_field(fields, "kcbs_beam_width", top_k if isinstance(top_k, int) and top_k > 0 else None,
                   "top_k", 1, KCBS_MAX_BEAM_WIDTH)
    steps = _int_field(fields, "kcbs_steps", params.get("max_new_tokens"), "max_tokens / max_new_tokens",
                       1, KCBS_MAX_STEPS)
    final_prune = fields.get("kcbs_final_prune", True)
    if not isinstance(final_prune, bool):
        raise RequestOptionError(f"kcbs_final_prune must be true or false, got {final_prune!r}")
    if (params.get("n") or 1) > 1:
        raise RequestOptionError("k-CBS returns its candidates in one choice: n > 1 is not supported")
    if stream:
        raise RequestOptionError(KCBS_STREAM_ERROR)
    if getattr(server_args, "speculative_algorithm", None):
        raise RequestOptionError("k-CBS is not supported with speculative decoding")
    if (getattr(server_args, "page_size", None) or 1) > 1:
        # beams fork token by token in req_to_token; paged KV would need page-aligned forks
        raise RequestOptionError("k-CBS needs a server with --page-size 1")
    return {"kcbs_k": k, "kcbs_steps": steps, "kcbs_keep_all": not final_prune}


def options_of(custom_params: Optional[dict]) -> dict:
    """The sglang-rl entry of a request's custom_params (empty when the request set none)."""
    if not isinstance(custom_params, dict):
        return {}
    entry = custom_params.get(CUSTOM_PARAMS_KEY)
    return entry if isinstance(entry, dict) else {}
