"""Saved generation responses and the verification requests for them (both request forms).

A generation response carries ``toploc_verification_fingerprints`` (a list; the last element is
the fingerprint to check). Verifying it means sending a prefill-only request (max_tokens=0) that
contains the prompt *and* the response, with ``toploc_verification_fingerprint_to_validate`` set,
to a server running the same model with --toploc-verification. Two request forms exist:

* token form (exact): the prompt is ``input_ids + output_ids``, sent as token ids to /generate or
  /v1/completions; the server treats the last n tokens as the response (n is read from the
  fingerprint's header).
* chat form: the original messages plus one assistant message holding the reply text, sent to
  /v1/chat/completions; the server continues that assistant message and locates the reply
  inside the prefill. The reply text is tokenised again, so this form can fail where the token
  form passes.

Used by the scripts in the sglang-rl repository's toploc-scripts/ (one response at a time, either
form); ``sglang_rl_client.verifier`` verifies many responses in the token form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_rl_client.fingerprint import Fingerprint, FingerprintError, decode_fingerprint
from sglang_rl_client.transport import ServerError, Transport
from sglang_rl_client.verifier import (
    EXPECT_GREEDY,
    EXPECT_SAMPLED,
    FINGERPRINT_TO_VALIDATE,
    FINGERPRINTS_FIELD,
    GENERATE_ENDPOINT,
    RESULT_FIELD,
)

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


class ClientError(Exception):
    """Something the caller has to fix: a response without the needed fields, a bad reply..."""


def fingerprint_info(fingerprint: str) -> Fingerprint:
    """The decoded fingerprint (``describe()`` says what it covers); ClientError if it is not one."""
    try:
        return decode_fingerprint(fingerprint)
    except FingerprintError as exc:
        raise ClientError(f"the fingerprint is malformed: {exc}") from None


# --------------------------------------------------------------------------------------------
# reading a saved generation response
# --------------------------------------------------------------------------------------------


@dataclass
class Generation:
    """The parts of one generated choice that verification needs."""

    kind: str  # "chat", "completion" or "generate"
    fingerprint: str
    input_ids: Optional[list[int]] = None
    output_ids: Optional[list[int]] = None
    text: Optional[str] = None  # the reply text (chat: message.content)
    model: Optional[str] = None
    extra: dict = field(default_factory=dict)

    @property
    def has_ids(self) -> bool:
        return bool(self.input_ids) and bool(self.output_ids)


def _last_fingerprint(holder: dict, where: str) -> str:
    fps = holder.get(FINGERPRINTS_FIELD)
    if not fps or not isinstance(fps, list) or not isinstance(fps[-1], str):
        raise ClientError(
            f"no {FINGERPRINTS_FIELD} in {where}: was the server started with --toploc-verification?"
        )
    return fps[-1]


def _int_list(value: Any) -> Optional[list[int]]:
    if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return list(value)
    return None


def parse_generation(response: Any, choice: int = 0) -> Generation:
    """Find the fingerprint, token ids and reply text of one choice in a saved response.

    Accepts an OpenAI chat completion, an OpenAI text completion (both as returned by the server
    or by the openai client's model_dump()), or a /generate response (a dict, or a list of them
    for a batch: `choice` then picks the element).
    """
    if isinstance(response, list):
        if not 0 <= choice < len(response):
            raise ClientError(f"the response list has {len(response)} items, no item {choice}")
        response, choice = response[choice], 0
    if not isinstance(response, dict):
        raise ClientError("the response must be a JSON object (or a list of /generate objects)")

    if "meta_info" in response:  # /generate
        meta = response["meta_info"]
        input_ids = _int_list(meta.get("input_ids")) or _int_list(response.get("prompt_token_ids"))
        output_ids = _int_list(meta.get("output_ids")) or _int_list(response.get("output_ids"))
        return Generation(
            kind="generate",
            fingerprint=_last_fingerprint(meta, "meta_info"),
            input_ids=input_ids,
            output_ids=output_ids,
            text=response.get("text"),
        )

    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ClientError("the response has neither meta_info (/generate) nor choices (OpenAI)")
    picked = next((c for c in choices if c.get("index", 0) == choice), None)
    if picked is None:
        raise ClientError(f"the response has no choice with index {choice}")
    chat = isinstance(picked.get("message"), dict)
    # a chat completion keeps its fields in the choice's message, a text completion in the choice
    holder, where = (picked["message"], f"choices[{choice}].message") if chat else (picked, f"choices[{choice}]")
    extra = {"finish_reason": picked.get("finish_reason"),
             "has_reasoning": bool(holder.get("reasoning_content")),
             "has_tool_calls": bool(holder.get("tool_calls"))} if chat else {}
    return Generation(
        kind="chat" if chat else "completion",
        fingerprint=_last_fingerprint(holder, where),
        input_ids=_int_list(holder.get("input_ids")),
        output_ids=_int_list(holder.get("output_ids")),
        text=holder.get("content" if chat else "text"),
        model=response.get("model"),
        extra=extra,
    )


def load_messages(value: Any) -> list[dict]:
    """Messages from a JSON value: a list of messages, or a request body with "messages"."""
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise ClientError("expected a list of chat messages (or an object with a 'messages' list)")
    if value and value[-1].get("role") == "assistant":
        raise ClientError(
            "the messages end with an assistant message: give the messages of the original request, "
            "without the reply"
        )
    return value


# --------------------------------------------------------------------------------------------
# building verification requests
# --------------------------------------------------------------------------------------------


@dataclass
class VerificationRequest:
    """A verification request: where to POST it and the JSON body."""

    form: str  # "token" or "chat"
    endpoint: str
    body: dict

    def describe(self) -> str:
        return f"{self.form} form, POST {self.endpoint}"


def token_request(
    input_ids: list[int],
    output_ids: list[int],
    fingerprint: str,
    *,
    endpoint: str = COMPLETIONS_ENDPOINT,
    model: str = "default",
    expect_greedy: bool = False,
    expect_sampled: bool = False,
) -> VerificationRequest:
    """Exact-token form: prefill input_ids + output_ids; the last n tokens are the response."""
    info = fingerprint_info(fingerprint)
    if info.n_rows != len(output_ids):
        raise ClientError(
            f"the fingerprint covers {info.n_rows} tokens but output_ids has {len(output_ids)}"
        )
    ids = list(input_ids) + list(output_ids)
    if endpoint == GENERATE_ENDPOINT:
        body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}
    elif endpoint == COMPLETIONS_ENDPOINT:
        body = {"model": model, "prompt": ids, "max_tokens": 0}
    else:
        raise ClientError(f"the token form goes to {GENERATE_ENDPOINT} or {COMPLETIONS_ENDPOINT}")
    body[FINGERPRINT_TO_VALIDATE] = fingerprint
    _expect(body, expect_greedy, expect_sampled)
    return VerificationRequest("token", endpoint, body)


def _expect(body: dict, greedy: bool, sampled: bool) -> None:
    """How the response was decoded, when the verdict should also check it: greedily (every token
    the argmax) or sampled at temperature 1 (the sampling test)."""
    if greedy and sampled:
        raise ClientError("a response is either greedy or sampled: give one of the two expectations")
    if greedy:
        body[EXPECT_GREEDY] = True
    if sampled:
        body[EXPECT_SAMPLED] = True


def chat_request(
    messages: list[dict],
    reply: str,
    fingerprint: str,
    *,
    model: str = "default",
    expect_greedy: bool = False,
    expect_sampled: bool = False,
) -> VerificationRequest:
    """Chat form: the original messages plus the assistant reply, prefill only."""
    fingerprint_info(fingerprint)
    if not isinstance(reply, str):
        raise ClientError("the chat form needs the reply as text (message.content was empty)")
    body = {
        "model": model,
        "messages": list(messages) + [{"role": "assistant", "content": reply}],
        "max_tokens": 0,
        FINGERPRINT_TO_VALIDATE: fingerprint,
    }
    _expect(body, expect_greedy, expect_sampled)
    return VerificationRequest("chat", CHAT_ENDPOINT, body)


def requests_for(
    gen: Generation,
    *,
    messages: Optional[list[dict]] = None,
    form: str = "auto",
    token_endpoint: str = COMPLETIONS_ENDPOINT,
    model: Optional[str] = None,
    expect_greedy: bool = False,
    expect_sampled: bool = False,
) -> list[VerificationRequest]:
    """The verification request(s) for a generation.

    form: "token", "chat", "both", or "auto" (token when input_ids and output_ids are known,
    else chat when the messages are known).
    """
    model = model or gen.model or "default"
    can_tokens = gen.has_ids
    can_chat = messages is not None and gen.kind == "chat"
    if form == "auto":
        form = "token" if can_tokens else "chat" if can_chat else "none"
    wanted = ["chat", "token"] if form == "both" else [form]
    out = []
    for item in wanted:
        if item == "token":
            if not can_tokens:
                raise ClientError(
                    "the token form needs input_ids and output_ids: request them with "
                    "return_input_ids=true and return_output_ids=true"
                )
            out.append(token_request(gen.input_ids, gen.output_ids, gen.fingerprint,
                                     endpoint=token_endpoint, model=model,
                                     expect_greedy=expect_greedy, expect_sampled=expect_sampled))
        elif item == "chat":
            if gen.kind != "chat":
                raise ClientError("the chat form only applies to chat completion responses")
            if messages is None:
                raise ClientError("the chat form needs the original messages (--messages FILE)")
            out.append(chat_request(messages, gen.text, gen.fingerprint, model=model,
                                    expect_greedy=expect_greedy, expect_sampled=expect_sampled))
        else:
            raise ClientError(
                "cannot build a verification request: the response has no input_ids/output_ids "
                "and no messages were given"
            )
    return out


# --------------------------------------------------------------------------------------------
# sending and reading the result
# --------------------------------------------------------------------------------------------


def served_model(base_url: str, **transport: Any) -> str:
    """The first model id listed by /v1/models ("default" if the list is empty); ``transport``:
    the options of ``Transport`` (api_key, timeout, retries)."""
    try:
        data = Transport(base_url, **{"timeout": 30.0, **transport}).get("/v1/models").get("data") or []
    except ServerError as exc:
        raise ClientError(str(exc)) from None
    return data[0]["id"] if data else "default"


def result_of(endpoint: str, response: Any) -> dict:
    """The parsed validation result inside a verification response."""
    if endpoint == GENERATE_ENDPOINT:
        holder = (response[0] if isinstance(response, list) else response).get("meta_info", {})
    else:
        choice = (response.get("choices") or [{}])[0]
        holder = choice.get("message", {}) if endpoint == CHAT_ENDPOINT else choice
    raw = holder.get(RESULT_FIELD)
    if raw is None:
        raise ClientError(f"the verification response has no {RESULT_FIELD}")
    return json.loads(raw) if isinstance(raw, str) else raw


def verify(base_url: str, request: VerificationRequest, timeout: float = 600.0, **transport: Any) -> dict:
    """Send one verification request and return its parsed result (``transport``: api_key,
    retries, backoff of ``Transport``); ClientError when no result came."""
    try:
        response = Transport(base_url, timeout=timeout, **transport).post(request.endpoint, request.body)
    except ServerError as exc:
        raise ClientError(str(exc)) from None
    return result_of(request.endpoint, response)


def summarize(result: dict) -> str:
    """A few readable lines about a validation result."""
    if "error" in result:
        return f"verified: False\nerror: {result['error']}"
    limits = result.get("thresholds", {})
    lines = [
        f"verified: {result.get('verified')}  (fingerprint: {result.get('fingerprint_verified')})",
        *([f"verdict: {result['verdict']}" + "".join(f"\n  {r}" for r in result.get("verdict_reasons") or [])]
          if "verdict" in result else []),
        f"chunks: {result.get('num_chunks')}, response tokens: {result.get('response_tokens')} "
        f"starting at position {result.get('response_start')}",
        "worst chunk: exp_mismatches {} (max {}), mant_err_mean {:.3g} (max {}), "
        "mant_err_median {:.3g} (max {})".format(
            result.get("worst_exp_mismatches"), limits.get("max_exp_mismatches"),
            float(result.get("worst_mant_err_mean", 0.0)), limits.get("max_mant_err_mean"),
            float(result.get("worst_mant_err_median", 0.0)), limits.get("max_mant_err_median"),
        ),
    ]
    if "argmax_checked" in result:
        line = (f"greedy check: {result.get('argmax_matches')}/{result.get('argmax_checked')} "
                f"response tokens are the model's argmax")
        if "mean_response_logprob" in result:
            line += f", mean log-prob {result['mean_response_logprob']:.3f}"
        if result.get("expect_greedy"):
            line += " (required: expect_greedy)"
        lines.append(line)
    if result.get("ends_on_eos") and "eos_prob" in result:
        lines.append(f"ends on EOS token {result.get('response_last_token')} with probability "
                     f"{result['eos_prob']:.3g} (bound {result.get('min_eos_prob')})")
    if "sampling_z" in result:
        lines.append(f"sampling test (temperature 1): Z = {result['sampling_z']:.2f} over "
                     f"{result.get('sampling_checked')} tokens, bound |Z| <= {result.get('sampling_max_z')}: "
                     f"{'consistent' if result.get('sampling_consistent') else 'NOT consistent'}")
    return "\n".join(lines)
