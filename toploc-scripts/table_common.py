"""What the measurement scripts of this folder share: their command line and the /generate call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import sglang_rl_client  # noqa: F401
except ImportError:  # a checkout without the client installed: its client/ folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from sglang_rl_client.transport import Transport  # noqa: E402


def table_parser(doc: str, prompts: int, offset: int, max_tokens: int, temperatures: list[float],
                 model_help: str) -> argparse.ArgumentParser:
    """--server, --model-path, --prompts, --offset, --max-tokens and --temperatures."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--server", required=True, help="server URL")
    parser.add_argument("--model-path", required=True, help=model_help)
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--offset", type=int, default=offset, help="first GSM8K prompt")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperatures", type=float, nargs="+", default=temperatures)
    return parser


def post_generate(url: str, body: dict) -> dict:
    """POST /generate, the decoded answer (retries and one-line errors from the client package)."""
    return Transport(url, timeout=1800).post("/generate", body)
