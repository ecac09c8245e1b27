"""`--specforge-export-dir DIR`: an EAGLE3 server writes every finished rollout in SpecForge's
offline EAGLE3 data format, so a drafter can also be trained there.

One file per rollout, `DIR/dp<rank>-<n>.ckpt` (`torch.save` of a dict, written to a temporary
name and renamed, so a reader never sees half a file):
* `input_ids` int64 `[T]`: prompt + response without its last token (that token was never fed);
* `loss_mask` int64 `[T]`: 1 on the response's positions;
* `hidden_state` `[1, T, H]`: the target's last layer (SpecForge's training target);
* `aux_hidden_state` `[1, T, 3H]`: the auxiliary layers the EAGLE3 draft reads.
Rows are bfloat16, as SpecForge prepares them. They are gathered by the same prefill and decode
hooks as co-training's (`CotrainRows`, as long as the context), and the files are written by a
thread of the scheduler's export, off the serving loop.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sglang_rl.adapters.cotrain_rows import CotrainRows
from sglang_rl.adapters.request_state import kcbs_beam_of, kcbs_search_of, state_of
from sglang_rl.adapters.transport import sends_outputs

logger = logging.getLogger(__name__)

ATTR = "_sglang_rl_specforge_export"


class LastLayerRows(CotrainRows):
    """A rollout's last-layer rows (`CotrainRows` keeps the rows the draft reads)."""

    takes_captured_rows = False

    def prefix_limit(self) -> int:
        """A record covers the whole prompt: the radix cache serves none of it (both windows
        then get every prompt row)."""
        return 0


def record(aux: CotrainRows, last: CotrainRows) -> Optional[dict]:
    """The SpecForge record of a finished request's two row windows, or None when they do not
    cover the same tokens (a gap in either)."""
    aux_sample, last_sample = aux.sample(), last.sample()
    if aux_sample is None or last_sample is None or not torch.equal(aux_sample.input_ids, last_sample.input_ids):
        return None
    ids = aux_sample.input_ids
    loss_mask = torch.zeros_like(ids)
    loss_mask[aux_sample.response_start:] = 1
    return {"input_ids": ids, "loss_mask": loss_mask, "hidden_state": last_sample.rows.unsqueeze(0),
            "aux_hidden_state": aux_sample.rows.unsqueeze(0)}


class SpecForgeExport:
    """One scheduler's export: adopts the requests it queues, writes the finished ones."""

    def __init__(self, directory: str, window: int, dp_rank: int = 0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.window = window
        self.prefix = f"dp{dp_rank}"
        self.numbers = itertools.count(_first_free(self.directory, self.prefix))
        self.queue: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, name="sglang-rl-specforge-export", daemon=True)
        self.writer.start()
        atexit.register(self.close)

    def adopt(self, req: Any) -> None:
        """A generation the scheduler queues gets its two row windows (k-CBS beams and searches
        have no rows of their own); its prompt rows are wanted, so its capture mode is FULL."""
        state = state_of(req)
        if self in state.adopters or kcbs_beam_of(req) is not None or kcbs_search_of(req) is not None:
            return
        prompt = len(req.origin_input_ids)
        rows = (CotrainRows(prompt, self.window), LastLayerRows(prompt, self.window))
        state.add_rows(*rows)
        state.adopters[self] = rows
        req.return_hidden_states_mode = max(req.return_hidden_states_mode, CaptureHiddenMode.FULL)

    def finished(self, req: Any, rows: tuple[CotrainRows, LastLayerRows]) -> None:
        """A finished request: the record of its two row windows (`rows`) goes to the writer (an
        aborted one is dropped)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if rows[0].done:
            return
        for window in rows:
            window.close(req, 0)
        if isinstance(req.finished_reason, FINISH_ABORT):
            return
        made = record(*rows)
        if made is None:
            logger.warning("sglang-rl SpecForge export: request %s has a gap in its rows; not written", req.rid)
            return
        self.queue.put(made)

    def _write_loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            path = self.directory / f"{self.prefix}-{next(self.numbers):08d}.ckpt"
            try:
                torch.save(item, path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)
            except OSError:
                logger.exception("sglang-rl SpecForge export: %s not written", path)

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self.writer.is_alive():
            self.queue.put(None)
            self.writer.join(timeout=60)


def _first_free(directory: Path, prefix: str) -> int:
    """The next file number after those a previous run left in the folder."""
    taken = [int(p.stem.rsplit("-", 1)[1]) for p in directory.glob(f"{prefix}-*.ckpt")
             if p.stem.rsplit("-", 1)[1].isdigit()]
    return max(taken, default=-1) + 1


def export_of(scheduler: Any) -> Optional[SpecForgeExport]:
    return getattr(scheduler, ATTR, None)


# --- hooks ---------------------------------------------------------------------------------------


def scheduler_init_after(result: Any, scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: the export of a server started with --specforge-export-dir (on the
    rank that sends outputs; the other TP ranks hold the same rows)."""
    directory = getattr(server_args, "specforge_export_dir", None)
    if not directory or export_of(scheduler) is not None or not sends_outputs():
        return
    window = int(scheduler.model_config.context_len)
    setattr(scheduler, ATTR, SpecForgeExport(directory, window, scheduler.ps.dp_rank or 0))


def add_request_before(scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler._add_request_to_queue: the scheduler's export adopts the request."""
    export = export_of(scheduler)
    if export is not None:
        export.adopt(req)
