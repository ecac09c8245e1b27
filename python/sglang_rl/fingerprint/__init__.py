"""TOPLOC activation fingerprints: batched proof building, the wire container and verification."""

from sglang_rl.fingerprint.codec import (
    FORMAT_VERSION,
    MAX_TOPK,
    Fingerprint,
    FingerprintError,
    build_fingerprint,
    decode_fingerprint,
    encode_fingerprint,
)
from sglang_rl.fingerprint.proof import (
    PRIME,
    build_chunk_proofs,
    interpolate,
    proof_num_bytes,
    select_topk,
)
from sglang_rl.fingerprint.verify import (
    NOTHING_MATCHED,
    ChunkResult,
    Thresholds,
    VerificationReport,
    verify_rows,
)

__all__ = [
    "FORMAT_VERSION",
    "MAX_TOPK",
    "NOTHING_MATCHED",
    "PRIME",
    "ChunkResult",
    "Fingerprint",
    "FingerprintError",
    "Thresholds",
    "VerificationReport",
    "build_chunk_proofs",
    "build_fingerprint",
    "decode_fingerprint",
    "encode_fingerprint",
    "interpolate",
    "proof_num_bytes",
    "select_topk",
    "verify_rows",
]
