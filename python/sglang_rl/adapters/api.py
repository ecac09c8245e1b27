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
from sglang_rl.adapters import speculative
from sglang_rl.adapters.kcbs import CANDIDATES_FIELD
from sglang_rl.adapters import transport
from sglang_rl.adapters.toploc import FINGERPRINTS_FIELD, RESULT_FIELD
from sglang_rl.fingerprint import FingerprintError, decode_fingerprint
from sglang_rl.hidden_states import HiddenStatesOptions
from sglang_rl.request_options import (
    ALL_FIELDS,
    HIDDEN_STATES_FIELDS,
    KCBS_FIELDS,
    KCBS_STREAM_ERROR,
    CUSTOM_PARAMS_KEY,
    RESPONSE_START_KEY,
    RequestOptionError,
    pop_fields,
    validate_fields,
    validate_kcbs,
)
from sglang_rl.verification_report import finalize_report

# Marks set on the request object by this adapter (never user input).
_IMPLICIT_LOGPROBS = "_sglang_rl_implicit_logprobs"
_RESULTS = "_sglang_rl_results"

# Response fields this plugin adds to meta_info (and to OpenAI choices).
RESPONSE_FIELDS = (
    FINGERPRINTS_FIELD, RESULT_FIELD, "input_ids", "output_ids",
    hs_adapter.ROWS_FIELD, hs_adapter.POSITIONS_FIELD, CANDIDATES_FIELD,
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
    if getattr(obj, "kcbs_enabled", None) is True:
        return True
    params = obj.sampling_params
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict) and p.get("kcbs_enabled") is True:
            return True
    return False


def _sampling_dicts(obj: Any) -> list[dict]:
    params = obj.sampling_params
    if params is None:
        obj.sampling_params = params = {}
    return params if isinstance(params, list) else [params]


def _prompt_len(obj: Any) -> Optional[int]:
    ids = obj.input_ids
    if isinstance(ids, list) and ids and isinstance(ids[0], int):
        return len(ids)
    return None


def _hidden_states_entry(obj: Any, fields: dict, server_args: Any, in_process: bool) -> dict:
    """Validate the hidden-state fields; a request that uses them leaves upstream's path."""
    hs_fields = {k: fields.pop(k) for k in HIDDEN_STATES_FIELDS if k in fields}
    if not hs_fields:
        return {}
    requested = obj.return_hidden_states
    if isinstance(requested, list):
        requested = requested[0] if requested else False
    opts = HiddenStatesOptions.from_request(requested, **hs_fields, allow_tensor_format=in_process)
    if not opts.enabled:
        return {}
    allowed = getattr(server_args, "return_hidden_states_mode", None)
    if allowed is None or (opts.mode.value == "full" and allowed != "full"):
        raise RequestOptionError(
            f"return_hidden_states={requested!r} needs a server started with "
            "--enable-return-hidden-states (or --return-hidden-states-mode full)"
        )
    speculative.check_rows_supported(getattr(server_args, "speculative_algorithm", None))
    obj.return_hidden_states = False
    return hs_adapter.options_to_entry(opts)


def prepare_request(obj: Any, server_args: Any, in_process: bool = False) -> None:
    """Validate the sglang-rl fields of one GenerateReqInput and move them into custom_params."""
    if not isinstance(obj, GenerateReqInput):
        return
    fields: dict = {}
    for name in ALL_FIELDS:
        value = getattr(obj, name, None)
        if value is not None:
            fields[name] = value
            setattr(obj, name, None)
    dicts = _sampling_dicts(obj)
    for params in dicts:
        fields.update(pop_fields(params))
    internal = {}
    for params in dicts:
        entry = (params.get("custom_params") or {}).get(CUSTOM_PARAMS_KEY) or {}
        internal.update({k: v for k, v in entry.items() if k == RESPONSE_START_KEY})
    hs_entry = _hidden_states_entry(obj, fields, server_args, in_process)
    kcbs_fields = {k: fields.pop(k) for k in KCBS_FIELDS if k in fields}
    kcbs_entry = validate_kcbs(kcbs_fields, dicts[0], bool(obj.stream), server_args)
    entry = validate_fields(fields, server_args)
    entry.update(hs_entry)
    if kcbs_entry:
        if "toploc_verification_fingerprint_to_validate" in entry:
            raise RequestOptionError("a k-CBS request cannot also be a verification request")
        _prepare_kcbs(obj, kcbs_entry)
        entry.update(kcbs_entry)
    if "toploc_verification_fingerprint_to_validate" in entry:
        _prepare_verification(obj, entry, internal, server_args)
    if entry.get("return_input_ids"):
        obj.return_prompt_token_ids = True
    if not entry and not internal:
        return
    entry.update(internal)
    for params in dicts:
        custom = dict(params.get("custom_params") or {})
        custom[CUSTOM_PARAMS_KEY] = entry
        params["custom_params"] = custom


def _prepare_verification(obj: Any, entry: dict, internal: dict, server_args: Any) -> None:
    """A verification request is one prefill; ask sglang for the log-probs of its response span."""
    try:
        fp = decode_fingerprint(
            entry["toploc_verification_fingerprint_to_validate"],
            expected_topk=server_args.toploc_verification_topk,
        )
    except FingerprintError as exc:
        raise RequestOptionError(f"invalid toploc_verification_fingerprint_to_validate: {exc}") from exc
    for params in _sampling_dicts(obj):
        if params.get("max_new_tokens") not in (0,):
            raise RequestOptionError(
                "a verification request must be prefill-only: set max_tokens=0 (max_new_tokens=0)"
            )
        params["temperature"] = 1.0
    start = internal.get(RESPONSE_START_KEY)
    prompt_len = _prompt_len(obj)
    if start is not None and prompt_len is not None and prompt_len - start not in (fp.n_rows, fp.n_rows - 1):
        raise RequestOptionError(
            f"the reply re-tokenizes to {prompt_len - start} tokens but the fingerprint covers "
            f"{fp.n_rows} generated tokens, so its rows cannot be aligned; verify with the exact-token "
            "form (input_ids + output_ids, from return_input_ids / return_output_ids)"
        )
    if start is None and prompt_len is not None:
        if prompt_len < fp.n_rows + 1:
            raise RequestOptionError(
                f"the fingerprint covers {fp.n_rows} response tokens but the prompt has only "
                f"{prompt_len} tokens: send input_ids + output_ids"
            )
        start = prompt_len - fp.n_rows
        internal[RESPONSE_START_KEY] = start
    setattr(obj, _IMPLICIT_LOGPROBS, not obj.return_logprob)
    obj.return_logprob = True
    obj.logprob_start_len = max(start - 1, 0) if start is not None else 0
    obj.top_logprobs_num = max(obj.top_logprobs_num or 0, 1)


def _prepare_kcbs(obj: Any, entry: dict) -> None:
    """k-CBS runs on the model's log-probs at temperature 1 without sampling filters; the request
    itself is one prefill (its beams are scheduled by the k-CBS adapter)."""
    for params in _sampling_dicts(obj):
        params.update(max_new_tokens=0, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
    setattr(obj, _IMPLICIT_LOGPROBS, not obj.return_logprob)
    obj.return_logprob = True
    obj.logprob_start_len = -1
    obj.top_logprobs_num = max(obj.top_logprobs_num or 0, entry["kcbs_k"])


def _finish_meta(out: dict, obj: Any) -> None:
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        return
    payload = transport.collect(meta)
    if FINGERPRINTS_FIELD in payload:
        meta[FINGERPRINTS_FIELD] = payload[FINGERPRINTS_FIELD]
    if hs_adapter.PAYLOAD_KEY in payload:
        meta.update(hs_adapter.deliver(payload[hs_adapter.PAYLOAD_KEY]))
    if CANDIDATES_FIELD in payload:
        meta[CANDIDATES_FIELD] = payload[CANDIDATES_FIELD]
    if RESULT_FIELD in payload:
        report = finalize_report(payload[RESULT_FIELD], meta, _expect_greedy(obj))
        meta[RESULT_FIELD] = json.dumps(report)
    if getattr(obj, _IMPLICIT_LOGPROBS, False) and (
        RESULT_FIELD in payload or CANDIDATES_FIELD in payload or "kcbs_k" in _options(obj)
    ):
        for key in [k for k in meta if "logprobs" in k]:
            meta.pop(key)
    options = _options(obj)
    if options.get("return_input_ids") and "prompt_token_ids" in out:
        meta["input_ids"] = out["prompt_token_ids"]
    if options.get("return_output_ids") and "output_ids" in out:
        meta["output_ids"] = list(out["output_ids"])
    fields = {k: meta[k] for k in RESPONSE_FIELDS if k in meta}
    if fields:
        obj.__dict__.setdefault(_RESULTS, {})[out.get("index", 0)] = fields


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


def _options(obj: Any) -> dict:
    params = obj.sampling_params
    first = params[0] if isinstance(params, list) and params else params
    if not isinstance(first, dict):
        return {}
    return (first.get("custom_params") or {}).get(CUSTOM_PARAMS_KEY) or {}


def _expect_greedy(obj: Any) -> bool:
    return bool(_options(obj).get("toploc_verification_expect_greedy"))


def generate_request_around(original: Callable, manager: Any, obj: Any, request: Any = None) -> AsyncIterator:
    """AROUND TokenizerManager.generate_request (an async generator)."""

    async def run():
        prepare_request(obj, manager.server_args, in_process=request is None)
        async for out in original(manager, obj, request):
            encoding = []
            for item in out if isinstance(out, list) else [out]:
                if not isinstance(item, dict):
                    continue
                if _encodes_rows(item):
                    encoding.append(item)
                else:
                    _finish_meta(item, obj)
            if encoding:
                # base64 of megabytes of rows, in worker threads (reading the row files and the
                # SIMD encoder both release the GIL): the outputs of a batch request, which arrive
                # together, encode in parallel, and the event loop keeps serving other requests
                await asyncio.gather(*(asyncio.to_thread(_finish_meta, item, obj) for item in encoding))
            yield out

    return run()


def _with_fields(params: Any, fields: dict) -> Any:
    if isinstance(params, list):
        return [{**p, **fields} for p in params]
    return {**(params or {}), **fields}


def engine_generate_around(original: Callable, engine: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Engine.generate / Engine.async_generate: accept the sglang-rl fields as kwargs
    (merged into sampling_params, whether that was passed by position or by name)."""
    fields = {name: kwargs.pop(name) for name in ALL_FIELDS if name in kwargs}
    if fields:
        if len(args) >= 2:
            args = (args[0], _with_fields(args[1], fields), *args[2:])
        else:
            kwargs["sampling_params"] = _with_fields(kwargs.get("sampling_params"), fields)
    return original(engine, *args, **kwargs)
