"""Each finished rollout's sglang-rl results, kept by request id for an in-process caller.

An RL framework that drives sglang's `TokenizerManager` in its own process (verl's rollout server)
reads token ids and log-probs from the output and drops the rest of `meta_info`. Such a caller
turns records on for its tokenizer manager and takes each request's record by its rid after the
request finished: the TOPLOC fingerprints and the speculative-decoding counters, under the names
the caller keeps. Off by default: an HTTP server pays one attribute lookup per output.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Optional

from sglang_rl.request_options import FINGERPRINTS_FIELD

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_sglang_rl_rollout_records"
DEFAULT_CAPACITY = 65536

# sglang 0.5.17 meta_info counters -> verl's rollout-common names (verl/trainer/ppo/ray_trainer.py
# compute_spec_decode_metrics: acceptance length = 1 + accepted / verify steps)
SPEC_COUNTERS = {
    "spec_num_proposed_drafts": "spec_num_draft_tokens",
    "spec_num_correct_drafts": "spec_num_accepted_tokens",
    "spec_verify_ct": "spec_num_verify_steps",
}


class RolloutRecords:
    """A bounded map rid -> record; the oldest records go first when a caller never takes them
    (an aborted request), so memory stays bounded."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0

    def put(self, rid: str, record: dict) -> None:
        with self._lock:
            self._records[rid] = record
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
                self.dropped += 1
                if self.dropped in (1, 1000):
                    logger.warning("sglang-rl: %d rollout records were never taken; dropping the oldest",
                                   self.dropped)

    def pop(self, rid: str) -> dict:
        with self._lock:
            return self._records.pop(rid, {})

    def __len__(self) -> int:
        return len(self._records)


def enable(tokenizer_manager: Any, capacity: int = DEFAULT_CAPACITY) -> RolloutRecords:
    """Keep records for this tokenizer manager's requests from now on (idempotent)."""
    records = getattr(tokenizer_manager, _ATTRIBUTE, None)
    if records is None:
        records = RolloutRecords(capacity)
        setattr(tokenizer_manager, _ATTRIBUTE, records)
    return records


def record_of(meta: dict) -> dict:
    """The fields a caller keeps from one finished output's meta_info."""
    record = {name: meta[key] for key, name in SPEC_COUNTERS.items() if key in meta}
    if FINGERPRINTS_FIELD in meta:
        record[FINGERPRINTS_FIELD] = meta[FINGERPRINTS_FIELD]
    return record


def record(tokenizer_manager: Any, out: dict) -> None:
    """Called for every output dict: keep a finished one's record when records are on."""
    records: Optional[RolloutRecords] = getattr(tokenizer_manager, _ATTRIBUTE, None)
    if records is None:
        return
    meta = out.get("meta_info")
    if isinstance(meta, dict) and meta.get("finish_reason") is not None and "id" in meta:
        records.put(meta["id"], record_of(meta))


def pop(tokenizer_manager: Any, rid: str) -> dict:
    """Take the record of a finished request ({} if there is none)."""
    records: Optional[RolloutRecords] = getattr(tokenizer_manager, _ATTRIBUTE, None)
    return records.pop(rid) if records is not None else {}
