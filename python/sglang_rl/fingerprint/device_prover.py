"""Proofs of chunks kept in a device row store, launched from the caller's thread without waiting.

A serving loop that fingerprints its outputs must not wait for proofs, and on a host-bound loop
it must not hand the work to a second Python thread either: that thread needs the GIL for each
of its few hundred tensor ops, and behind a busy loop each acquisition can take milliseconds, so
its jobs fall seconds behind. Here the caller launches a job itself, in four host operations
per piece of up to 64 chunks: the job's plan (slots and row counts) goes to the device from
page-locked memory, one CUDA graph gathers those chunks from the store and runs `proof_words`,
the words come back to page-locked memory, and an event marks the end. `ready()` polls that
event; `proofs()` turns the words into toploc's bytes. Under EAGLE the scheduler thread is what
bounds the server, and each torch call costs it 10-30 us, so the gather is inside the graph (a
graph is captured per store tensor, and again if the store grows) and the page-locked buffers
are reused once their job has been read. Everything runs on one side stream, so a slot of the
store may be written again as soon as the job that reads it has been launched.

On a CPU device (tests, tools) a launch builds the proofs at once with the host algorithm, whose
top-k breaks ties in |x| exactly as toploc's CPU top-k does (a padded chunk's may not).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional, Sequence

import numpy as np
import torch

from sglang_rl.fingerprint.proof import build_chunk_proofs, proof_words, proofs_from_words

logger = logging.getLogger(__name__)

BUCKETS = (8, 16, 32, 64)
"""Chunk counts with a graph of their own; a job is split into pieces of at most the largest."""


def device_index(values: Sequence | np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` (a list, nested lists or an array) on `device`, copied there
    on the current stream without the host waiting for the device. numpy reads a list of ints in
    less than half the time `torch.tensor` takes (~20 against ~55 us for 1024). The copy is made
    from the array's own (pageable) memory: CUDA stages such a copy before the call returns, with
    no device synchronisation, so the array may go at once; on an H100 host that took ~40 us
    where page-locking it first and copying took ~90-105."""
    host = torch.from_numpy(np.asarray(values, dtype=np.int64))
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)


class _Buffers:
    """Page-locked host memory of one piece of a job: its plan (slots, then row counts) on the
    way in, its words on the way out. Reused once the words have been read (`_Piece.read`),
    when the device is done with both."""

    def __init__(self, bucket: int, width: int, rows: int) -> None:
        self.plan = torch.empty((2, bucket), dtype=torch.int64, pin_memory=True)
        self.words = torch.empty((bucket, width), dtype=torch.int64, pin_memory=True)
        self.plan_view = self.plan.numpy()
        self.plan_view[0] = 0  # the padding entries of a piece: slot 0, whole chunks (read, ignored)
        self.plan_view[1] = rows


class _Piece:
    """Words of `count` chunks on their way to the host: in `buffers` (given back to `free`
    once read) or, without a graph, in a page-locked tensor of their own."""

    __slots__ = ("words", "count", "buffers", "free")

    def __init__(self, words: torch.Tensor, count: int, buffers: Optional[_Buffers] = None,
                 free: Optional[list] = None) -> None:
        self.words, self.count, self.buffers, self.free = words, count, buffers, free

    def read(self, topk: int) -> list[bytes]:
        proofs = proofs_from_words(self.words[: self.count], topk)
        if self.buffers is not None:
            self.free.append(self.buffers)
            self.buffers = None
        return proofs


class LaunchedProofs:
    """Proof words on their way to the host, ready once `event` has passed; or, from a CPU
    device, the proofs themselves (`built`)."""

    def __init__(self, pieces: list[_Piece], topk: int, event: Any = None,
                 built: Optional[list[bytes]] = None) -> None:
        self._pieces = pieces
        self._topk = topk
        self._event = event
        self._built = built

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def proofs(self) -> list[bytes]:
        """The serialised proofs, in launch order (waits for the device if it is not done).
        Read once: the host buffers go back to the prover."""
        if self._built is None:
            self._event.synchronize()
            self._built = [p for piece in self._pieces for p in piece.read(self._topk)]
            self._pieces = []
        return self._built


class _OnStream:
    """Makes `stream` current (switching to its device if need be) and puts back the stream that
    was current: a lighter stand-in for `torch.cuda.device` + `torch.cuda.stream` in an
    ExitStack, which the scheduler thread would enter a few times per step."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.previous: Any = None

    def __enter__(self) -> None:
        self.previous = torch.cuda.current_stream()
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_stream(self.previous)


class _Graph:
    """One bucket's captured job over one store tensor: a static plan in (slots, row counts),
    the chunks gathered and `proof_words` run, static words out."""

    def __init__(self, plan: torch.Tensor, words: torch.Tensor, graph: Any) -> None:
        self.plan, self.words, self.graph = plan, words, graph


class DeviceProver:
    """Launches proof jobs over a [slots, R, H] store on `device`, on `stream` (CUDA)."""

    def __init__(self, device: torch.device, stream: Any = None, graphs: bool = True) -> None:
        self.device = device
        self.stream = stream
        self.use_graphs = graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int], _Graph] = {}  # by (bucket, topk), for `_store`
        self._store: Optional[tuple[int, tuple[int, ...]]] = None  # the store the graphs read
        self._free: dict[tuple[int, int], list[_Buffers]] = {}  # host buffers by (bucket, width)
        self._pool: Any = None

    def on_stream(self) -> Any:
        """The context for every use of the store: this stream (and its device)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return _OnStream(self.stream)

    def launch(self, store: torch.Tensor, slots: list[int], rows: list[int], topk: int) -> LaunchedProofs:
        """Start the proofs of chunk `slots[i]` of `store`, its first `rows[i]` rows each. The
        caller issues every write to `store` on this prover's stream, so later writes to these
        slots wait for this job's reads."""
        if self.device.type != "cuda":
            built = build_chunk_proofs([store[slot, :count] for slot, count in zip(slots, rows)], topk)
            return LaunchedProofs([], topk, built=built)
        with self.on_stream():
            pieces = []
            largest = BUCKETS[-1]
            for start in range(0, len(slots), largest):
                end = start + largest
                pieces.append(self._piece(store, slots[start:end], rows[start:end], topk))
            event = torch.cuda.Event()
            event.record(self.stream)
        return LaunchedProofs(pieces, topk, event)

    def _piece(self, store: torch.Tensor, slots: list[int], rows: list[int], topk: int) -> _Piece:
        """Launch the words of up to BUCKETS[-1] chunks (on the stream)."""
        count = len(slots)
        graph = self._graph_for(count, store, topk) if self.use_graphs else None
        if graph is None:
            plan = device_index([slots, rows], self.device)
            words = proof_words(store.index_select(0, plan[0]), plan[1], topk)
            host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
            host.copy_(words, non_blocking=True)
            return _Piece(host, count)
        bucket, width = graph.words.shape
        free = self._free.setdefault((bucket, width), [])
        buffers = free.pop() if free else _Buffers(bucket, width, store.shape[1])
        buffers.plan_view[0, :count] = slots
        buffers.plan_view[0, count:] = 0  # a padding slot from an earlier job may lie past this store
        buffers.plan_view[1, :count] = rows
        graph.plan.copy_(buffers.plan, non_blocking=True)
        graph.graph.replay()
        buffers.words.copy_(graph.words, non_blocking=True)
        return _Piece(buffers.words, count, buffers, free)

    def _graph_for(self, count: int, store: torch.Tensor, topk: int) -> Optional[_Graph]:
        identity = (store.data_ptr(), tuple(store.shape))
        if identity != self._store:  # a new store tensor (the store grew): the graphs read the old one
            if self._graphs:  # a replay may still run: its graph and memory pool go when it is done
                self.stream.synchronize()  # (a store grows a handful of times in a server's life)
            self._graphs.clear()
            self._pool = None  # their memory pool goes with them; a released pool cannot be captured into
            self._store = identity
        bucket = next(b for b in BUCKETS if b >= count)
        graph = self._graphs.get((bucket, topk))
        if graph is None:
            try:
                graph = self._graphs[(bucket, topk)] = self._capture(bucket, store, topk)
            except Exception as exc:  # noqa: BLE001 - a graph is an optimisation: go on without
                logger.warning("TOPLOC proof graphs disabled, proofs run op by op: %r", exc)
                self.use_graphs = False
                return None
        return graph

    def _capture(self, bucket: int, store: torch.Tensor, topk: int) -> _Graph:
        """Capture the gather and `proof_words` for `bucket` chunks of `store`, on this stream
        only: the serving loop's other streams go on (thread-local capture, no device-wide
        synchronisation)."""
        plan = torch.zeros((2, bucket), dtype=torch.int64, device=self.device)
        plan[1] = store.shape[1]

        def job() -> torch.Tensor:
            return proof_words(store.index_select(0, plan[0]), plan[1], topk)

        job()  # warm-up: lazily built tables and library handles
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        try:
            words = job()
        finally:
            graph.capture_end()
        return _Graph(plan, words, graph)
