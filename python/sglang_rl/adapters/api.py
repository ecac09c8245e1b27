"""API-process adapter: request fields in, per-request results out, for every entry point.

`/generate`, `sgl.Engine` and the OpenAI endpoints all call `TokenizerManager.generate_request`;
wrapping it gives one place to validate the sglang-rl fields (a bad value raises ValueError, which
every caller turns into a 400), move them into custom_params, and turn the scheduler's payload into
response fields of `meta_info`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, AsyncIterator, Callable, Optional

from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_rl.adapters import hidden_states as hs_adapter
from sglang_rl.adapters import rollout_records, transport
from sglang_rl.adapters.kcbs_manager import CANDIDATES_FIELD
from sglang_rl.fingerprint.sampling import DEFAULT_MAX_Z
from sglang_rl.fingerprint.sampling import TOP_N as SAMPLING_TOP_N
from sglang_rl.request_options import (
    ALL_FIELDS,
    CUSTOM_PARAMS_KEY,
    FINGERPRINTS_FIELD,
    HIDDEN_STATES_FIELDS,
    KCBS_FIELDS,
    KCBS_STREAM_ERROR,
    RESPONSE_START_KEY,
    RESULT_FIELD,
    RequestOptionError,
    pop_fields,
    validate_combination,
    validate_fields,
    validate_fingerprint_to_validate,
    validate_grammar,
    validate_hidden_states,
    validate_kcbs,
    validate_verification_span,
)
from sglang_rl.verification_report import finalize_report

# Marks set on the request object by this adapter (never user input).
_IMPLICIT_PROMPT_IDS = "_sglang_rl_implicit_prompt_ids"
_ITEMS = "_sglang_rl_items"
_RESULTS = "_sglang_rl_results"

# Response fields this plugin adds to meta_info (and to OpenAI choices), each named apart from
# upstream's keys: an output whose request set no plugin field carries none of them.
RESPONSE_FIELDS = (
    FINGERPRINTS_FIELD, RESULT_FIELD, "input_ids", "output_ids",
    hs_adapter.ROWS_FIELD, hs_adapter.POSITIONS_FIELD, hs_adapter.ERROR_FIELD, CANDIDATES_FIELD,
)


def _refuse_streamed_kcbs(self: GenerateReqInput) -> None:
    # /generate with stream=true answers from inside its streaming response, so a ValueError
    # raised later (in generate_request) would reach the client as an SSE error event after
    # a 200; refusing here makes it a 400 like every other bad field.
    if self.stream is True and _kcbs_requested(self):
        raise RequestOptionError(KCBS_STREAM_ERROR)


RLGenerateReqInput = dataclasses.make_dataclass(
    "RLGenerateReqInput",
    [(name, Optional[Any], dataclasses.field(default=None)) for name in ALL_FIELDS],
    bases=(GenerateReqInput,),
    namespace={
        "__module__": __name__,
        "__doc__": "GenerateReqInput with the sglang-rl fields (`ALL_FIELDS`), so `/generate` accepts "
                   "them at top level (typed loosely: our validation, not coercion, judges the values).",
        "__post_init__": _refuse_streamed_kcbs,
    },
)


def _kcbs_requested(obj: Any) -> bool:
    top = getattr(obj, "kcbs_enabled", None)
    if top is True or (isinstance(top, list) and True in top):
        return True
    params = obj.sampling_params
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict) and p.get("kcbs_enabled") is True:
            return True
    return False


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
class _ItemPlan:
    """What preparing one item decided: its custom_params entry and the per-item request
    settings that sglang keeps on the request object (lists in a batch)."""

    entry: dict
    return_logprob: Any
    logprob_start_len: Any
    top_logprobs_num: Any
    return_hidden_states: Any
    implicit_logprobs: bool = False
    max_sampling_z: float = DEFAULT_MAX_Z


def prepare_request(obj: Any, server_args: Any, in_process: bool = False) -> None:
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
        plans.append(_prepare_item(obj, item, params, _merge_fields(top, params), server_args, in_process))
    if batch is not None:
        obj.sampling_params = dicts
    _apply_plans(obj, batch, plans)


def _prepare_item(obj: Any, item: Optional[int], params: dict, fields: dict, server_args: Any,
                  in_process: bool) -> _ItemPlan:
    """Validate one item's fields and write its custom_params entry into its sampling_params."""
    validate_grammar(params)
    plan = _ItemPlan(
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
    entry = validate_fields(fields, server_args)
    validate_combination(entry, kcbs_entry, bool(hs_entry))
    entry.update(hs_entry)
    if kcbs_entry:
        _prepare_kcbs(plan, params, kcbs_entry)
        entry.update(kcbs_entry)
    if "toploc_verification_fingerprint_to_validate" in entry:
        _prepare_verification(plan, params, entry, internal, _prompt_len(obj, item), server_args)
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


def _apply_plans(obj: Any, batch: Optional[int], plans: list[_ItemPlan]) -> None:
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


def _hidden_states_entry(plan: _ItemPlan, fields: dict, server_args: Any, in_process: bool) -> dict:
    """The custom_params entry of the hidden-state fields; a request that uses them leaves
    upstream's path."""
    hs_fields = {k: fields.pop(k) for k in HIDDEN_STATES_FIELDS if k in fields}
    if not hs_fields:
        return {}
    opts = validate_hidden_states(hs_fields, plan.return_hidden_states, server_args, in_process)
    if opts is None:
        return {}
    plan.return_hidden_states = False
    return hs_adapter.options_to_entry(opts)


def _prepare_verification(plan: _ItemPlan, params: dict, entry: dict, internal: dict,
                          prompt_len: Optional[int], server_args: Any) -> None:
    """A verification request is one prefill; ask sglang for the log-probs of its response span."""
    fp = validate_fingerprint_to_validate(entry["toploc_verification_fingerprint_to_validate"], server_args)
    start = validate_verification_span(fp.n_rows, params, prompt_len, internal.get(RESPONSE_START_KEY))
    if start is not None:
        internal[RESPONSE_START_KEY] = start
    params["temperature"] = 1.0
    plan.implicit_logprobs = not plan.return_logprob
    plan.return_logprob = True
    plan.logprob_start_len = max(start - 1, 0) if start is not None else 0
    plan.top_logprobs_num = max(plan.top_logprobs_num or 0, 1)
    if entry.get("toploc_verification_expect_sampled"):
        plan.top_logprobs_num = max(plan.top_logprobs_num, SAMPLING_TOP_N)
        plan.max_sampling_z = server_args.toploc_verification_max_sampling_z


def _prepare_kcbs(plan: _ItemPlan, params: dict, entry: dict) -> None:
    """k-CBS runs on the model's log-probs at temperature 1 without sampling filters; the request
    itself is one prefill (its beams are scheduled by the k-CBS adapter)."""
    params.update(max_new_tokens=0, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
    plan.implicit_logprobs = not plan.return_logprob
    plan.return_logprob = True
    plan.logprob_start_len = -1
    plan.top_logprobs_num = max(plan.top_logprobs_num or 0, entry["kcbs_k"])


def _item_plan(obj: Any, position: int) -> Optional[_ItemPlan]:
    """The plan of the item an output belongs to: outputs come item by item, each item's n
    samples next to each other (sglang's batch order)."""
    plans = obj.__dict__.get(_ITEMS) or []
    if not plans:
        return None
    n = getattr(obj, "parallel_sample_num", 1) or 1
    return plans[min(position // n, len(plans) - 1)]


def _finish_meta(out: dict, obj: Any, position: int) -> None:
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        return
    plan = _item_plan(obj, position)
    options = plan.entry if plan is not None else {}
    payload = transport.collect(meta)
    if FINGERPRINTS_FIELD in payload:
        meta[FINGERPRINTS_FIELD] = payload[FINGERPRINTS_FIELD]
    if hs_adapter.PAYLOAD_KEY in payload:
        meta.update(hs_adapter.deliver(payload[hs_adapter.PAYLOAD_KEY]))
    if CANDIDATES_FIELD in payload:
        meta[CANDIDATES_FIELD] = payload[CANDIDATES_FIELD]
    if RESULT_FIELD in payload:
        meta[RESULT_FIELD] = json.dumps(finalize_report(
            payload[RESULT_FIELD], meta,
            expect_greedy=bool(options.get("toploc_verification_expect_greedy")),
            expect_sampled=bool(options.get("toploc_verification_expect_sampled")),
            max_sampling_z=plan.max_sampling_z if plan is not None else DEFAULT_MAX_Z,
        ))
    if plan is not None and plan.implicit_logprobs:
        for key in [k for k in meta if "logprobs" in k]:
            meta.pop(key)
    if options.get("return_input_ids") and "prompt_token_ids" in out:
        meta["input_ids"] = out["prompt_token_ids"]
    if getattr(obj, _IMPLICIT_PROMPT_IDS, False):
        out.pop("prompt_token_ids", None)
    if options.get("return_output_ids") and "output_ids" in out:
        meta["output_ids"] = list(out["output_ids"])
    fields = {k: meta[k] for k in RESPONSE_FIELDS if k in meta}
    if fields:
        obj.__dict__.setdefault(_RESULTS, {})[out.get("index", position)] = fields


def _encodes_rows(out: dict) -> bool:
    """Whether finishing this output encodes hidden-state rows as base64."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        return False
    return any(isinstance(p, dict) and hs_adapter.encodes(p.get(hs_adapter.PAYLOAD_KEY))
               for p in meta.get(transport.KEY) or ())


def results_of(obj: Any) -> dict:
    """Response fields recorded per choice index for a request (read by the streaming adapter)."""
    return obj.__dict__.get(_RESULTS, {})


def generate_request_around(original: Callable, manager: Any, obj: Any, request: Any = None) -> AsyncIterator:
    """AROUND TokenizerManager.generate_request (an async generator)."""

    async def run():
        prepare_request(obj, manager.server_args, in_process=request is None)
        async for out in original(manager, obj, request):
            encoding = []
            for position, item in enumerate(out if isinstance(out, list) else [out]):
                if not isinstance(item, dict):
                    continue
                position = item.get("index", position)
                if _encodes_rows(item):
                    encoding.append((item, position))
                else:
                    _finish_meta(item, obj, position)
            if encoding:
                # base64 of megabytes of rows, in worker threads (reading the row files and the
                # SIMD encoder both release the GIL): the outputs of a batch request, which arrive
                # together, encode in parallel, and the event loop keeps serving other requests
                await asyncio.gather(*(asyncio.to_thread(_finish_meta, item, obj, position)
                                       for item, position in encoding))
            for item in out if isinstance(out, list) else [out]:
                if isinstance(item, dict):
                    rollout_records.record(manager, item)
            yield out

    return run()


def _engine_batch_size(args: tuple, kwargs: dict) -> Optional[int]:
    """Number of prompts of an Engine.generate call (None for one prompt)."""
    prompt = args[0] if args else kwargs.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    ids = args[2] if len(args) >= 3 else kwargs.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def _with_fields(params: Any, fields: dict, batch: Optional[int]) -> Any:
    """sampling_params with the fields merged in; in a batch a list-valued field gives each
    prompt its own value (a list of another length is left for validation to refuse)."""
    per_item = {k: v for k, v in fields.items() if batch is not None and isinstance(v, list) and len(v) == batch}
    shared = {k: v for k, v in fields.items() if k not in per_item}
    if not per_item:
        if isinstance(params, list):
            return [{**p, **shared} for p in params]
        return {**(params or {}), **shared}
    items = params if isinstance(params, list) else [params or {}] * batch
    if len(items) != batch:
        return params  # validation refuses a sampling_params list of the wrong length
    return [{**p, **shared, **{k: v[i] for k, v in per_item.items() if v[i] is not None}}
            for i, p in enumerate(items)]


def engine_generate_around(original: Callable, engine: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Engine.generate / Engine.async_generate: accept the sglang-rl fields as kwargs
    (merged into sampling_params, whether that was passed by position or by name)."""
    fields = {name: kwargs.pop(name) for name in ALL_FIELDS if name in kwargs}
    if fields:
        batch = _engine_batch_size(args, kwargs)
        if len(args) >= 2:
            args = (args[0], _with_fields(args[1], fields, batch), *args[2:])
        else:
            kwargs["sampling_params"] = _with_fields(kwargs.get("sampling_params"), fields, batch)
    return original(engine, *args, **kwargs)
