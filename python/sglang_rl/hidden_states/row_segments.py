"""Rows of one request in shared-memory files: written where they are computed, read where they
are delivered, never pickled in between.

A writer (the scheduler) appends rows to a chain of files in a shared-memory directory (default
`/dev/shm`, `SGLANG_RL_SHM_DIR` overrides). Each file's space is reserved with `posix_fallocate`
when it is created, so a full tmpfs is an `OSError` at that point (the caller falls back to keeping
rows in process memory) instead of a SIGBUS on a later write. Files grow by doubling, so a request
holds at most twice the rows it produced. `handoff()` returns a small picklable handle;
`read_rows(handle)` maps the files in another process of the same host, unlinks them and returns
one tensor. Files that no reader claims (a client that went away) are unlinked by the writer after
`STALE_AFTER_S`, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import tempfile
import threading
import time
from collections import deque
from typing import Any, Optional, Sequence

import numpy as np
import torch

from sglang_rl.hidden_states.packing import host_view

STALE_AFTER_S = 600.0
SCRATCH_MAX_BYTES = 32 << 20  # per delivery thread: reused read buffers stay below this
FIRST_CAPACITY_ROWS = 256

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_NAMES = {v: k for k, v in _DTYPES.items()}
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_counter = itertools.count()
_live: set[str] = set()
_handed: deque[tuple[float, list[str]]] = deque()
_scratch = threading.local()


def shm_dir() -> str:
    """Directory of the row files: a tmpfs where there is one."""
    configured = os.environ.get("SGLANG_RL_SHM_DIR")
    if configured:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reap(now: float) -> None:
    """Unlink handed-off files that no reader claimed within STALE_AFTER_S."""
    while _handed and now - _handed[0][0] > STALE_AFTER_S:
        for path in _handed.popleft()[1]:
            _unlink(path)


@atexit.register
def _unlink_all() -> None:
    for path in list(_live):
        _unlink(path)
    while _handed:
        for path in _handed.popleft()[1]:
            _unlink(path)


class RowSegments:
    """Append-only rows `[n, H]` of one request with their token positions."""

    def __init__(self, first_capacity: int = FIRST_CAPACITY_ROWS) -> None:
        self._first_capacity = max(1, first_capacity)
        self._files: list[list] = []  # [path, mapped rows as host_view [capacity, H], rows used]
        self.positions: list[int] = []
        self.dtype: Optional[torch.dtype] = None
        self.hidden = 0

    def __len__(self) -> int:
        return len(self.positions)

    def _new_file(self, min_rows: int) -> None:
        last_capacity = self._files[-1][1].shape[0] if self._files else self._first_capacity // 2
        capacity = max(min_rows, 2 * last_capacity)
        np_dtype = host_view(torch.empty(0, dtype=self.dtype)).dtype
        path = os.path.join(shm_dir(), f"sglang-rl-rows-{os.getpid()}-{next(_counter)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _live.add(path)
        size = capacity * self.hidden * np_dtype.itemsize
        try:
            os.posix_fallocate(fd, 0, size)
            # MAP_POPULATE maps every page now, in one call, instead of one fault per page on the
            # scheduler thread as rows arrive (a third of the decode-step cost of a 4096-wide row)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError:
            _live.discard(path)
            _unlink(path)
            raise
        finally:
            os.close(fd)
        view = np.frombuffer(mapped, dtype=np_dtype).reshape(capacity, self.hidden)
        self._files.append([path, view, 0])

    def append(self, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Copy `rows` `[n, H]` (any device) into the files; raises OSError if space runs out."""
        if rows.dim() == 1:
            rows = rows.unsqueeze(0)
        rows = rows.to(self.dtype or rows.dtype)
        self.append_host(host_view(rows), positions, rows.dtype)

    def append_host(self, view: np.ndarray, positions: Sequence[int], dtype: torch.dtype) -> None:
        """`append` for rows already on the host as `host_view(rows)` of `dtype`: the decode path
        converts a whole step once and hands each request its row, so a row costs one numpy copy
        and no tensor ops. The first call fixes the files' dtype and width."""
        if view.ndim == 1:
            view = view.reshape(1, -1)
        if self.dtype is None:
            if dtype not in _NAMES:
                raise ValueError(f"unsupported row dtype {dtype}")
            self.dtype, self.hidden = dtype, int(view.shape[1])
        done, n_rows = 0, view.shape[0]
        while done < n_rows:
            if not self._files or self._files[-1][2] == self._files[-1][1].shape[0]:
                self._new_file(n_rows - done)
            entry = self._files[-1]
            n = min(entry[1].shape[0] - entry[2], n_rows - done)
            entry[1][entry[2]:entry[2] + n] = view[done:done + n]
            entry[2] += n
            done += n
        self.positions.extend(positions)

    def handoff(self) -> dict[str, Any]:
        """Give the files up to a reader: returns the handle for `read_rows`."""
        paths = [path for path, _, _ in self._files]
        handle = {
            "files": [[path, used] for path, _, used in self._files],
            "dtype": _NAMES.get(self.dtype, "float32"),
            "hidden": self.hidden,
            "positions": list(self.positions),
        }
        self._files, self.positions = [], []
        _live.difference_update(paths)
        now = time.monotonic()
        _reap(now)
        if paths:
            _handed.append((now, paths))
        return handle

    def discard(self) -> None:
        """Free the files now (abort, or nothing to deliver)."""
        for path, _, _ in self._files:
            _live.discard(path)
            _unlink(path)
        self._files, self.positions = [], []


def read_rows(handle: dict[str, Any], load: bool = False,
              scratch: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Read the files of a handle (unlinking them) and return `(rows [n, H], positions)`.

    `load=False` maps the files: one file is returned without a copy (the tensor keeps the mapping
    alive), several are concatenated. `load=True` reads every file into one buffer with plain
    `readinto` calls, for consumers that touch every byte at once (base64, lists): first touches
    of freshly mapped shared memory fault page by page, which cost more than the copy.
    `scratch=True` (with `load`) reads into this thread's reusable buffer (`scratch_buffer`): the
    rows are then valid only until the thread's next scratch read, for a consumer that encodes
    them right away."""
    dtype = _DTYPES[handle["dtype"]]
    hidden = int(handle["hidden"])
    files = [(path, int(used)) for path, used in handle["files"] if used]
    try:
        if not files:
            rows = torch.empty(0, hidden, dtype=dtype)
        elif load:
            rows = _load(files, hidden, dtype, scratch)
        else:
            parts = [torch.from_file(path, shared=True, size=used * hidden, dtype=dtype).view(used, hidden)
                     for path, used in files]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    finally:
        discard_handle(handle)
    return rows, list(handle["positions"])


def scratch_buffer(nbytes: int) -> memoryview:
    """`nbytes` of this thread's reusable read buffer (a fresh one above SCRATCH_MAX_BYTES).

    Reading every delivery into a new buffer paid for faulting its pages in and for releasing it
    again, on every request; on the 16-core H200 host, 64 deliveries in 20 threads then took as
    long as in one (docs/design.md, section 8)."""
    if nbytes > SCRATCH_MAX_BYTES:
        return memoryview(bytearray(nbytes))
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _scratch.buf = bytearray(max(nbytes, 2 * len(buf or b"")))
    return memoryview(buf)[:nbytes]


def _load(files: list[tuple[str, int]], hidden: int, dtype: torch.dtype, scratch: bool = False) -> torch.Tensor:
    row_bytes = hidden * torch.empty(0, dtype=dtype).element_size()
    total = sum(used for _, used in files)
    view = scratch_buffer(total * row_bytes) if scratch else memoryview(bytearray(total * row_bytes))
    at = 0
    for path, used in files:
        end = at + used * row_bytes
        with open(path, "rb", buffering=0) as f:
            while at < end:
                got = f.readinto(view[at:end])
                if not got:
                    raise OSError(f"{path}: {end - at} bytes of hidden-state rows missing")
                at += got
    return torch.frombuffer(view, dtype=dtype).view(total, hidden)


def discard_handle(handle: dict[str, Any]) -> None:
    """Unlink the files of a handle without reading them."""
    for path, _ in handle.get("files", ()):
        _unlink(path)
