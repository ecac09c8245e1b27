"""What the HTTP load scripts share (`make fuzz`, `make soak`): the server they start, honest
material to verify against, and malformed fingerprints that every server must refuse with a 4xx.

The server is the e2e suite's CPU server (test/e2e/e2e_servers.py: `--sleep-on-idle`,
OMP_NUM_THREADS=1, float32, torch_native attention) with TOPLOC and hidden states on.
"""

from __future__ import annotations

import base64
import random
import struct
import sys
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test" / "e2e"))

from e2e_servers import Server, start_server  # noqa: E402 - the e2e suite's CPU server launcher

FEATURE_FLAGS = ("--toploc-verification", "--enable-return-hidden-states")
FP_OUT = "toploc_verification_fingerprints"
FP_IN = "toploc_verification_fingerprint_to_validate"
RESULT = "toploc_verification_fingerprint_validation_result"
_HEADER = struct.Struct(">2sBBHI")  # magic, version, chunk size, topk, n_rows (docs/verification.md)


def start_feature_server(log_name: str, *extra: str) -> Server:
    """A CPU server of the default model with TOPLOC verification and hidden states on."""
    from sglang_rl.default_model import ensure_default_model

    return start_server(str(ensure_default_model()), *FEATURE_FLAGS, *extra, log_name=log_name)


def honest_sample(url: str, text: str = "The quick brown fox", max_new_tokens: int = 40) -> dict:
    """One greedy generation: {"ids": input_ids + output_ids, "fp": its fingerprint}."""
    resp = requests.post(url + "/generate", json={
        "text": text, "return_input_ids": True, "return_output_ids": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}},
        timeout=300)
    resp.raise_for_status()
    meta = resp.json()["meta_info"]
    return {"ids": meta["input_ids"] + meta["output_ids"], "fp": meta[FP_OUT][-1]}


def hostile_fingerprints(fp: str, rng: random.Random) -> dict[str, object]:
    """Malformed variants of an honest fingerprint, by name; each must be refused with a 4xx
    before the request is scheduled (docs/verification.md, "Hostile input")."""
    raw = base64.b64decode(fp)
    magic, version, chunk, topk, n_rows = _HEADER.unpack_from(raw)
    width = 2 + 2 * topk
    proofs = [raw[_HEADER.size + i:_HEADER.size + i + width] for i in range(0, len(raw) - _HEADER.size, width)]
    half = topk // 2  # a well-formed container of another topk: each proof cut to its first `half` coefficients
    wrong_topk = _HEADER.pack(magic, version, chunk, half, n_rows) + b"".join(p[:2 + 2 * half] for p in proofs)
    zero_modulus = bytearray(raw)
    zero_modulus[_HEADER.size:_HEADER.size + 2] = b"\x00\x00"
    enc = lambda b: base64.b64encode(bytes(b)).decode()  # noqa: E731
    return {
        "garbage": enc(rng.randbytes(48)),
        "not-base64": fp[:24] + "!*#",
        "truncated": enc(raw[:len(raw) // 2]),
        "wrong-topk": enc(wrong_topk),
        "zero-modulus": enc(zero_modulus),
        "extra-bytes": enc(raw + b"\x00" * 7),
        "empty": "",
        "not-a-string": 12345,
    }
