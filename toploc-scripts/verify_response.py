#!/usr/bin/env python
"""Verify a saved, fingerprinted response against a verifier server.

    python toploc-scripts/verify_response.py response.json --server http://verifier:30000
    python toploc-scripts/verify_response.py chat.json --messages request.json --form chat --server ...

The response file is what a server started with --toploc-verification returned: an OpenAI chat
completion, an OpenAI text completion, or a /generate response. With input_ids and output_ids in
it (requested with return_input_ids / return_output_ids) the exact-token form is used; a chat
completion without them can be checked in the chat form if you pass the original messages
(--messages: a JSON list of messages, or the original request body). The verifier must run the
same model with --toploc-verification and the same --toploc-verification-topk.

Prints the result of each verification request; exits 0 only if every one verified, 1 if any
failed, 2 on a usage or connection problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

try:
    import sglang_rl_client  # noqa: F401
except ImportError:  # a checkout without the client installed: its client/ folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from sglang_rl_client import responses as tc  # noqa: E402


def _load_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise tc.ClientError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise tc.ClientError(f"the {what} file {path} is not JSON: {exc}") from None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Verify a saved TOPLOC-fingerprinted response against a verifier server."
    )
    parser.add_argument("response", type=Path, help="saved response JSON file")
    parser.add_argument("--server", required=True, help="verifier base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--messages", type=Path,
                        help="JSON file with the original chat messages (list, or request body)")
    parser.add_argument("--form", choices=["auto", "token", "chat", "both"], default="auto",
                        help="request form (auto: token form if the ids are present, else chat)")
    parser.add_argument("--token-endpoint", choices=["completions", "generate"], default="completions",
                        help="where the token form goes: /v1/completions (default) or /generate")
    parser.add_argument("--choice", type=int, default=0,
                        help="which choice (or /generate batch item) to verify (default 0)")
    parser.add_argument("--served-model-name", help="model name for the OpenAI endpoints (default: from the "
                        "response, else the verifier's /v1/models)")
    parser.add_argument("--expect-greedy", action="store_true",
                        help="also require every response token to be the model's argmax "
                        "(for temperature-0 generations)")
    parser.add_argument("--expect-sampled", action="store_true",
                        help="also require the sampling test to pass (for generations sampled at "
                        "temperature 1 without top-k/top-p/min-p)")
    parser.add_argument("--timeout", type=float, default=600, help="HTTP timeout in seconds")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (the verifier's --api-key)")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON only")
    args = parser.parse_args(argv)
    url = args.server.rstrip("/")

    try:
        gen = tc.parse_generation(_load_json(args.response, "response"), args.choice)
        messages = tc.load_messages(_load_json(args.messages, "messages")) if args.messages else None
        model = args.served_model_name or gen.model
        if model is None and gen.kind != "generate":
            model = tc.served_model(url, api_key=args.api_key)
        endpoint = tc.GENERATE_ENDPOINT if args.token_endpoint == "generate" else tc.COMPLETIONS_ENDPOINT
        requests = tc.requests_for(gen, messages=messages, form=args.form, token_endpoint=endpoint,
                                   model=model, expect_greedy=args.expect_greedy,
                                   expect_sampled=args.expect_sampled)
    except tc.ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if not args.json:
        print(f"response: {gen.kind}, fingerprint {tc.fingerprint_info(gen.fingerprint).describe()}")
        if any(r.form == "chat" for r in requests) and (
            gen.extra.get("has_reasoning") or gen.extra.get("has_tool_calls")
        ):
            print("warning: the reply has reasoning or tool calls that message.content does not "
                  "hold; the chat form will likely fail, use the token form")

    ok = True
    results = []
    for request in requests:
        try:
            result = tc.verify(url, request, timeout=args.timeout, api_key=args.api_key)
        except tc.ClientError as exc:
            print(f"error ({request.describe()}): {exc}", file=sys.stderr)
            return 2
        results.append({"form": request.form, "endpoint": request.endpoint, "result": result})
        ok = ok and bool(result.get("verified"))
        if not args.json:
            print(f"\n== {request.describe()}")
            print(tc.summarize(result))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print("\nVERIFIED" if ok else "\nNOT VERIFIED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
