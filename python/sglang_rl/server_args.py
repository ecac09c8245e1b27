"""Server flags of sglang-rl, added to sglang's own ServerArgs dataclass.

sglang derives CLI flags from annotated dataclass fields, pickles the instance to every scheduler
process and builds it for `sgl.Engine(**kwargs)`; subclassing it is how a plugin adds flags that
work with `python -m sglang.launch_server`, `sglang serve` and the Engine alike.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sglang.srt.arg_groups.arg_utils import A
from sglang.srt.server_args import ServerArgs


@dataclasses.dataclass
class RLServerArgs(ServerArgs):
    """sglang's ServerArgs plus the sglang-rl flags."""

    toploc_verification: A[
        bool,
        "sglang-rl: attach TOPLOC fingerprints of the last-layer hidden states to every response "
        "and accept verification requests (max_tokens=0 with toploc_verification_fingerprint_to_validate).",
    ] = False
    toploc_verification_topk: A[
        int, "sglang-rl: number of top-|value| activations committed per 32-token chunk (toploc topk)."
    ] = 128
    toploc_verification_max_exp_mismatches: A[
        Optional[int],
        "sglang-rl: fail a chunk above this many exponent mismatches "
        "(default: 38 per 128 top-k values, scaled with --toploc-verification-topk).",
    ] = None
    toploc_verification_max_mant_err_mean: A[
        float, "sglang-rl: fail a chunk whose mean mantissa error is above this (default 10)."
    ] = 10.0
    toploc_verification_max_mant_err_median: A[
        float, "sglang-rl: fail a chunk whose median mantissa error is above this (default 8)."
    ] = 8.0

    def __post_init__(self) -> None:
        if self.toploc_verification_topk < 1 or self.toploc_verification_topk > 4096:
            raise ValueError("--toploc-verification-topk must be between 1 and 4096")
        if self.toploc_verification and self.speculative_algorithm:
            raise ValueError(
                "--toploc-verification does not support speculative decoding: a fingerprint is built "
                "from one row per decode step, and a speculative step commits several tokens"
            )
        super().__post_init__()
