"""Scheduler side of hidden-state delivery for EAGLE co-training.

A request that uses the sglang-rl fields (format / scope / last_n / final row) raises only its
own CaptureHiddenMode and never sets upstream's `return_hidden_states`, so no per-token
`.tolist()` runs. Its rows arrive on the host with sglang's own batched, asynchronous copy of the
batch results (pinned memory). FULL rows are appended, tagged with their token positions, to the
request's shared-memory files; at finish the scheduler posts only a file handle, and the API
process (`deliver`) maps the rows, selects the scope and encodes them: raw little-endian bytes in
base64, upstream-style lists, or tensors for the in-process Engine. The scheduler thread never
encodes, and megabytes of rows never travel through the detokenizer.

Positions: the row at position p is the lm_head input computed with token p as input. Prefill
rows cover [L - R, L) (R rows computed; the prefix cache is capped so scope "all" recomputes the
prompt); decode rows sit at L + len(output_ids) - 1. The final token's row (never computed by
plain decoding) comes from one deferred finish: the request runs one extra decode step on its
own KV cache, the extra sampled token is cut by sglang's finished_len.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from sglang.srt.managers.schedule_batch import FINISH_ABORT

from sglang_rl.adapters import transport
from sglang_rl.hidden_states import (
    HiddenStatesFormat,
    HiddenStatesMode,
    HiddenStatesOptions,
    HiddenStatesScope,
    encode_rows,
    rows_to_list,
    select_positions,
)
from sglang_rl.hidden_states.packing import host_view
from sglang_rl.hidden_states.row_segments import RowSegments, discard_handle, read_rows, shm_dir
from sglang_rl.request_options import (
    HIDDEN_STATES_ERROR_FIELD as ERROR_FIELD,
    HIDDEN_STATES_POSITIONS_FIELD as POSITIONS_FIELD,
    HIDDEN_STATES_ROWS_FIELD as ROWS_FIELD,
)

logger = logging.getLogger(__name__)

# custom_params["sglang_rl"] keys
TRIM_SLACK = 16  # in-memory rows kept beyond the wanted ones before a trim (see RowCollector._trim)
KEYS = ("hs_mode", "hs_format", "hs_scope", "hs_last_n", "hs_final")
PAYLOAD_KEY = "hidden_states_payload"


def options_to_entry(opts: HiddenStatesOptions) -> dict:
    """Flatten validated options into JSON scalars for custom_params."""
    return {
        "hs_mode": opts.mode.value,
        "hs_format": opts.format.value,
        "hs_scope": opts.scope.value,
        "hs_last_n": opts.last_n,
        "hs_final": opts.final_row,
    }


def options_from_entry(entry: dict) -> Optional[HiddenStatesOptions]:
    if "hs_mode" not in entry:
        return None
    return HiddenStatesOptions(
        mode=HiddenStatesMode(entry["hs_mode"]),
        format=HiddenStatesFormat(entry["hs_format"]),
        scope=HiddenStatesScope(entry["hs_scope"]),
        last_n=entry.get("hs_last_n"),
        final_row=bool(entry.get("hs_final")),
    )


def join_prefill_chunks(pending: list[torch.Tensor], rows: torch.Tensor, last_chunk: bool) -> Optional[torch.Tensor]:
    """Collect one prefill chunk's rows in `pending`; on the last chunk, all of them as one block
    (pending is emptied). A middle chunk may be a view of its batch's rows: it is kept as a copy."""
    pending.append(rows if last_chunk else rows.clone())
    if not last_chunk:
        return None
    block = torch.cat(pending) if len(pending) > 1 else pending[0]
    pending.clear()
    return block


class RowCollector:
    """Rows of one request with their positions.

    FULL requests of scope all/response write rows into shared-memory files as they arrive
    (`RowSegments`), so finishing hands over a file handle instead of pickling megabytes through
    the detokenizer; LAST / last_n requests keep a few rows in memory. A rank that does not send
    outputs keeps no rows (`stores=False`) but still runs the deferred final step like the others.
    """

    takes_captured_rows = False  # the last layer's rows, also on an EAGLE3 target

    def __init__(self, options: HiddenStatesOptions, prompt_len: int,
                 max_new_tokens: Optional[int] = None, stores: bool = True) -> None:
        self.options = options
        self.prompt_len = prompt_len
        self.stores = stores
        # in-memory rows as (block, index) pairs, row = block[index]: a LAST request keeps a
        # reference into its decode step's host rows instead of copying its row out each step
        self.rows: list[tuple[torch.Tensor, int]] = []
        self.positions: list[int] = []
        self.segments: Optional[RowSegments] = None
        if stores and options.mode is HiddenStatesMode.FULL and options.scope is not HiddenStatesScope.LAST_N:
            expected = (prompt_len if options.scope is HiddenStatesScope.ALL else 1) + 1
            self.segments = RowSegments(expected + min(max_new_tokens or 256, 4096))
        self._prefill: list[torch.Tensor] = []
        self.deferred: Optional[tuple] = None
        self.final_step_done = False
        self.has_final_row = False
        self.done = False

    @property
    def takes_references(self) -> bool:
        """LAST rows are kept as references into the step's host rows (`add_step_rows`)."""
        return self.options.mode is HiddenStatesMode.LAST

    @property
    def needs_prompt_rows(self) -> bool:
        return self.options.mode is HiddenStatesMode.FULL and self.options.scope in (
            HiddenStatesScope.ALL, HiddenStatesScope.LAST_N)

    def prefix_limit(self) -> Optional[int]:
        """Longest prefix the radix cache may serve without dropping wanted prompt rows."""
        if not self.needs_prompt_rows:
            return None
        if self.options.scope is HiddenStatesScope.LAST_N:
            # the last N available rows end at L - 1 when nothing is generated (max_new_tokens=0),
            # later otherwise: recomputing from L - N - 1 covers every case
            return max(0, self.prompt_len - (self.options.last_n or 0) - 1)
        return 0

    def add_prefill(self, rows: torch.Tensor, last_chunk: bool, end: Optional[int] = None) -> None:
        """Rows of one prefill chunk; the chunks of a prefill end at position `end` (exclusive,
        default the prompt length). Callers skip collectors that do not store (`stores`)."""
        block = join_prefill_chunks(self._prefill, rows, last_chunk)
        if block is not None:
            end = self.prompt_len if end is None else end
            self._add(block, range(end - block.shape[0], end))

    def add_step_rows(self, rows: torch.Tensor, start: int, count: int, position: int) -> None:
        """LAST: rows `start .. start+count-1` of a decode step's host rows, at consecutive
        positions from `position`, kept by reference (the step's rows stay alive for at most a
        few steps, see `_trim`). Other scopes keep copies (`keep_block`), so a request never
        holds whole steps."""
        self.rows.extend((rows, start + j) for j in range(count))
        self.positions.extend(range(position, position + count))
        self._trim(count)

    def keep_run(self, kept: torch.Tensor, first: int, count: int, position: int) -> None:
        """Rows `kept[first:first+count]` of a step's kept rows (`add_decode_rows`), at positions
        from `position`."""
        self.keep_block(kept[first:first + count], position)

    def keep_block(self, block: torch.Tensor, position: int) -> None:
        """Rows of this request (`[count, H]`, a copy sglang will not reuse, possibly a view of
        one copy that other requests of the same step share) at consecutive positions from
        `position`, kept in memory."""
        count = block.shape[0]
        self.rows.extend((block, j) for j in range(count))
        self.positions.extend(range(position, position + count))
        self._trim(count)

    def _add(self, block: torch.Tensor, positions: Any) -> None:
        if self._to_files(lambda segments: segments.append(block, positions)):
            return
        keep = self._keep()
        positions = list(positions)
        if keep is not None and len(positions) > keep:
            block, positions = block[-keep:], positions[-keep:]
        if positions:
            self.keep_block(block.clone(), positions[0])  # never hold a view of a whole batch's rows

    def _to_files(self, store: Callable[[RowSegments], None]) -> bool:
        """Run `store` on this request's files. False if it has none, or if shared memory just
        ran out (its rows then move to process memory, where the caller keeps the new ones)."""
        if self.segments is None:
            return False
        try:
            store(self.segments)
            return True
        except OSError as exc:
            _warn_shm_full(exc)
            self._to_memory()
            return False

    def _to_memory(self) -> None:
        """Shared memory ran out: keep this request's rows in process memory from now on."""
        rows, positions = read_rows(self.segments.handoff(), load=True)
        self.segments = None
        self.rows, self.positions = [(rows, j) for j in range(rows.shape[0])], positions

    def _keep(self) -> Optional[int]:
        """How many of the newest rows can still be wanted (None: all of them)."""
        if self.options.mode is HiddenStatesMode.LAST:
            return 1
        if self.options.scope is HiddenStatesScope.LAST_N:
            return self.options.last_n
        return None

    def _trim(self, added: int) -> None:
        """Drop rows that can no longer be wanted. The newest `added` rows (one step's) are all
        kept: under speculative decoding a step's last rows may lie past the finish, which sglang
        only decides afterwards, so the wanted row can be up to `added - 1` rows back."""
        keep = self._keep()
        if keep is None:
            return
        slack = max(TRIM_SLACK, added)
        if len(self.rows) > keep + 2 * slack:
            del self.rows[:-(keep + slack)], self.positions[:-(keep + slack)]

    def finish(self, output_len: int) -> dict:
        """The delivery payload: wanted positions plus the rows (a file handle, or inline)."""
        self.done = True
        if output_len == 0:
            # a prefill-only request (max_new_tokens=0): the prefill fed every token, the last one
            # included, so the row of position L-1 exists like a final row
            self.has_final_row = True
        wanted = select_positions(self.prompt_len, output_len, self.options, self.has_final_row)
        payload = {"format": self.options.format.value, "wanted": wanted}
        if self.segments is not None:
            payload["handle"] = self.segments.handoff()
        else:
            index = {p: i for i, p in enumerate(self.positions)}
            keep = [index[p] for p in wanted if p in index]
            payload["rows"] = torch.stack([block[j] for block, j in (self.rows[i] for i in keep)]) if keep else None
            payload["positions"] = [self.positions[i] for i in keep]
        self.rows, self.positions = [], []
        return {PAYLOAD_KEY: payload}

    def discard(self) -> None:
        """Drop the rows without delivering them (the request was aborted)."""
        self.done = True
        if self.segments is not None:
            self.segments.discard()
        self.rows, self.positions = [], []


def add_decode_rows(items: list[tuple[RowCollector, int, int, int]], rows: torch.Tensor) -> None:
    """One decode step's rows (host `[n, H]`): item `(collector, start, count, position)` gives
    the collector rows `start .. start+count-1` at positions `position ..` (count > 1 when a
    speculative step commits several tokens).

    Collectors with files get their rows as one numpy copy from a single host view of the whole
    step (a tensor op per request and row cost ~25 us, i.e. ~10% of a 64-request 8B decode step);
    LAST collectors take references (`add_step_rows`); the other in-memory ones (last_n, and
    co-training's windows) share one copy of the step's rows, taken in one `index_select` instead
    of a copy per request, and each keeps its run of it (`keep_run`; benchmark/bench_cotrain_host.py)."""
    view = None
    copied: list[tuple[RowCollector, int, int, int]] = []
    for collector, start, count, position in items:
        if collector.segments is not None:
            if view is None:
                view = host_view(rows)
            if collector._to_files(lambda segments: segments.append_host(
                    view[start:start + count], range(position, position + count), rows.dtype)):
                continue
        if collector.takes_references:
            collector.add_step_rows(rows, start, count, position)
        else:
            copied.append((collector, start, count, position))
    if not copied:
        return
    index = torch.tensor([start + j for _, start, count, _ in copied for j in range(count)], device=rows.device)
    kept = rows.index_select(0, index)
    offset = 0
    for collector, _, count, position in copied:
        collector.keep_run(kept, offset, count, position)
        offset += count


_warned = False


def _warn_shm_full(exc: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("sglang-rl: no room for hidden-state rows in %s (%s); keeping rows in "
                       "process memory (slower handoff). Enlarge /dev/shm or set SGLANG_RL_SHM_DIR.",
                       shm_dir(), exc)


def finish_collectors(items: list[tuple[RowCollector, Any]]) -> None:
    """Hand the rows of every finishing request to its response (aborted ones are dropped)."""
    for collector, req in items:
        if isinstance(req.finished_reason, FINISH_ABORT):
            collector.discard()
            continue
        transport.post(req, **collector.finish(len(req.output_ids_through_stop)))


def encodes(payload: Any) -> bool:
    """Whether delivering this payload encodes rows to base64 (the costly format)."""
    return isinstance(payload, dict) and payload.get("format") == HiddenStatesFormat.BASE64.value


def deliver(payload: dict) -> dict:
    """API side: select the wanted rows and encode them in the requested format."""
    wanted = payload["wanted"]
    fmt = HiddenStatesFormat(payload["format"])
    if "handle" in payload:
        # tensors keep their mapped files; base64 and lists are encoded before this returns, so
        # they read into the delivering thread's reusable buffer
        encoded = fmt is not HiddenStatesFormat.TENSOR
        rows, positions = read_rows(payload["handle"], load=encoded, scratch=encoded)
    else:
        rows, positions = payload["rows"], payload["positions"]
    index = {p: i for i, p in enumerate(positions)}
    missing = [p for p in wanted if p not in index]
    if missing:
        return {ERROR_FIELD: f"rows for positions {missing[:8]} were not captured"}
    pick = [index[p] for p in wanted]
    if not pick:
        rows = torch.empty(0, rows.shape[-1] if rows is not None else 0)
    elif pick != list(range(pick[0], pick[0] + len(pick))):
        rows = rows.index_select(0, torch.tensor(pick))
    else:
        rows = rows[pick[0]:pick[0] + len(pick)]
    if fmt is HiddenStatesFormat.BASE64:
        return {ROWS_FIELD: encode_rows(rows, wanted)}
    if fmt is HiddenStatesFormat.TENSOR:
        return {ROWS_FIELD: rows, POSITIONS_FIELD: wanted}
    return {ROWS_FIELD: rows_to_list(rows), POSITIONS_FIELD: wanted}


def orphaned_output_before(manager: Any, recv_obj: Any) -> None:
    """BEFORE TokenizerManager._handle_batch_output: sglang drops an output whose request state
    is gone (its client went away while the output was in flight), so nobody would read that
    request's row files: unlink them now rather than at the writer's stale-file reaper."""
    rids = getattr(recv_obj, "rids", None) or ()
    gone = [i for i, rid in enumerate(rids) if rid not in manager.rid_to_state]
    info = getattr(recv_obj, "customized_info", None)
    if not gone or info is None:
        return None
    from sglang.srt.managers.io_struct import unwrap_from_pickle

    entries = (unwrap_from_pickle(info) or {}).get(transport.KEY) or []
    for i in gone:
        for payload in (entries[i] if i < len(entries) else None) or ():
            rows = payload.get(PAYLOAD_KEY) if isinstance(payload, dict) else None
            if isinstance(rows, dict) and isinstance(rows.get("handle"), dict):
                discard_handle(rows["handle"])
    return None
