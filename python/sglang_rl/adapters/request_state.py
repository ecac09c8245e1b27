"""The one object sglang-rl keeps on a sglang `Req`: every feature's per-request state, typed.

sglang's `Req` is created in the scheduler (`Req.__init__`, hooked by `scheduler.req_init_after`)
and lives until its output is streamed; the plugin's state for it rides on it as one attribute,
so that a request's state is found in one place and goes away with the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from sglang_rl.adapters.cotrain import CotrainRuntime
    from sglang_rl.adapters.cotrain_rows import CotrainRows
    from sglang_rl.adapters.hidden_states import RowCollector
    from sglang_rl.adapters.kcbs_manager import KcbsSearch
    from sglang_rl.adapters.specforge_export import SpecForgeExport

ATTR = "_sglang_rl"


@dataclass
class RequestState:
    """sglang-rl's state of one request (None: the feature does not concern the request)."""

    fingerprint: Any = None
    """TOPLOC: a FingerprintBuilder (a generation), a PrefillVerification or RejectedVerification."""
    hidden_states: Optional["RowCollector"] = None
    """Hidden-states rows asked for by the request."""
    kcbs_search: Optional["KcbsSearch"] = None
    """k-CBS: the search of a request that asked for candidates."""
    kcbs_beam: Optional[tuple] = None
    """k-CBS: (search, beam index) of a beam request the search queued."""
    cotrain_runtime: Optional["CotrainRuntime"] = None
    """Drafter co-training: the runtime of the scheduler that queued the request (counts it)."""
    cotrain_rows: Optional["CotrainRows"] = None
    """Drafter co-training: the rows of a rollout that feeds the trainer."""
    cotrain_counted: bool = False
    """Drafter co-training: the finished rollout was counted once."""
    specforge_export: Optional["SpecForgeExport"] = None
    """SpecForge export: the export of the scheduler that queued the request (writes it)."""
    specforge_rows: Optional[tuple] = None
    """SpecForge export: the request's captured and last-layer row windows."""
    seeded_sampling_seed: Optional[int] = None
    """Seeded sampling: the sampling_seed of a request that asked for it (read once, at Req init)."""
    pending_payload: Optional[dict] = None
    """Fields queued for the next output batch that carries the request (transport.py)."""


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


def fingerprint_of(req: Any) -> Any:
    state = getattr(req, ATTR, None)
    return None if state is None else state.fingerprint


def hidden_states_of(req: Any) -> Optional["RowCollector"]:
    state = getattr(req, ATTR, None)
    return None if state is None else state.hidden_states


def kcbs_search_of(req: Any) -> Optional["KcbsSearch"]:
    state = getattr(req, ATTR, None)
    return None if state is None else state.kcbs_search


def kcbs_beam_of(req: Any) -> Optional[tuple]:
    state = getattr(req, ATTR, None)
    return None if state is None else state.kcbs_beam


def cotrain_rows_of(req: Any) -> Optional["CotrainRows"]:
    state = getattr(req, ATTR, None)
    return None if state is None else state.cotrain_rows
