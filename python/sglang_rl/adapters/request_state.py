"""The one object sglang-rl keeps on a sglang `Req`: every feature's per-request state.

sglang's `Req` is created in the scheduler (`Req.__init__`, hooked by `scheduler.req_init_after`)
and lives until its output is streamed; the plugin's state for it rides on it as one attribute,
so that a request's state is found in one place and goes away with the request.

The state names no feature's class. What the scheduler's hooks drive is described here as
protocols: the request's row sinks (`RowSink`), fed the rows it computes; the features that took
it when it was queued (`Adopter`), told once when it finishes; its fingerprint (`Builder`) or the
check of one (`Verification`). A feature that consumes rows adopts the request and adds its
sinks; the scheduler's hooks route rows to every sink alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from sglang_rl.adapters.decode_step import DecodeStep

ATTR = "_sglang_rl"


class RowSink(Protocol):
    """Rows of one request, as the scheduler's prefill and decode hooks hand them over (hidden-state
    fields, co-training's window, the SpecForge export's windows)."""

    stores: bool
    """False on a rank that sends no outputs: it keeps no rows, and the hooks skip it."""
    done: bool
    """Its rows were delivered or closed: the hooks skip it."""
    needs_prompt_rows: bool
    """Every row of the prompt it can get (FULL capture), not only the last prompt token's."""
    takes_captured_rows: bool
    """The captured rows (an EAGLE3 target's auxiliary layers), not the last layer's."""
    wants_final_row: bool
    """The final token's row: the request runs one extra decode step to compute it."""

    def prefix_limit(self) -> Optional[int]:
        """The longest prefix the radix cache may serve without losing wanted rows (None: any)."""

    def add_prefill(self, rows: torch.Tensor, last_chunk: bool, end: Optional[int] = None) -> None:
        """Rows of one prefill chunk, the chunks ending at position `end` (default the prompt's)."""

    def add_decode(self, step: DecodeStep, start: int, count: int, position: int) -> None:
        """Rows `start .. start+count-1` of a decode step, at positions from `position`."""


class Adopter(Protocol):
    """A feature that takes each request its scheduler queues (`adopt`) and must hear when the
    request finishes (`finished`, once, with what it keeps for the request)."""

    def adopt(self, req: Any) -> None:
        """Take the request: its state gains this adopter (`RequestState.adopters`) and its sinks."""

    def finished(self, req: Any, kept: Any) -> None:
        """The request finished (or was aborted); `kept` is what `adopt` kept for it."""


class Builder(Protocol):
    """A generation's fingerprint, built from its rows by its scheduler's pipeline (TOPLOC:
    `fingerprint.builder.FingerprintBuilder`)."""

    done: bool


class Verification(Protocol):
    """A prefill-only request that checks a fingerprint against its own prefill rows (TOPLOC:
    `adapters.prefill_verification.PrefillVerification`), or that was rejected before it had any."""

    done: bool

    @property
    def on_device(self) -> bool:
        """Whether the forward hook checks the rows where they are (no host copy to `add_rows`)."""

    def add_rows(self, rows: torch.Tensor) -> None:
        """Prefill rows of the request, in order (the host path)."""

    def post_report(self, req: Any) -> None:
        """Post the finished request's report to its response (once)."""


@dataclass
class RequestState:
    """sglang-rl's state of one request (None or empty: no feature concerns the request)."""

    rows: list[RowSink] = field(default_factory=list)
    """Every sink of the request's rows (`add_rows`)."""
    adopters: dict[Adopter, Any] = field(default_factory=dict)
    """The features that adopted the request, each with what it keeps for it."""
    wants_final_row: bool = False
    """A sink wants the final token's row (`scheduler.update_finish_state_around`)."""
    deferred_finish: Optional[tuple] = None
    """(finished_reason, finished_len) of a request held back one decode step for its final row."""
    final_row: bool = False
    """That extra step ran: the final token's row was computed."""
    fingerprint: Optional[Builder] = None
    """TOPLOC: the fingerprint of a generation."""
    verification: Optional[Verification] = None
    """TOPLOC: the check of a fingerprint by a prefill-only request."""
    kcbs_search: Any = None
    """k-CBS: the search (`adapters.kcbs_manager.KcbsSearch`) of a request that asked for candidates."""
    kcbs_beam: Optional[tuple] = None
    """k-CBS: (search, beam index) of a beam request the search queued."""
    seeded_sampling_seed: Optional[int] = None
    """Seeded sampling: the sampling_seed of a request that asked for it (read once, at Req init)."""
    pending_payload: Optional[dict] = None
    """Fields queued for the next output batch that carries the request (transport.py)."""

    def add_rows(self, *sinks: RowSink) -> None:
        """The request's rows go to these sinks too."""
        for sink in sinks:
            self.rows.append(sink)
            self.wants_final_row = self.wants_final_row or sink.wants_final_row


def state_of(req: Any) -> RequestState:
    """The request's state, created empty on first use."""
    state = getattr(req, ATTR, None)
    if state is None:
        state = RequestState()
        setattr(req, ATTR, state)
    return state


def peek(req: Any) -> Optional[RequestState]:
    """The request's state, or None when no feature has touched it (creates nothing)."""
    return getattr(req, ATTR, None)


def kcbs_search_of(req: Any) -> Any:
    state = getattr(req, ATTR, None)
    return None if state is None else state.kcbs_search


def kcbs_beam_of(req: Any) -> Optional[tuple]:
    state = getattr(req, ATTR, None)
    return None if state is None else state.kcbs_beam
