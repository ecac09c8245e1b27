"""Proofs of chunks kept in a device row store, launched from the caller's thread without waiting.

A serving loop that fingerprints its outputs must not wait for proofs, and on a host-bound loop
it must not hand the work to a second Python thread either: that thread needs the GIL for each
of its few hundred tensor ops, and behind a busy loop each acquisition can take milliseconds, so
its jobs fall seconds behind. Here the caller launches a job itself: the chunks are gathered from
the store into a static input, one CUDA graph of `proof_words` is replayed (a handful of host
ops in all), and the words are copied to page-locked host memory behind an event. `ready()` polls
that event; `proofs()` turns the words into toploc's bytes. Everything runs on one side stream,
so a slot of the store may be written again as soon as the job that reads it has been launched.

On a CPU device (tests, tools) a launch builds the proofs at once with the host algorithm, whose
top-k breaks ties in |x| exactly as toploc's CPU top-k does (a padded chunk's may not).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

from sglang_rl.fingerprint.proof import build_chunk_proofs, proof_words, proofs_from_words

logger = logging.getLogger(__name__)

BUCKETS = (8, 16, 32, 64)
"""Chunk counts with a graph of their own; a job is split into pieces of at most the largest."""


def device_index(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device`, copied there without the host waiting (from
    page-locked memory, on the current stream)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.long)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


class LaunchedProofs:
    """Proof words on their way to the host, ready once `event` has passed; or, from a CPU
    device, the proofs themselves (`built`)."""

    def __init__(self, words: list[torch.Tensor], topk: int, event: Any = None,
                 built: Optional[list[bytes]] = None) -> None:
        self._words = words
        self._topk = topk
        self._event = event
        self._built = built

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def proofs(self) -> list[bytes]:
        """The serialised proofs, in launch order (waits for the device if it is not done)."""
        if self._built is not None:
            return self._built
        self._event.synchronize()
        return [p for words in self._words for p in proofs_from_words(words, self._topk)]


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
    """One bucket's captured `proof_words`: static chunk and row-count inputs, static words out."""

    def __init__(self, chunks: torch.Tensor, rows: torch.Tensor, words: torch.Tensor, graph: Any) -> None:
        self.chunks, self.rows, self.words, self.graph = chunks, rows, words, graph


class DeviceProver:
    """Launches proof jobs over a [slots, R, H] store on `device`, on `stream` (CUDA)."""

    def __init__(self, device: torch.device, stream: Any = None, graphs: bool = True) -> None:
        self.device = device
        self.stream = stream
        self.use_graphs = graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int, tuple[int, ...]], _Graph] = {}
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
            plan = device_index([slots, rows], self.device)
            pieces = []
            largest = BUCKETS[-1]
            for start in range(0, len(slots), largest):
                count = min(largest, len(slots) - start)
                pieces.append(self._piece(store, plan[:, start : start + count], count, topk))
            event = torch.cuda.Event()
            event.record(self.stream)
        return LaunchedProofs(pieces, topk, event)

    def _piece(self, store: torch.Tensor, plan: torch.Tensor, count: int, topk: int) -> torch.Tensor:
        """Words of `count` chunks, copied into a fresh page-locked tensor (on the stream)."""
        graph = self._graph_for(count, store, topk) if self.use_graphs else None
        if graph is None:
            words = proof_words(store.index_select(0, plan[0]), plan[1], topk)
        else:
            torch.index_select(store, 0, plan[0], out=graph.chunks[:count])
            graph.rows[:count].copy_(plan[1])
            graph.graph.replay()
            words = graph.words[:count]
        host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
        host.copy_(words, non_blocking=True)
        return host

    def _graph_for(self, count: int, store: torch.Tensor, topk: int) -> Optional[_Graph]:
        bucket = next(b for b in BUCKETS if b >= count)
        key = (bucket, topk, tuple(store.shape[1:]))
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._graphs[key] = self._capture(bucket, store, topk)
            except Exception as exc:  # noqa: BLE001 - a graph is an optimisation: go on without
                logger.warning("TOPLOC proof graphs disabled, proofs run op by op: %r", exc)
                self.use_graphs = False
                return None
        return graph

    def _capture(self, bucket: int, store: torch.Tensor, topk: int) -> _Graph:
        """Capture `proof_words` for `bucket` chunks, on this stream only: the serving loop's
        other streams go on (thread-local capture, no device-wide synchronisation)."""
        chunks = torch.zeros((bucket, *store.shape[1:]), dtype=store.dtype, device=self.device)
        rows = torch.full((bucket,), store.shape[1], dtype=torch.int64, device=self.device)
        proof_words(chunks, rows, topk)  # warm-up: lazily built tables and library handles
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        try:
            words = proof_words(chunks, rows, topk)
        finally:
            graph.capture_end()
        return _Graph(chunks, rows, words, graph)
