"""Scheduler side of the hidden-state fields: each request's rows, kept until it finishes.

A request that uses the sglang-rl fields (format / scope / last_n / final row) raises only its
own CaptureHiddenMode and never sets upstream's `return_hidden_states`, so no per-token
`.tolist()` runs. Its rows arrive on the host with sglang's own batched, asynchronous copy of the
batch results (pinned memory). FULL rows are appended, tagged with their token positions, to the
request's shared-memory files; at finish the scheduler posts only a file handle (or the few rows
kept in memory), which the API process delivers (`adapters.hidden_states_api`).

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
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sglang_rl.adapters import transport
from sglang_rl.adapters.decode_step import DecodeStep
from sglang_rl.adapters.request_state import peek, state_of
from sglang_rl.hidden_states import HiddenStatesMode, HiddenStatesOptions, HiddenStatesScope, select_positions
from sglang_rl.hidden_states.options_entry import options_from_entry
from sglang_rl.hidden_states.prefill_chunks import join_prefill_chunks
from sglang_rl.hidden_states.row_segments import RowSegments, read_rows, shm_dir

logger = logging.getLogger(__name__)

TRIM_SLACK = 16  # in-memory rows kept beyond the wanted ones before a trim (see RowCollector._trim)
PAYLOAD_KEY = "hidden_states_payload"


def adopt(req: Any, options: dict, stores: bool) -> None:
    """A new request whose options ask for hidden states gets its collector (`stores`: this rank
    sends outputs)."""
    hs_options = options_from_entry(options)
    if hs_options is not None and hs_options.enabled:
        RowCollector(hs_options, len(req.origin_input_ids), req.sampling_params.max_new_tokens,
                     stores=stores).adopt(req)


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
        self.has_final_row = False
        self.done = False

    def adopt(self, req: Any) -> None:
        """The request's rows come here, and its finish (`finished`); its capture mode rises to
        what the options need."""
        needed = CaptureHiddenMode.FULL if self.needs_prompt_rows else CaptureHiddenMode.LAST
        req.return_hidden_states_mode = max(req.return_hidden_states_mode, needed)
        state = state_of(req)
        state.add_rows(self)
        state.adopters[self] = None

    def finished(self, req: Any, kept: Any = None) -> None:
        """Hand the rows to the response (an aborted request's are dropped)."""
        if self.done or not self.stores:
            return
        if isinstance(req.finished_reason, FINISH_ABORT):
            self.discard()
            return
        state = peek(req)
        if state is not None and state.final_row:
            self.has_final_row = True
        transport.post(req, **self.finish(len(req.output_ids_through_stop)))

    @property
    def wants_final_row(self) -> bool:
        """return_final_hidden_state: the request runs one extra decode step for this row."""
        return self.options.final_row

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

    def add_decode(self, step: DecodeStep, start: int, count: int, position: int) -> None:
        """Rows of a decode step: written to this request's files from the step's one host view,
        else kept by reference (LAST) or as a run of the step's one shared copy."""
        if self.segments is not None and self._to_files(lambda segments: segments.append_host(
                step.host_view()[start:start + count], range(position, position + count), step.rows.dtype)):
            return
        if self.takes_references:
            self.add_step_rows(step.rows, start, count, position)
        else:
            step.keep_copy(self.keep_run, start, count, position)

    def add_step_rows(self, rows: torch.Tensor, start: int, count: int, position: int) -> None:
        """LAST: rows `start .. start+count-1` of a decode step's host rows, at consecutive
        positions from `position`, kept by reference (the step's rows stay alive for at most a
        few steps, see `_trim`). Other scopes keep copies (`keep_block`), so a request never
        holds whole steps."""
        self.rows.extend((rows, start + j) for j in range(count))
        self.positions.extend(range(position, position + count))
        self._trim(count)

    def keep_run(self, kept: torch.Tensor, first: int, count: int, position: int) -> None:
        """Rows `kept[first:first+count]` of a step's shared copy (`DecodeStep.keep_copy`), at positions
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


_warned = False


def _warn_shm_full(exc: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("sglang-rl: no room for hidden-state rows in %s (%s); keeping rows in "
                       "process memory (slower handoff). Enlarge /dev/shm or set SGLANG_RL_SHM_DIR.",
                       shm_dir(), exc)
