"""API-process adapter: request fields in, per-request results out, for every entry point.

`/generate`, `sgl.Engine` and the OpenAI endpoints all call `TokenizerManager.generate_request`;
wrapping it gives one place to validate the sglang-rl fields (a bad value raises ValueError, which
every caller turns into a 400) and move them into custom_params (`adapters/request_plan.py`), and
to turn the scheduler's payload into response fields of `meta_info` (here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator, Callable, Optional

from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_rl.adapters import hidden_states_api as hs_adapter
from sglang_rl.adapters import rollout_records, toploc_metrics, transport
from sglang_rl.adapters.kcbs_manager import CANDIDATES_FIELD
from sglang_rl.adapters.request_plan import implicit_prompt_ids, item_plan, prepare_request
from sglang_rl.fingerprint.sampling import DEFAULT_MAX_Z
from sglang_rl.request_options import (
    ALL_FIELDS,
    FINGERPRINTS_FIELD,
    KCBS_STREAM_ERROR,
    RESULT_FIELD,
    InvalidFingerprintError,
    RequestOptionError,
)
from sglang_rl.verification_report import finalize_report

# Mark set on the request object by this adapter (never user input).
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


def _finish_meta(out: dict, obj: Any, position: int) -> None:
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        return
    plan = item_plan(obj, position)
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
            seeded=plan.seeded_claim if plan is not None else None,
        ))
    if plan is not None and plan.implicit_logprobs:
        for key in [k for k in meta if "logprobs" in k]:
            meta.pop(key)
    if options.get("return_input_ids") and "prompt_token_ids" in out:
        meta["input_ids"] = out["prompt_token_ids"]
    if implicit_prompt_ids(obj):
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


def _checks_seeded(obj: Any, position: int) -> bool:
    """Whether finishing this output runs the seeded check (noise over the vocabulary per token)."""
    plan = item_plan(obj, position)
    return plan is not None and plan.seeded_claim is not None


def results_of(obj: Any) -> dict:
    """Response fields recorded per choice index for a request (read by the streaming adapter)."""
    return obj.__dict__.get(_RESULTS, {})


def generate_request_around(original: Callable, manager: Any, obj: Any, request: Any = None) -> AsyncIterator:
    """AROUND TokenizerManager.generate_request (an async generator)."""

    async def run():
        started = time.perf_counter()
        try:
            prepare_request(obj, manager.server_args, in_process=request is None,
                            vocab_size=getattr(getattr(manager, "model_config", None), "vocab_size", None))
        except InvalidFingerprintError:
            toploc_metrics.count_invalid_fingerprint(manager)
            raise
        async for out in original(manager, obj, request):
            encoding = []
            for position, item in enumerate(out if isinstance(out, list) else [out]):
                if not isinstance(item, dict):
                    continue
                position = item.get("index", position)
                if _encodes_rows(item) or _checks_seeded(obj, position):
                    encoding.append((item, position))
                else:
                    _finish_meta(item, obj, position)
            if encoding:
                # base64 of megabytes of rows, in worker threads (reading the row files and the
                # SIMD encoder both release the GIL): the outputs of a batch request, which arrive
                # together, encode in parallel, and the event loop keeps serving other requests
                # (the seeded check's vocabulary-wide noise runs there too, in torch without the GIL)
                await asyncio.gather(*(asyncio.to_thread(_finish_meta, item, obj, position)
                                       for item, position in encoding))
            for item in out if isinstance(out, list) else [out]:
                if isinstance(item, dict):
                    rollout_records.record(manager, item)
                    toploc_metrics.observe_output(manager, item, started)
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
