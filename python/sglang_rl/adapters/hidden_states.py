"""Scheduler side of hidden-state delivery for EAGLE co-training.

A request that uses the sglang-rl fields (format / scope / last_n / final row) raises only its
own CaptureHiddenMode and never sets upstream's `return_hidden_states`, so no per-token
`.tolist()` runs. Its rows (already copied to host by sglang with the batch results) are kept as
tensors, tagged with their token positions, and encoded once when the request finishes:
raw little-endian bytes in base64, upstream-style lists, or tensors for the in-process Engine.

Positions: the row at position p is the lm_head input computed with token p as input. Prefill
rows cover [L - R, L) (R rows computed; the prefix cache is capped so scope "all" recomputes the
prompt); decode rows sit at L + len(output_ids) - 1. The final token's row (never computed by
plain decoding) comes from one deferred finish: the request runs one extra decode step on its
own KV cache, the extra sampled token is cut by sglang's finished_len.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

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

# custom_params["sglang_rl"] keys
KEYS = ("hs_mode", "hs_format", "hs_scope", "hs_last_n", "hs_final")
ROWS_FIELD = "hidden_states"
POSITIONS_FIELD = "hidden_states_positions"


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


class RowCollector:
    """Rows of one request with their positions, bounded for last_n / LAST requests."""

    def __init__(self, options: HiddenStatesOptions, prompt_len: int) -> None:
        self.options = options
        self.prompt_len = prompt_len
        self.rows: list[torch.Tensor] = []
        self.positions: list[int] = []
        self._prefill: list[torch.Tensor] = []
        self.deferred: Optional[tuple] = None
        self.final_step_done = False
        self.has_final_row = False
        self.done = False

    @property
    def needs_prompt_rows(self) -> bool:
        return self.options.mode is HiddenStatesMode.FULL and self.options.scope in (
            HiddenStatesScope.ALL, HiddenStatesScope.LAST_N)

    def prefix_limit(self) -> Optional[int]:
        """Longest prefix the radix cache may serve without dropping wanted prompt rows."""
        if not self.needs_prompt_rows:
            return None
        if self.options.scope is HiddenStatesScope.LAST_N:
            return max(0, self.prompt_len - (self.options.last_n or 0))
        return 0

    def add_prefill(self, rows: torch.Tensor, last_chunk: bool) -> None:
        self._prefill.append(rows)
        if last_chunk:
            block = torch.cat(self._prefill) if len(self._prefill) > 1 else self._prefill[0]
            self._prefill = []
            start = self.prompt_len - block.shape[0]
            self.rows.extend(block)
            self.positions.extend(range(start, self.prompt_len))
            self._trim()

    def add_decode(self, row: torch.Tensor, position: int) -> None:
        self.rows.append(row)
        self.positions.append(position)
        self._trim()

    def _trim(self) -> None:
        keep = None
        if self.options.mode is HiddenStatesMode.LAST:
            keep = 1
        elif self.options.scope is HiddenStatesScope.LAST_N:
            keep = self.options.last_n
        if keep is not None and len(self.rows) > 2 * keep + 64:
            del self.rows[:-keep], self.positions[:-keep]

    def finish(self, output_len: int) -> dict:
        """Select the scope's rows and encode them in the requested format."""
        self.done = True
        wanted = select_positions(self.prompt_len, output_len, self.options, self.has_final_row)
        index = {p: i for i, p in enumerate(self.positions)}
        missing = [p for p in wanted if p not in index]
        if missing:
            return {"hidden_states_error": f"rows for positions {missing[:8]} were not captured"}
        rows = (torch.stack([self.rows[index[p]] for p in wanted]) if wanted
                else torch.empty(0, self.rows[0].shape[-1] if self.rows else 0))
        self.rows, self.positions = [], []
        fmt = self.options.format
        if fmt is HiddenStatesFormat.BASE64:
            return {ROWS_FIELD: encode_rows(rows, wanted)}
        if fmt is HiddenStatesFormat.TENSOR:
            return {ROWS_FIELD: rows.clone(), POSITIONS_FIELD: wanted}
        return {ROWS_FIELD: rows_to_list(rows), POSITIONS_FIELD: wanted}


def finish_collectors(items: list[tuple[RowCollector, Any]]) -> None:
    """Post the selected, encoded rows of every finishing request to its response."""
    for collector, req in items:
        payload = collector.finish(len(req.output_ids_through_stop))
        transport.post(req, **payload)
