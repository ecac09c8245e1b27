"""Proof jobs: chunks of the row store gathered into jobs, started without the scheduler waiting.

Chunks fill a few at a time, and every job costs the scheduler thread a flush of the staged rows,
a launch and a read-back, so chunks wait in one pending job (`PendingProofs`) that starts when it
is full, old enough, or due for finishing requests. A GPU server launches each job on its device
from the scheduler thread (`DeviceJob`, `device_prover.py`); a CPU server builds it in a
background proof thread (`ProofLauncher`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from sglang_rl.fingerprint.codec import FingerprintError
from sglang_rl.fingerprint.device_prover import DeviceProver, LaunchedProofs
from sglang_rl.fingerprint.proof import build_chunk_proofs
from sglang_rl.fingerprint.row_store import RowStore
from sglang_rl.fingerprint.settings import CHUNK_ROWS, FINISH_STEPS, JOB_CHUNKS, JOB_STEPS


class DeviceJob(Future):
    """A proof job of a GPU server: launched on the device by the scheduler thread itself (a
    second Python thread would fight the busy scheduler for the GIL at each of its ops), and
    completed by whichever scheduler-thread call first finds it done (`done`) or waits (`result`).
    Its slots may be written again once it is launched: the writes queue behind its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: Optional[LaunchedProofs] = None
        self._finish: Optional[Callable[[list[bytes]], Any]] = None

    def attach(self, launched: LaunchedProofs, finish: Callable[[list[bytes]], Any]) -> None:
        """The job is on the device; `finish(proofs)` gives the result once its proofs are back."""
        self.launched, self._finish = launched, finish

    def _complete(self, wait: bool) -> None:
        if Future.done(self) or self.launched is None or not (wait or self.launched.ready()):
            return
        try:
            self.set_result(self._finish(self.launched.proofs()))
        except BaseException as exc:  # noqa: BLE001 - the waiting requests report it
            self.set_exception(FingerprintError(f"proof job failed: {exc!r}"))

    def done(self) -> bool:
        self._complete(wait=False)
        return super().done()

    def result(self, timeout: Optional[float] = None) -> Any:
        if self.launched is None and not Future.done(self):
            raise FingerprintError("a proof job was waited for before it was started")
        self._complete(wait=True)
        return super().result(timeout)


class Chunk:
    """A chunk of one request: its row slot and row count (32 but for the last chunk of a
    finished request), the job that will read it (the pending job's future, set when the chunk
    is queued) and its proof once built. `released`: the slot went back to the store (freed
    once that job is done, so its rows stay readable until then)."""

    __slots__ = ("slot", "rows", "job", "proof", "released")

    def __init__(self, slot: int, rows: int = CHUNK_ROWS) -> None:
        self.slot = slot
        self.rows = rows
        self.job: Optional[Future] = None
        self.proof: Optional[bytes] = None
        self.released = False

    def wait(self) -> bytes:
        """The proof, waiting for the job that builds it."""
        if self.proof is None and self.job is not None:
            self.job.result()
        if self.proof is None:
            raise FingerprintError("a full chunk was left without a proof")
        return self.proof


class ProofLauncher:
    """Starts the proof jobs of one row store: a GPU server's `prover` launches them on its
    device from the caller's thread; without one they are built in a proof thread of their own
    (started on first use)."""

    def __init__(self, store: RowStore, prover: Optional[DeviceProver] = None) -> None:
        self.store = store
        self.prover = prover
        self._thread: Optional[ThreadPoolExecutor] = None

    def proof_thread(self) -> ThreadPoolExecutor:
        """The single background thread that builds a CPU server's proofs."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-rl-toploc")
        return self._thread

    def new_job(self) -> Future:
        """The future of a job about to gather chunks."""
        return DeviceJob() if self.prover is not None else Future()

    def start(self, future: Future, parts: list[tuple[int, int]], topk: int,
              finish: Callable[[list[bytes]], Any]) -> None:
        """Start the proofs of store chunks `parts` ((slot, rows) each); `future` gets
        `finish(proofs)`. A GPU server launches them here, on the device (`DeviceJob`); a CPU
        server's proof thread builds them from the host store."""
        store = self.store
        store.flush()
        prover = self.prover
        if prover is not None:
            try:  # the launch runs on the prover's stream
                launched = prover.launch(store.data, [slot for slot, _ in parts], [rows for _, rows in parts], topk)
            except Exception as exc:  # noqa: BLE001 - never the scheduler's end: the waiting requests report it
                future.set_exception(FingerprintError(f"proof job failed to start: {exc!r}"))
                return
            future.attach(launched, finish)
            return
        chunks = [store.data[slot, :rows] for slot, rows in parts]  # chunks of one size share a top-k

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(finish(build_chunk_proofs(chunks, topk)))
            except BaseException as exc:  # noqa: BLE001 - the waiting requests report it
                future.set_exception(FingerprintError(f"proof job failed: {exc!r}"))

        self.proof_thread().submit(job)


class PendingProofs:
    """Chunks waiting for their proof job. Chunks fill a few at a time (every step under
    speculative decoding), and every job costs the scheduler thread a flush of the staged rows,
    a launch and a read-back (a few hundred us on a GPU server's host, whatever its size), so
    chunks are gathered into one job of up to `max_chunks` chunks, started at the latest
    `max_steps` steps after its first chunk (defaults: `JOB_CHUNKS` and `JOB_STEPS` on a GPU
    server; 64 and 1 on a CPU server, where a proof costs per chunk, in numpy, rather than per
    job, so holding chunks back only makes finishing outputs wait longer). The last, partial
    chunks of finishing requests join the same job, which then starts within `finish_steps`
    steps (default: `FINISH_STEPS` on a GPU server, at once on a CPU server; `due`): requests
    finish a few at a time over many steps, and a job of their own at each of those steps cost
    more host time than the rest of TOPLOC together. A queued chunk knows its job's future at
    once: its slot stays lent until that job is done. `on_gpu`: whether the server's defaults are
    a GPU server's."""

    def __init__(self, launcher: ProofLauncher, on_gpu: bool = False, max_chunks: Optional[int] = None,
                 max_steps: Optional[int] = None, finish_steps: Optional[int] = None) -> None:
        self.launcher = launcher
        self.on_gpu = on_gpu
        self.max_chunks = max_chunks
        self.max_steps = max_steps
        self.finish_steps = finish_steps
        self.future: Optional[Future] = None
        self.queue: list[Chunk] = []
        self.topk = 0
        self._steps = 0
        self._due: Optional[int] = None  # the step by which finishing requests need the job

    def _limits(self) -> tuple[int, int, int]:
        """(max_chunks, max_steps, finish_steps) in force: those given, else this server's
        defaults. 0 leaves the first two unset; a finish_steps of 0 means at once."""
        on_gpu = self.on_gpu
        finish_steps = self.finish_steps
        if finish_steps is None:
            finish_steps = FINISH_STEPS if on_gpu else 0
        return (self.max_chunks or (JOB_CHUNKS if on_gpu else 64),
                self.max_steps or (JOB_STEPS if on_gpu else 1), finish_steps)

    def add(self, chunk: Chunk, topk: int) -> None:
        """Queue a chunk for the next job."""
        if self.future is None:
            self.future, self.queue, self._steps, self._due = self.launcher.new_job(), [], 0, None
        self.topk = topk
        chunk.job = self.future
        self.queue.append(chunk)

    def due(self) -> None:
        """Finishing requests wait for the queued job: start it within `finish_steps` steps."""
        if self.future is None:
            return
        steps = self._limits()[2]
        if steps <= 0:
            self.flush()
            return
        due = self._steps + steps
        self._due = due if self._due is None else min(self._due, due)

    def take(self, chunks: list[Chunk]) -> list[Chunk]:
        """Remove those of `chunks` still queued (their owner proves them, or needs no proof);
        returns them, in the order given. They no longer wait for a job; slots lent to the job
        stay lent until `settle` or the job, so the owner can still read them. A queued chunk is
        one whose job is the queue's future, so a request with nothing queued (most requests
        that give their slots back) costs no queue scan."""
        future = self.future
        if future is None:
            return []
        taken = [c for c in chunks if c.job is future]
        if taken:
            wanted = {id(c) for c in taken}
            self.queue = [c for c in self.queue if id(c) not in wanted]
            for chunk in taken:
                chunk.job = None
        return taken

    def settle(self) -> None:
        """Close a job that nothing is queued for any more: the slots lent to it come back."""
        if self.future is not None and not self.queue:
            self.future.set_result(None)
            self.future = None

    def step(self) -> None:
        """End of a scheduler step: start the job if it is full, old enough or due."""
        if self.future is None:
            return
        self._steps += 1
        max_chunks, max_steps, _ = self._limits()
        if (len(self.queue) >= max_chunks or self._steps >= max_steps
                or (self._due is not None and self._steps >= self._due)):
            self.flush()

    def flush(self) -> None:
        """Start the job of the queued chunks now."""
        future, chunks = self.future, self.queue
        if future is None:
            return
        self.future, self.queue = None, []
        if not chunks:
            future.set_result(None)
            return
        def assign(proofs: list[bytes]) -> None:
            for chunk, proof in zip(chunks, proofs):
                chunk.proof = proof

        self.launcher.start(future, [(chunk.slot, chunk.rows) for chunk in chunks], self.topk, assign)
