"""Per-request fields of sglang-rl and how they travel to the scheduler.

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

# Internal keys set by the API layer, never by users.
RESPONSE_START_KEY = "toploc_response_start"


class RequestOptionError(ValueError):
    """A sglang-rl request field has a bad value; the message says which and why."""


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
            raise RequestOptionError(
                "toploc_verification_fingerprint_to_validate must be a string (the last element of "
                "toploc_verification_fingerprints)"
            )
        out["toploc_verification_fingerprint_to_validate"] = fp
    if fields.get("toploc_verification_expect_greedy") and fields.get("toploc_verification_expect_sampled"):
        raise RequestOptionError(
            "toploc_verification_expect_greedy and toploc_verification_expect_sampled exclude each "
            "other: a response was either decoded greedily or sampled at temperature 1"
        )
    for name in ("toploc_verification_expect_greedy", "toploc_verification_expect_sampled") + IDS_FIELDS:
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
