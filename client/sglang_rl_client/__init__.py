"""Verify responses of sglang-rl servers (TOPLOC fingerprints) without torch, numpy, sglang or
toploc: the "TL" fingerprint container and its conversion to toploc's proof lists
(``fingerprint``), a batched, concurrent, retrying verifier client (``verifier``), calibration
files (``calibration``), worker-level evidence (``evidence``) and the ``sglang-rl-verify``
command (``cli``)."""

from sglang_rl_client.calibration import (
    Calibration,
    CalibrationError,
    ThresholdPolicy,
    Thresholds,
    load_calibration,
)
from sglang_rl_client.evidence import EvidencePolicy, Fleet, WorkerEvidence, response_score
from sglang_rl_client.fingerprint import (
    Fingerprint,
    FingerprintError,
    decode_fingerprint,
    encode_fingerprint,
    from_toploc_proofs,
    to_toploc_proofs,
)
from sglang_rl_client.transport import ServerError, Transport
from sglang_rl_client.verifier import Outcome, Rollout, RolloutError, VerifierClient, verify_rollouts

__version__ = "0.1.0"

__all__ = [
    "Calibration",
    "CalibrationError",
    "EvidencePolicy",
    "Fingerprint",
    "FingerprintError",
    "Fleet",
    "Outcome",
    "Rollout",
    "RolloutError",
    "ServerError",
    "ThresholdPolicy",
    "Thresholds",
    "Transport",
    "VerifierClient",
    "WorkerEvidence",
    "decode_fingerprint",
    "encode_fingerprint",
    "from_toploc_proofs",
    "load_calibration",
    "response_score",
    "to_toploc_proofs",
    "verify_rollouts",
]
