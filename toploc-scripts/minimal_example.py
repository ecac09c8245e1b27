#!/usr/bin/env python
"""TOPLOC end to end: generate a fingerprinted chat reply, then verify it in both request forms.

    # against a server you started with --toploc-verification
    python toploc-scripts/minimal_example.py --server http://127.0.0.1:30000

    # start one for the duration of the script (CPU, default model; `make demo` runs this)
    python toploc-scripts/minimal_example.py --start-server

    # on a GPU machine, with your own model
    python toploc-scripts/minimal_example.py --start-server --gpu --model-path Qwen/Qwen2.5-7B-Instruct

Steps: one chat request through the openai client (temperature 0, seed 42, asking for the token
ids), print the reply and its fingerprint, then send two verification requests to the same
server: the chat form (messages + assistant reply) and the exact-token form (input_ids +
output_ids as a token prompt to /v1/completions). Prints PASS (exit 0) only if both verify.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

try:
    import sglang_rl_client  # noqa: F401
except ImportError:  # a checkout without the client installed: its client/ folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from sglang_rl_client import responses as tc  # noqa: E402

PROMPT = "What is the capital of Bulgaria? Answer in one sentence."
CPU_FLAGS = [
    "--device", "cpu", "--attention-backend", "torch_native",
    "--max-total-tokens", "16384", "--dtype", "float32",
]


# --------------------------------------------------------------------------------------------
# optional local server
# --------------------------------------------------------------------------------------------


class LocalServer:
    """`python -m sglang.launch_server ... --toploc-verification` in its own process group."""

    def __init__(self, model_path: str, port: int, gpu: bool, extra: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--toploc-verification",
            *([] if gpu else CPU_FLAGS),
            *extra,
        ]
        env = dict(os.environ)
        if not gpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        self.log = tempfile.NamedTemporaryFile(
            "w", prefix="sglang-rl-demo-server-", suffix=".log", delete=False
        )
        print(f"$ {shlex.join(cmd)}")
        print(f"  (server log: {self.log.name})", flush=True)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def log_tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health_generate (a real one-token generation) until it answers 200."""
        start = time.time()
        next_note = start + 30
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.proc.returncode}; end of its log:\n"
                    + self.log_tail()
                )
            if _answers_200(self.url + "/health_generate"):
                print(f"server healthy after {time.time() - start:.0f} s", flush=True)
                return
            if time.time() > next_note:
                print(f"  ... waiting for the server ({time.time() - start:.0f} s)", flush=True)
                next_note += 30
            time.sleep(2)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self.log.close()


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model_path() -> str:
    """The plugin's default model (SmolLM2-135M-Instruct, built offline on first use)."""
    out = subprocess.run(
        [sys.executable, "-m", "sglang_rl.default_model"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError("could not build the default model:\n" + out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


# --------------------------------------------------------------------------------------------
# the example itself
# --------------------------------------------------------------------------------------------


def show_result(request: tc.VerificationRequest, result: dict) -> bool:
    print(f"\n=== verification, {request.describe()}")
    print(tc.summarize(result))
    print("raw result:", json.dumps(result))
    return bool(result.get("verified"))


def run_example(base_url: str, prompt: str, max_tokens: int, save_dir: Optional[Path]) -> bool:
    import openai

    model = tc.served_model(base_url)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": prompt}]

    print(f"\n=== generation ({model})")
    print("user:", prompt)
    response = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        seed=42,
        max_tokens=max_tokens,
        extra_body={"return_input_ids": True, "return_output_ids": True},
    )
    dump = response.model_dump()
    gen = tc.parse_generation(dump)
    print("assistant:", gen.text)
    print(f"prompt tokens: {len(gen.input_ids or [])}, generated tokens: {len(gen.output_ids or [])}")
    print("fingerprint:", gen.fingerprint)
    print("  ", tc.fingerprint_info(gen.fingerprint).describe())

    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / "response.json").write_text(json.dumps(dump, indent=2))
        (save_dir / "messages.json").write_text(json.dumps(messages, indent=2))
        print(f"saved {save_dir / 'response.json'} and {save_dir / 'messages.json'}")

    ok = True
    for request in tc.requests_for(gen, messages=messages, form="both", model=model):
        try:
            result = tc.verify(base_url, request)
        except tc.ClientError as exc:
            print(f"\n=== verification, {request.describe()}\nrequest failed: {exc}")
            ok = False
            continue
        ok = show_result(request, result) and ok
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="base URL of a running server, e.g. http://127.0.0.1:30000")
    where.add_argument("--start-server", action="store_true",
                       help="start a server with --toploc-verification for this run")
    parser.add_argument("--model-path", help="model for --start-server (default: the plugin's "
                        "default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--port", type=int, help="port for --start-server (default: a free one)")
    parser.add_argument("--gpu", action="store_true",
                        help="with --start-server: leave out the CPU flags and SGLANG_USE_CPU_ENGINE")
    parser.add_argument("--server-args", default="",
                        help="extra flags for --start-server, one quoted string")
    parser.add_argument("--startup-timeout", type=float, default=900,
                        help="seconds to wait for the started server (default 900)")
    parser.add_argument("--prompt", default=PROMPT, help="the user message to send")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply length cap (default 32)")
    parser.add_argument("--save-dir", type=Path,
                        help="also save response.json and messages.json there (for verify_response.py)")
    args = parser.parse_args(argv)

    server: Optional[LocalServer] = None
    try:
        if args.start_server:
            model_path = args.model_path or default_model_path()
            server = LocalServer(model_path, args.port or free_port(), args.gpu,
                                 shlex.split(args.server_args))
            server.wait_healthy(args.startup_timeout)
            base_url = server.url
        else:
            base_url = args.server.rstrip("/")
        ok = run_example(base_url, args.prompt, args.max_tokens, args.save_dir)
    except KeyboardInterrupt:
        ok = False
    except Exception as exc:  # report any failure (server start, openai, HTTP) as FAIL
        print(f"\nerror: {type(exc).__name__}: {exc}")
        ok = False
    finally:
        if server is not None:
            server.stop()
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
