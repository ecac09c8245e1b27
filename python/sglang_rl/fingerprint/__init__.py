"""TOPLOC activation fingerprints: batched proof building, the wire container (and its conversion
to and from toploc's proof lists), verification, per-model calibration of the bounds and
worker-level evidence. The container, the calibration file and the evidence test are pure Python
and shared with the client package (``sglang_rl_client``). A serving loop's fingerprints are
built by `pipeline.FingerprintPipeline` (imported from its module, not here: the API side never
loads it)."""

from sglang_rl.fingerprint.codec import (
    FORMAT_VERSION,
    MAX_TOPK,
    Fingerprint,
    FingerprintError,
    build_fingerprint,
    decode_fingerprint,
    encode_built_proofs,
    encode_fingerprint,
    from_toploc_proofs,
    to_toploc_proofs,
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
from sglang_rl.fingerprint.calibration import (
    Calibration,
    CalibrationError,
    ThresholdPolicy,
    load_calibration,
    save_calibration,
)
from sglang_rl.fingerprint.evidence import EvidencePolicy, WorkerEvidence, response_score

__all__ = [
    "FORMAT_VERSION",
    "MAX_TOPK",
    "NOTHING_MATCHED",
    "PRIME",
    "Calibration",
    "CalibrationError",
    "ChunkResult",
    "EvidencePolicy",
    "Fingerprint",
    "FingerprintError",
    "ThresholdPolicy",
    "Thresholds",
    "VerificationReport",
    "WorkerEvidence",
    "build_chunk_proofs",
    "build_fingerprint",
    "decode_fingerprint",
    "encode_built_proofs",
    "encode_fingerprint",
    "from_toploc_proofs",
    "interpolate",
    "load_calibration",
    "proof_num_bytes",
    "response_score",
    "save_calibration",
    "select_topk",
    "to_toploc_proofs",
    "verify_rows",
]
