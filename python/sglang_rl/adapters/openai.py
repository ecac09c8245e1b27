"""OpenAI-protocol adapter: the sglang-rl fields on /v1/chat/completions and /v1/completions.

Requests: the request models gain the fields (typed loosely so that our own validation, not
pydantic, words the 400). Responses: sglang builds its pydantic response; we add our fields to
`choices[i].message` (chat), `choices[i]` (completions) and the final streamed chunk of each
choice (its `delta` for chat), leaving every other byte as upstream produced it.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Optional

from fastapi.responses import ORJSONResponse
from pydantic import create_model, field_validator

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

from sglang_rl.adapters.api import RESPONSE_FIELDS, results_of
from sglang_rl.request_options import (
    ALL_FIELDS,
    CUSTOM_PARAMS_KEY,
    HIDDEN_STATES_FIELDS,
    RESPONSE_START_KEY,
)


# The sglang-rl request fields shared by the chat and completions request models (typed loosely
# so that our own validation, not pydantic, words the 400).
_RLFields = create_model("_RLFields", **{name: (Optional[Any], None) for name in ALL_FIELDS})


class RLChatCompletionRequest(ChatCompletionRequest, _RLFields):
    """ChatCompletionRequest plus the sglang-rl request fields."""


class RLCompletionRequest(CompletionRequest, _RLFields):
    """CompletionRequest plus the sglang-rl request fields; max_tokens=0 (a prefill-only request,
    as the verification protocol needs) is accepted like on /generate and chat."""

    @field_validator("max_tokens")
    @classmethod
    def validate_max_tokens_positive(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v < 0:
            raise ValueError("max_tokens must not be negative")
        return v


def _is_chat_verification(request: Any) -> bool:
    return (
        getattr(request, "toploc_verification_fingerprint_to_validate", None) is not None
        and bool(request.messages)
        and _role(request.messages[-1]) == "assistant"
        and isinstance(_content(request.messages[-1]), str)
    )


def _role(message: Any) -> Optional[str]:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else getattr(message, "content", None)


def chat_convert_before(serving: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE serving_chat._convert_to_internal_request: a verification request that ends with
    the assistant's reply continues that message (no end-of-turn appended), so the prefill is
    exactly prompt + generation prompt + reply."""
    if _is_chat_verification(request):
        request.continue_final_message = True


def chat_convert_after(result: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER serving_chat._convert_to_internal_request: copy the fields; for verification, record
    where the reply starts inside the prefill (prompt length before the reply's tokens)."""
    adapted, _ = result
    _copy_fields(request, adapted)
    if _is_chat_verification(request) and isinstance(adapted.input_ids, list):
        reply = serving._append_assistant_prefix_to_prompt_ids([], _content(request.messages[-1]))
        _set_internal(adapted, RESPONSE_START_KEY, len(adapted.input_ids) - len(reply))
    return result


def completion_convert_after(result: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER serving_completions._convert_to_internal_request: copy the fields."""
    _copy_fields(request, result[0])
    return result


def _copy_fields(request: Any, adapted: Any) -> None:
    for name in ALL_FIELDS:
        value = getattr(request, name, None)
        if value is not None:
            setattr(adapted, name, value)
    if any(getattr(request, name, None) is not None for name in HIDDEN_STATES_FIELDS):
        # our fields take over hidden states: upstream's OpenAI post-processing must not run
        request.return_hidden_states = False


def _set_internal(adapted: Any, key: str, value: Any) -> None:
    params = adapted.sampling_params
    for p in params if isinstance(params, list) else [params]:
        custom = dict(p.get("custom_params") or {})
        entry = dict(custom.get(CUSTOM_PARAMS_KEY) or {})
        entry[key] = value
        custom[CUSTOM_PARAMS_KEY] = entry
        p["custom_params"] = custom


def _with_fields(response: Any, ret: list, chat: bool) -> Any:
    if not isinstance(ret, list) or not hasattr(response, "model_dump"):
        return response
    extras = [{k: item["meta_info"][k] for k in RESPONSE_FIELDS if k in item.get("meta_info", {})} for item in ret]
    if not any(extras):
        return response
    body = response.model_dump(mode="json")
    for choice in body.get("choices", []):
        i = choice.get("index", 0)
        if i < len(extras) and extras[i]:
            (choice["message"] if chat else choice).update(extras[i])
    return ORJSONResponse(content=body)


def chat_response_after(response: Any, serving: Any, request: Any, ret: list, *args: Any, **kwargs: Any) -> Any:
    """AFTER serving_chat._build_chat_response: add the fields to choices[i].message."""
    return _with_fields(response, ret, chat=True)


def completion_response_after(response: Any, serving: Any, request: Any, ret: list, *args: Any, **kwargs: Any) -> Any:
    """AFTER serving_completions._build_completion_response: add the fields to choices[i]."""
    return _with_fields(response, ret, chat=False)


def _inject(chunk: str, adapted: Any, chat: bool, sent: set) -> str:
    if not chunk.startswith("data: {"):
        return chunk
    results = results_of(adapted)
    if not results:
        return chunk
    body = json.loads(chunk[len("data: "):])
    changed = False
    for choice in body.get("choices", []):
        i = choice.get("index", 0)
        if choice.get("finish_reason") is None or i in sent or not results.get(i):
            continue
        target = choice.setdefault("delta", {}) if chat else choice
        target.update(results[i])
        sent.add(i)
        changed = True
    return f"data: {json.dumps(body)}\n\n" if changed else chunk


def _stream_around(chat: bool) -> Callable:
    def around(original: Callable, serving: Any, adapted: Any, request: Any, raw_request: Any) -> AsyncIterator:
        async def run():
            sent: set = set()
            async for chunk in original(serving, adapted, request, raw_request):
                yield _inject(chunk, adapted, chat, sent) if isinstance(chunk, str) else chunk

        return run()

    around.__doc__ = (
        "AROUND the streaming generator: put the fields on the chunk that carries each choice's "
        "finish_reason" + (" (in its delta)." if chat else ".")
    )
    return around


chat_stream_around = _stream_around(chat=True)
completion_stream_around = _stream_around(chat=False)
