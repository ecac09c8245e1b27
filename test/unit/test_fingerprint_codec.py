"""The fingerprint container: round trips, exact layout, a FingerprintError for every bad input."""

from __future__ import annotations

import base64
import random
import re
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from sglang_rl.fingerprint import (
    PRIME,
    Fingerprint,
    FingerprintError,
    decode_fingerprint,
    encode_built_proofs,
    encode_fingerprint,
)
from sglang_rl.fingerprint.codec import build_fingerprint


def make_proof(topk: int, modulus: int = PRIME, coeff: int = 7) -> bytes:
    return struct.pack(f">{topk + 1}H", modulus, *([coeff] * topk))


def raw_fingerprint(
    topk: int = 4,
    chunk_size: int = 2,
    n_rows: int = 3,
    version: int = 1,
    magic: bytes = b"TL",
    proofs: list[bytes] | None = None,
) -> bytes:
    if proofs is None:
        proofs = [make_proof(topk)] * -(-n_rows // chunk_size)
    return struct.pack(">2sBBHI", magic, version, chunk_size, topk, n_rows) + b"".join(proofs)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def test_round_trip_and_layout() -> None:
    proofs = (make_proof(4, 65497, 1), make_proof(4, 300, 65496))
    fp = Fingerprint(topk=4, chunk_size=2, n_rows=3, proofs=proofs)
    assert fp.num_chunks == 2
    text = encode_fingerprint(fp)
    raw = base64.b64decode(text)
    assert raw[:10] == b"TL\x01\x02\x00\x04\x00\x00\x00\x03"
    assert raw[10:] == proofs[0] + proofs[1]
    assert decode_fingerprint(text) == fp
    assert decode_fingerprint(text, expected_topk=4) == fp


def test_real_fingerprint_round_trip() -> None:
    rows = torch.randn(70, 576, generator=torch.Generator().manual_seed(0))
    fp = build_fingerprint(rows, topk=128, chunk_size=32)
    assert (fp.topk, fp.chunk_size, fp.n_rows, fp.num_chunks) == (128, 32, 70, 3)
    text = encode_fingerprint(fp)
    assert len(base64.b64decode(text)) == 10 + 3 * 258
    assert decode_fingerprint(text, expected_topk=128) == fp


def header(chunk_size: int = 2, topk: int = 4, n_rows: int = 3) -> str:
    return b64(struct.pack(">2sBBHI", b"TL", 1, chunk_size, topk, n_rows))


def with_proofs(*proofs: bytes) -> str:
    return b64(raw_fingerprint(proofs=list(proofs)))


GOOD = make_proof(4)
VALID = b64(raw_fingerprint())

BAD_INPUTS: list[tuple[str, object, str]] = [
    ("bytes", VALID.encode(), "must be a string"),
    ("None", None, "must be a string"),
    ("int", 12, "must be a string"),
    ("empty", "", "empty"),
    ("bad alphabet", "TL!!" + VALID[4:], "not valid base64"),
    ("whitespace", VALID[:8] + "\n" + VALID[8:], "not valid base64"),
    ("url-safe alphabet", "VEwB-_8=", "not valid base64"),
    ("missing padding", b64(raw_fingerprint() + b"x").rstrip("="), "not valid base64"),
    ("non-ascii", "TLé=", "not valid base64"),
    ("non-canonical padding bits", "TR==", "not canonical"),
    ("too short", b64(b"TL\x01\x20\x00\x80\x00\x00\x00"), "shorter than the 10-byte header"),
    ("bad magic", b64(raw_fingerprint(magic=b"XX")), "bad magic"),
    ("unknown version", b64(raw_fingerprint(version=2)), "unknown fingerprint version 2"),
    ("chunk_size 0", header(chunk_size=0), "chunk_size is 0"),
    ("topk 0", header(topk=0), "topk must be in 1..4096, got 0"),
    ("topk too big", header(topk=4097), "got 4097"),
    ("n_rows 0", header(n_rows=0), "n_rows is 0"),
    ("payload short", b64(raw_fingerprint()[:-2]), "payload has 18 bytes, expected 20"),
    ("payload long", b64(raw_fingerprint() + b"\x00\x00"), "payload has 22 bytes, expected 20"),
    ("proof missing", b64(raw_fingerprint(n_rows=5, proofs=[GOOD] * 2)), "20 bytes, expected 30"),
    ("huge n_rows", header(chunk_size=1, n_rows=2**32 - 1), "expected 42949672950"),
    ("null proof", with_proofs(GOOD, make_proof(4, 0, 0)), "proof 1 has modulus 0"),
    ("modulus below topk", with_proofs(make_proof(4, 3), GOOD), "modulus 3, smaller than topk=4"),
    ("modulus above prime", with_proofs(GOOD, make_proof(4, 65498)), "modulus 65498, above"),
    ("coefficient at prime", with_proofs(make_proof(4, PRIME, 65497), GOOD), "coefficient 65497"),
    ("coefficient max", with_proofs(GOOD, make_proof(4, PRIME, 65535)), "coefficient 65535"),
]


@pytest.mark.parametrize(
    "value,reason", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_malformed_inputs_raise_with_reason(value: object, reason: str) -> None:
    with pytest.raises(FingerprintError, match=re.escape(reason)):
        decode_fingerprint(value)


def test_fingerprint_error_is_a_value_error() -> None:
    assert issubclass(FingerprintError, ValueError)


def test_topk_mismatch_with_server() -> None:
    with pytest.raises(FingerprintError, match="built with topk=4, this server uses topk=128"):
        decode_fingerprint(b64(raw_fingerprint()), expected_topk=128)


def test_constructor_validates() -> None:
    good = make_proof(4)
    with pytest.raises(FingerprintError, match="need 2 proofs, got 1"):
        Fingerprint(topk=4, chunk_size=2, n_rows=3, proofs=(good,))
    with pytest.raises(FingerprintError, match="proof 0 has 8 bytes, expected 10"):
        Fingerprint(topk=4, chunk_size=2, n_rows=2, proofs=(good[:8],))
    with pytest.raises(FingerprintError, match="chunk_size must be in 1..255"):
        Fingerprint(topk=4, chunk_size=256, n_rows=2, proofs=(good,))
    with pytest.raises(FingerprintError, match="modulus 0"):
        Fingerprint(topk=4, chunk_size=2, n_rows=2, proofs=(make_proof(4, 0),))
    fp = Fingerprint(topk=4, chunk_size=2, n_rows=2, proofs=[good])  # type: ignore[arg-type]
    assert fp.proofs == (good,)


def test_built_proofs_encode_as_the_container_and_keep_the_layout_checks() -> None:
    """A server's own proofs skip the per-proof re-read, not the layout: the string is the
    container's, and a wrong count or size still fails."""
    proofs = (make_proof(4, 65497, 1), make_proof(4, 300, 65496))
    text = encode_built_proofs(4, 2, 3, proofs)
    assert text == encode_fingerprint(Fingerprint(topk=4, chunk_size=2, n_rows=3, proofs=proofs))
    assert decode_fingerprint(text).proofs == proofs
    with pytest.raises(FingerprintError, match="need 2 proofs, got 1"):
        encode_built_proofs(4, 2, 3, proofs[:1])
    with pytest.raises(FingerprintError, match="proof 1 has 8 bytes, expected 10"):
        encode_built_proofs(4, 2, 3, (proofs[0], proofs[1][:8]))
    with pytest.raises(FingerprintError, match="n_rows must be in"):
        encode_built_proofs(4, 2, 0, ())


def test_random_corruption_never_escapes_as_another_error() -> None:
    rng = random.Random(0)
    base = bytearray(raw_fingerprint(topk=8, chunk_size=3, n_rows=7))
    for _ in range(2000):
        raw = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        if rng.random() < 0.2:
            del raw[rng.randrange(len(raw)) :]
        text = b64(bytes(raw))
        if rng.random() < 0.1:
            text = text[: rng.randrange(len(text) + 1)]
        try:
            fp = decode_fingerprint(text)
        except FingerprintError:
            continue
        assert all(PRIME >= int.from_bytes(p[:2], "big") >= fp.topk for p in fp.proofs)


_TOPLOC_SCRIPT = textwrap.dedent(
    """
    import base64, sys, torch, toploc
    from sglang_rl.fingerprint import decode_fingerprint

    def run(chunk_size, topk, proofs):
        rows = torch.randn(7, 64).to(torch.bfloat16)
        return toploc.verify_proofs_bytes(
            rows, proofs, decode_batching_size=chunk_size, topk=topk, skip_prefill=True
        )

    fp = decode_fingerprint(sys.argv[1])
    print("accepted ok", len(run(fp.chunk_size, fp.topk, list(fp.proofs))), flush=True)
    raw = base64.b64decode(sys.argv[2])
    topk = int.from_bytes(raw[4:6], "big")
    width = 2 + 2 * topk
    unchecked = [raw[i : i + width] for i in range(10, len(raw), width)]
    print("unchecked ok", len(run(raw[3], topk, unchecked)))
    """
)


def test_accepted_edge_proofs_are_safe_for_toploc_and_null_proofs_are_not() -> None:
    """One child process runs toploc on accepted edge-case proofs, then on a rejected null proof.

    The first must succeed; the second kills the child (SIGFPE), which is why decoding refuses it.
    """
    topk = 16
    edge = [make_proof(topk, topk, 65496), make_proof(topk, PRIME, 0), make_proof(topk, 17, 1)]
    text = encode_fingerprint(Fingerprint(topk=topk, chunk_size=3, n_rows=7, proofs=tuple(edge)))
    null_proofs = [edge[0], make_proof(topk, 0, 0), edge[2]]
    null = b64(raw_fingerprint(topk=topk, chunk_size=3, n_rows=7, proofs=null_proofs))
    with pytest.raises(FingerprintError, match="modulus 0"):
        decode_fingerprint(null)
    child = subprocess.run(
        [sys.executable, "-c", _TOPLOC_SCRIPT, text, null],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "accepted ok 3" in child.stdout, child.stderr
    assert "unchecked ok" not in child.stdout
    assert child.returncode != 0
