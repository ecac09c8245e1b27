"""Worker-level evidence: is a worker serving the agreed model, judged over many responses?

A sequential likelihood-ratio test over the scores of a worker's verification reports, against a
calibration file's histograms. Pure Python, so it lives in the client package that operators
install (``sglang_rl_client.evidence``, which documents the test and its false-accusation bound);
this module is the plugin's name for it.
"""

from sglang_rl_client.bands import BandEvidence, band_of_report, band_of_score  # noqa: F401 - re-exported
from sglang_rl_client.evidence import (  # noqa: F401 - re-exported
    ACCEPT,
    DEFAULT_EDGES,
    REJECT,
    SUSPECT,
    UNDECIDED,
    EvidencePolicy,
    Fleet,
    WorkerEvidence,
    histogram,
    log_likelihood_ratios,
    response_score,
    score_bin,
)
