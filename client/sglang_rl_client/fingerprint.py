"""The fingerprint container: TOPLOC proofs of a response's activation rows, as one string.

Wire format v1 is standard base64 (with padding) of::

    b"TL" | version u8 = 1 | chunk_size u8 | topk u16 BE | n_rows u32 BE | proofs

where ``proofs`` are ceil(n_rows / chunk_size) toploc proofs of 2 + 2*topk bytes each, in chunk
order (toploc 0.1.6's ``ProofPoly.to_bytes``: the modulus, then topk coefficients, all u16 BE).
Decoding is strict and rejects every malformed input with a ``FingerprintError``: toploc's C++
verifier kills the whole process (SIGFPE, abort in a worker thread) on a zero modulus or a wrong
proof count, so a fingerprint that decodes here is safe to hand to toploc.

Pure Python: the sglang-rl plugin's server decodes with this module too.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

MAGIC = b"TL"
FORMAT_VERSION = 1
MAX_TOPK = 4096
MAX_CHUNK_SIZE = 255
MAX_ROWS = 2**32 - 1
DEFAULT_CHUNK_SIZE = 32
DEFAULT_TOPK = 128
PRIME = 65497
"""The field of toploc's proof polynomials: GF(65497); every modulus and coefficient is bounded by it."""

_HEADER = struct.Struct(">2sBBHI")
HEADER_SIZE = _HEADER.size


class FingerprintError(ValueError):
    """A fingerprint is malformed or does not fit the data it is checked against."""


def proof_num_bytes(topk: int) -> int:
    """Size of one serialised proof: u16 modulus plus ``topk`` u16 coefficients."""
    return 2 + 2 * topk


def _check_layout(topk: int, chunk_size: int, n_rows: int, proofs: tuple) -> None:
    """Reject header fields out of range, a proof count that does not fit n_rows, and proofs
    that are not bytes of the size topk gives (each proof's content is `_check_proof`'s)."""
    for name, value in (("topk", topk), ("chunk_size", chunk_size), ("n_rows", n_rows)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise FingerprintError(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise FingerprintError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}, got {chunk_size}")
    if not 1 <= topk <= MAX_TOPK:
        raise FingerprintError(f"topk must be in 1..{MAX_TOPK}, got {topk}")
    if not 1 <= n_rows <= MAX_ROWS:
        raise FingerprintError(f"n_rows must be in 1..{MAX_ROWS}, got {n_rows}")
    num_chunks = -(-n_rows // chunk_size)
    if len(proofs) != num_chunks:
        raise FingerprintError(
            f"{n_rows} rows in chunks of {chunk_size} need {num_chunks} proofs, got {len(proofs)}"
        )
    width = proof_num_bytes(topk)
    for index, proof in enumerate(proofs):
        if not isinstance(proof, bytes):
            raise FingerprintError(f"proof {index} must be bytes, got {type(proof).__name__}")
        if len(proof) != width:
            raise FingerprintError(
                f"proof {index} has {len(proof)} bytes, expected {width} for topk={topk}"
            )


def _check_proof(index: int, proof: bytes, topk: int) -> None:
    """Reject a proof toploc cannot evaluate safely or that no honest build could produce."""
    modulus, *coeffs = struct.unpack(f">{topk + 1}H", proof)
    if modulus == 0:
        raise FingerprintError(f"proof {index} has modulus 0 (a null proof)")
    if modulus < topk:
        raise FingerprintError(
            f"proof {index} has modulus {modulus}, smaller than topk={topk}: "
            "its indices cannot be distinct"
        )
    if modulus > PRIME:
        raise FingerprintError(f"proof {index} has modulus {modulus}, above the maximum {PRIME}")
    largest = max(coeffs)
    if largest >= PRIME:
        raise FingerprintError(
            f"proof {index} has a coefficient {largest}, not below the field prime {PRIME}"
        )


@dataclass(frozen=True)
class Fingerprint:
    """Proofs of ``n_rows`` activation rows, one toploc proof per ``chunk_size`` rows.

    Construction validates everything (sizes, proof count and every proof), so any instance can
    be passed to toploc's verifier without risk of crashing the process.
    """

    topk: int
    chunk_size: int
    n_rows: int
    proofs: tuple[bytes, ...]

    def __post_init__(self) -> None:
        """Validate the header fields and every proof; raise FingerprintError on any problem."""
        if not isinstance(self.proofs, tuple):
            object.__setattr__(self, "proofs", tuple(self.proofs))
        _check_layout(self.topk, self.chunk_size, self.n_rows, self.proofs)
        for index, proof in enumerate(self.proofs):
            _check_proof(index, proof, self.topk)

    @property
    def num_chunks(self) -> int:
        """Number of chunks (and proofs): ceil(n_rows / chunk_size)."""
        return -(-self.n_rows // self.chunk_size)

    @property
    def num_bytes(self) -> int:
        """Size of the encoded container before base64."""
        return HEADER_SIZE + self.num_chunks * proof_num_bytes(self.topk)

    def describe(self) -> str:
        """One line for people: tokens covered, proofs and sizes."""
        return (
            f"v{FORMAT_VERSION}, {self.n_rows} response tokens, {self.num_chunks} proof(s) of "
            f"{proof_num_bytes(self.topk)} bytes (topk={self.topk}, {self.chunk_size} tokens each), "
            f"{self.num_bytes} bytes in all"
        )


def encode_fingerprint(fp: Fingerprint) -> str:
    """Serialise a fingerprint to its v1 base64 string."""
    return _encode(fp.topk, fp.chunk_size, fp.n_rows, fp.proofs)


def encode_built_proofs(topk: int, chunk_size: int, n_rows: int, proofs: tuple[bytes, ...]) -> str:
    """The v1 string of proofs the caller built itself and already checked (the plugin's proof
    builders check every modulus and coefficient in one tensor op per job), so only the layout is
    checked here: re-reading each proof in Python costs ~30 us per fingerprint."""
    _check_layout(topk, chunk_size, n_rows, proofs)
    return _encode(topk, chunk_size, n_rows, proofs)


def _encode(topk: int, chunk_size: int, n_rows: int, proofs: tuple[bytes, ...]) -> str:
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, chunk_size, topk, n_rows)
    return base64.b64encode(header + b"".join(proofs)).decode("ascii")


def _strict_b64decode(s: str, what: str) -> bytes:
    """Standard padded base64 only, and only its canonical spelling (zero padding bits), so that
    one byte string has exactly one text form."""
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FingerprintError(f"{what} is not valid base64: {exc}") from None
    if base64.b64encode(raw).decode("ascii") != s:
        raise FingerprintError(f"{what} is not canonical base64 (non-zero padding bits)")
    return raw


def decode_fingerprint(s: object, expected_topk: int | None = None) -> Fingerprint:
    """Parse and fully validate a v1 fingerprint string.

    Raises FingerprintError with a human-readable reason on any malformed input, and when
    ``expected_topk`` is given and differs from the fingerprint's topk.
    """
    if not isinstance(s, str):
        raise FingerprintError(f"fingerprint must be a string, got {type(s).__name__}")
    if not s:
        raise FingerprintError("fingerprint is empty")
    raw = _strict_b64decode(s, "fingerprint")
    if len(raw) < HEADER_SIZE:
        raise FingerprintError(
            f"fingerprint has {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, chunk_size, topk, n_rows = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise FingerprintError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FingerprintError(
            f"unknown fingerprint version {version}, this server reads version {FORMAT_VERSION}"
        )
    if chunk_size == 0:
        raise FingerprintError("chunk_size is 0")
    if topk == 0 or topk > MAX_TOPK:
        raise FingerprintError(f"topk must be in 1..{MAX_TOPK}, got {topk}")
    if n_rows == 0:
        raise FingerprintError("n_rows is 0")
    if expected_topk is not None and topk != expected_topk:
        raise FingerprintError(
            f"fingerprint was built with topk={topk}, this server uses topk={expected_topk}"
        )
    width = proof_num_bytes(topk)
    num_chunks = -(-n_rows // chunk_size)
    payload = memoryview(raw)[HEADER_SIZE:]
    if len(payload) != num_chunks * width:
        raise FingerprintError(
            f"payload has {len(payload)} bytes, expected {num_chunks * width} "
            f"({num_chunks} proofs of {width} bytes for {n_rows} rows, chunk_size={chunk_size}, "
            f"topk={topk})"
        )
    proofs = tuple(bytes(payload[i * width : (i + 1) * width]) for i in range(num_chunks))
    return Fingerprint(topk=topk, chunk_size=chunk_size, n_rows=n_rows, proofs=proofs)


# --------------------------------------------------------------------------------------------
# toploc's own proof lists


ToplocProof = Union[str, bytes]


def to_toploc_proofs(fingerprint: Fingerprint | str) -> list[str]:
    """The fingerprint's proofs as toploc writes them (``toploc.build_proofs_base64`` with
    ``skip_prefill=True``): one base64 string per chunk of ``chunk_size`` tokens, for
    ``toploc.verify_proofs_base64(rows, proofs, decode_batching_size=chunk_size, topk=topk,
    skip_prefill=True)``."""
    fp = decode_fingerprint(fingerprint) if isinstance(fingerprint, str) else fingerprint
    return [base64.b64encode(proof).decode("ascii") for proof in fp.proofs]


def from_toploc_proofs(
    proofs: Sequence[ToplocProof], n_rows: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Fingerprint:
    """A fingerprint from toploc's proof list: base64 strings (``build_proofs_base64``) or bytes
    (``build_proofs_bytes``), one per chunk, built with ``skip_prefill=True`` and
    ``decode_batching_size=chunk_size``. toploc's proofs do not say how many rows the last chunk
    holds, hence ``n_rows``; topk is read from the proofs' size. Every proof is validated (toploc
    writes null proofs, modulus 0, when building failed; they are refused here)."""
    if isinstance(proofs, (str, bytes)) or not isinstance(proofs, Sequence):
        raise FingerprintError("proofs must be a list of toploc proofs (base64 strings or bytes)")
    if not proofs:
        raise FingerprintError("the proof list is empty")
    raw = tuple(
        _strict_b64decode(p, f"proof {i}") if isinstance(p, str) else p for i, p in enumerate(proofs)
    )
    first = raw[0]
    if not isinstance(first, bytes) or len(first) < 4 or len(first) % 2:
        size = len(first) if isinstance(first, bytes) else type(first).__name__
        raise FingerprintError(f"proof 0 is not a toploc proof (2 + 2 * topk bytes), got {size}")
    return Fingerprint(topk=(len(first) - 2) // 2, chunk_size=chunk_size, n_rows=n_rows, proofs=raw)
