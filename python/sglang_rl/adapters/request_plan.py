"""Request fields in: each item of a GenerateReqInput gets its own validated custom_params entry
and the per-item request settings that sglang should compute for it (log-probs, prompt ids).

`prepare_request` runs in the API process for every entry point (`adapters/api.py` calls it from
the `generate_request` hook); the plan it keeps per item is read back when that item's outputs
are finished (`item_plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_rl.hidden_states.options_entry import options_to_entry
from sglang_rl.fingerprint.sampling import DEFAULT_MAX_Z
from sglang_rl.fingerprint.sampling import TOP_N as SAMPLING_TOP_N
from sglang_rl.fingerprint.seeded_sampling import TOP_N as SEEDED_TOP_N
from sglang_rl.fingerprint.termination import MAX_NEW_TOKENS_FIELD
from sglang_rl.request_options import (
    ALL_FIELDS,
    CUSTOM_PARAMS_KEY,
    DEVICE_CHECKS_KEY,
    HIDDEN_STATES_FIELDS,
    KCBS_FIELDS,
    RESPONSE_START_KEY,
    SEEDED_SAMPLING_KEY,
    TOKEN_LOGPROBS_FIELD,
    RequestOptionError,
    pop_fields,
    seeded_claim,
    validate_combination,
    validate_fields,
    validate_fingerprint_to_validate,
    validate_grammar,
    validate_hidden_states,
    validate_kcbs,
    validate_seeded_sampling,
    validate_verification_span,
)

# Marks set on the request object by this module (never user input).
_IMPLICIT_PROMPT_IDS = "_sglang_rl_implicit_prompt_ids"
_ITEMS = "_sglang_rl_items"


def _batch_size(obj: Any) -> Optional[int]:
    """Number of prompts of a batch request, or None for a single prompt (sglang's own rule:
    a list of texts, or a list of id lists)."""
    if obj.text is not None:
        return None if isinstance(obj.text, str) else len(obj.text)
    ids = obj.input_ids
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def _prompt_len(obj: Any, item: Optional[int]) -> Optional[int]:
    ids = obj.input_ids if item is None else (obj.input_ids or [None] * (item + 1))[item]
    if isinstance(ids, list) and ids and isinstance(ids[0], int):
        return len(ids)
    return None


def _per_item(value: Any, item: Optional[int]) -> Any:
    """The value of one item of a request field that sglang lets be a per-item list."""
    return value[item] if item is not None and isinstance(value, list) else value


def _item_params(obj: Any, batch: Optional[int]) -> list[dict]:
    """One sampling_params dict per item, owned by that item (sglang shares one dict between all
    items of a batch when it is given once, so per-item entries need copies)."""
    params = obj.sampling_params
    if batch is None:
        if isinstance(params, list):
            return [p if isinstance(p, dict) else {} for p in params]
        return [params if isinstance(params, dict) else {}]
    if isinstance(params, list):
        if len(params) != batch:
            raise RequestOptionError(
                f"sampling_params is a list of {len(params)} entries for a batch of {batch} prompts: "
                "give one entry per prompt, or one dict for all"
            )
        return [dict(p) if isinstance(p, dict) else {} for p in params]
    return [dict(params or {}) for _ in range(batch)]


def _top_level_fields(obj: Any, batch: Optional[int]) -> list[dict]:
    """The sglang-rl fields set on the request object itself, one dict per item. In a batch a
    field may be one value for all items or a list with one value per item."""
    fields: dict = {}
    for name in ALL_FIELDS:
        value = getattr(obj, name, None)
        if value is not None:
            fields[name] = value
            setattr(obj, name, None)
    if batch is None:
        return [fields]
    items: list[dict] = [{} for _ in range(batch)]
    for name, value in fields.items():
        if isinstance(value, list):
            if len(value) != batch:
                raise RequestOptionError(
                    f"{name} is a list of {len(value)} values for a batch of {batch} prompts: give "
                    "one value per prompt, or one value for all"
                )
            for item, v in zip(items, value):
                if v is not None:
                    item[name] = v
        else:
            for item in items:
                item[name] = value
    return items


def _merge_fields(top: dict, params: dict) -> dict:
    """An item's fields from the top level and from its sampling_params; the same field given
    twice with different values is refused rather than one silently winning."""
    inner = pop_fields(params)
    for name, value in inner.items():
        if name in top and top[name] != value:
            raise RequestOptionError(
                f"{name} is given both at the top level ({top[name]!r}) and in sampling_params "
                f"({value!r}); give it once"
            )
    return {**top, **inner}


@dataclasses.dataclass
class ItemPlan:
    """What preparing one item decided: its custom_params entry and the per-item request
    settings that sglang keeps on the request object (lists in a batch)."""

    entry: dict
    return_logprob: Any
    logprob_start_len: Any
    top_logprobs_num: Any
    return_hidden_states: Any
    implicit_logprobs: bool = False
    max_sampling_z: float = DEFAULT_MAX_Z
    seeded_claim: Optional[dict] = None
    """expect_seeded: the claimed sampling (temperature, top_p, top_k, min_p, seed, vocab_size)."""


def prepare_request(obj: Any, server_args: Any, in_process: bool = False, vocab_size: Optional[int] = None) -> None:
    """Validate the sglang-rl fields of a GenerateReqInput and move them into custom_params,
    item by item: every item of a batch gets exactly its own fields."""
    if not isinstance(obj, GenerateReqInput):
        return
    batch = _batch_size(obj)
    tops = _top_level_fields(obj, batch)
    dicts = _item_params(obj, batch)
    if batch is None:
        tops = tops * len(dicts)
    plans = []
    for i, (top, params) in enumerate(zip(tops, dicts)):
        item = None if batch is None else i
        plan = _prepare_item(obj, item, params, _merge_fields(top, params), server_args, in_process)
        if plan.seeded_claim is not None:
            plan.seeded_claim["vocab_size"] = vocab_size
        plans.append(plan)
    if batch is not None:
        obj.sampling_params = dicts
    _apply_plans(obj, batch, plans)


def _prepare_item(obj: Any, item: Optional[int], params: dict, fields: dict, server_args: Any,
                  in_process: bool) -> ItemPlan:
    """Validate one item's fields and write its custom_params entry into its sampling_params."""
    validate_grammar(params)
    plan = ItemPlan(
        entry={},
        return_logprob=_per_item(obj.return_logprob, item),
        logprob_start_len=_per_item(obj.logprob_start_len, item),
        top_logprobs_num=_per_item(obj.top_logprobs_num, item),
        return_hidden_states=_per_item(obj.return_hidden_states, item),
    )
    internal = {k: v for k, v in ((params.get("custom_params") or {}).get(CUSTOM_PARAMS_KEY) or {}).items()
                if k == RESPONSE_START_KEY}
    hs_entry = _hidden_states_entry(plan, fields, server_args, in_process)
    kcbs_fields = {k: fields.pop(k) for k in KCBS_FIELDS if k in fields}
    kcbs_entry = validate_kcbs(kcbs_fields, params, bool(obj.stream), server_args)
    claimed_limit = fields.pop(MAX_NEW_TOKENS_FIELD, None)
    entry = validate_fields(fields, server_args)
    validate_combination(entry, kcbs_entry, bool(hs_entry))
    entry.update(hs_entry)
    if kcbs_entry:
        _prepare_kcbs(plan, params, kcbs_entry)
        entry.update(kcbs_entry)
    if entry.get(SEEDED_SAMPLING_KEY):
        if kcbs_entry:
            raise RequestOptionError(f"{SEEDED_SAMPLING_KEY} cannot be combined with k-CBS")
        validate_seeded_sampling(params, _per_item(getattr(obj, "custom_logit_processor", None), item), server_args)
    if "toploc_verification_fingerprint_to_validate" in entry:
        _prepare_verification(plan, params, entry, internal, _prompt_len(obj, item), server_args)
    if claimed_limit is not None:
        entry[MAX_NEW_TOKENS_FIELD] = _claimed_limit(claimed_limit, entry)
    entry.update(internal)
    plan.entry = entry
    if entry:
        custom = dict(params.get("custom_params") or {})
        custom[CUSTOM_PARAMS_KEY] = entry
        params["custom_params"] = custom
    return plan


# Request settings that sglang keeps per item, with the default it gives an unset one.
_PER_ITEM_DEFAULTS = {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
                      "return_hidden_states": False}


def _uniform_or_list(values: list) -> Any:
    """One value when all items agree (sglang refuses per-item lists with n > 1), else a list."""
    return values[0] if all(v == values[0] for v in values) else values


def _apply_plans(obj: Any, batch: Optional[int], plans: list[ItemPlan]) -> None:
    """Write the per-item request settings back onto the request object."""
    for name, default in _PER_ITEM_DEFAULTS.items():
        values = [getattr(p, name) for p in plans]
        if batch is None:
            setattr(obj, name, values[0])
        elif values != [_per_item(getattr(obj, name), i) for i in range(batch)]:
            # sglang fills defaults only for a value given once, never inside a per-item list
            setattr(obj, name, _uniform_or_list([default if v is None else v for v in values]))
    if any(p.entry.get("return_input_ids") for p in plans) and not obj.return_prompt_token_ids:
        obj.return_prompt_token_ids = True
        setattr(obj, _IMPLICIT_PROMPT_IDS, True)
    obj.__dict__[_ITEMS] = plans


def _hidden_states_entry(plan: ItemPlan, fields: dict, server_args: Any, in_process: bool) -> dict:
    """The custom_params entry of the hidden-state fields; a request that uses them leaves
    upstream's path."""
    hs_fields = {k: fields.pop(k) for k in HIDDEN_STATES_FIELDS if k in fields}
    if not hs_fields:
        return {}
    opts = validate_hidden_states(hs_fields, plan.return_hidden_states, server_args, in_process)
    if opts is None:
        return {}
    plan.return_hidden_states = False
    return options_to_entry(opts)


def checks_on_device(server_args: Any) -> bool:
    """Whether a verification's token checks run in the scheduler from its rows and the LM head
    (which needs the whole vocabulary's head on one rank), instead of from sglang's log-probs."""
    return getattr(server_args, "tp_size", 1) == 1 and getattr(server_args, "pp_size", 1) == 1


def _prepare_verification(plan: ItemPlan, params: dict, entry: dict, internal: dict,
                          prompt_len: Optional[int], server_args: Any) -> None:
    """A verification request is one prefill. Its token checks run on the device where the
    server allows (`checks_on_device`: they are passed to the scheduler); elsewhere sglang is
    asked for the log-probs of the response span."""
    fp = validate_fingerprint_to_validate(entry["toploc_verification_fingerprint_to_validate"], server_args)
    start = validate_verification_span(fp.n_rows, params, prompt_len, internal.get(RESPONSE_START_KEY))
    if start is not None:
        internal[RESPONSE_START_KEY] = start
    if entry.get("toploc_verification_expect_seeded"):
        plan.seeded_claim = seeded_claim(params)
        params.update(top_p=1.0, top_k=-1, min_p=0.0)
    params["temperature"] = 1.0
    sampled = bool(entry.get("toploc_verification_expect_sampled"))
    if sampled:
        plan.max_sampling_z = server_args.toploc_verification_max_sampling_z
    if checks_on_device(server_args):
        seeded = None if plan.seeded_claim is None else dict(plan.seeded_claim)
        internal[DEVICE_CHECKS_KEY] = {"sampled": sampled, "seeded": seeded,
                                       "token_lists": bool(entry.get(TOKEN_LOGPROBS_FIELD))}
        return
    plan.implicit_logprobs = not plan.return_logprob
    plan.return_logprob = True
    plan.logprob_start_len = max(start - 1, 0) if start is not None else 0
    plan.top_logprobs_num = max(plan.top_logprobs_num or 0, 1)
    if sampled:
        plan.top_logprobs_num = max(plan.top_logprobs_num, SAMPLING_TOP_N)
    if plan.seeded_claim is not None:
        plan.top_logprobs_num = max(plan.top_logprobs_num, SEEDED_TOP_N)


def _claimed_limit(value: Any, entry: dict) -> int:
    """The max_new_tokens a verified response was generated with (its termination check)."""
    if "toploc_verification_fingerprint_to_validate" not in entry:
        raise RequestOptionError(
            f"{MAX_NEW_TOKENS_FIELD} belongs to a verification request "
            "(with toploc_verification_fingerprint_to_validate)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestOptionError(
            f"{MAX_NEW_TOKENS_FIELD} must be a positive integer (the response's max_new_tokens), got {value!r}")
    return value


def _prepare_kcbs(plan: ItemPlan, params: dict, entry: dict) -> None:
    """k-CBS runs on the model's log-probs at temperature 1 without sampling filters; the request
    itself is one prefill (its beams are scheduled by the k-CBS adapter)."""
    params.update(max_new_tokens=0, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
    plan.implicit_logprobs = not plan.return_logprob
    plan.return_logprob = True
    plan.logprob_start_len = -1
    plan.top_logprobs_num = max(plan.top_logprobs_num or 0, entry["kcbs_k"])


def item_plan(obj: Any, position: int) -> Optional[ItemPlan]:
    """The plan of the item an output belongs to: outputs come item by item, each item's n
    samples next to each other (sglang's batch order)."""
    plans = obj.__dict__.get(_ITEMS) or []
    if not plans:
        return None
    n = getattr(obj, "parallel_sample_num", 1) or 1
    return plans[min(position // n, len(plans) - 1)]


def implicit_prompt_ids(obj: Any) -> bool:
    """Whether sglang returns the prompt ids only because a field asked for them (not the caller)."""
    return getattr(obj, _IMPLICIT_PROMPT_IDS, False)
