"""Shared fixtures: the default model and real sglang server processes on the CPU."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))

from launcher_fork import launcher_fork  # noqa: E402 - found through the path above
from random_model import ensure_random_model  # noqa: E402

# what sglang may read while the launcher fork server imports it (each server has its own environment)
SERVER_ENV = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


@pytest.fixture(scope="session")
def model_path() -> str:
    from sglang_rl.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="session")
def random_model_path() -> str:
    """The small random-weight model (random_model.py) of the servers whose spec says so."""
    return str(ensure_random_model())


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before in this session (the OS may give a port
    that was just closed to the next caller, and servers start in parallel)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


PORT_TAKEN = ("error while attempting to bind on address", "EADDRINUSE")
"""Log lines of a port taken between `free_port` and the bind, by another test server's ports
while servers start together: uvicorn's (the HTTP port; the rest of that server keeps running
without an HTTP front) and torch's (the rendezvous port). The server is stopped and started
again on other ports."""
PORT_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    pass


class Server:
    """A `python -m sglang.launch_server` process on the CPU, stopped by `stop()`; `niceness`:
    of the server's processes (every one it starts inherits it)."""

    def __init__(self, model: str, *extra: str, env: dict | None = None, log_name: str = "server",
                 niceness: int = 0) -> None:
        log_dir = Path(os.environ.get("SGLANG_RL_TEST_LOGS", "/tmp/sglang-rl-test-logs"))
        log_dir.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **(env or {})}
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            # sglang picks its rendezvous port itself (bind, close, bind later): servers starting
            # together can pick the same one, so each gets its own from this session's ports.
            nccl_port = free_port()
            # with --dp-size every replica would take the one --nccl-port given: sglang picks theirs
            rendezvous = () if "--dp-size" in extra else ("--nccl-port", str(nccl_port))
            self.url = f"http://127.0.0.1:{self.port}"
            self.log_path = log_dir / f"{log_name}-{self.port}.log"
            args = [
                "--model-path", model, "--device", "cpu", "--attention-backend", "torch_native",
                "--max-total-tokens", "16384", "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(self.port), *rendezvous,
                "--log-level", "warning", *extra,
            ]
            self._log = open(self.log_path, "w")
            # `python -m sglang.launch_server ARGS`, forked from an interpreter that imported it once
            self.proc = launcher_fork(SERVER_ENV).launch(args, full_env, str(self.log_path), niceness)
            LIVE.add(self)
            try:
                self._wait_healthy()
                return
            except _PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.stop()  # a server that never became healthy is not left running
                raise

    def _wait_healthy(self, timeout: float = 420.0) -> None:
        """Until /health_generate answers 200 from this server's process. Polled every 0.25 s:
        before sglang's warm-up request has finished it answers 503 at once, afterwards it takes
        ~1 s (it waits for a one-token generation), so a longer poll interval only adds idle time
        to every start."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(line in self.log_path.read_text(errors="replace") for line in PORT_TAKEN):
                self.stop()
                raise _PortTaken(f"a port was taken before the server bound it, see {self.log_path}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early, see {self.log_path}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if (requests.get(self.url + "/health_generate", timeout=30).status_code == 200
                        and self._listens()):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s, see {self.log_path}")

    def _listens(self) -> bool:
        """Whether the answer on the port came from this server (its process listens there), not
        from whatever took the port first."""
        import psutil

        try:
            connections = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in connections)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Stop the server and everything it started (idempotent).

        SIGTERM to the process group ends the scheduler and detokenizer (and a co-training
        process) at once; sglang's launcher, though, only acts on it at its SIGTERM watchdog's
        next look, up to 5 s later, to wait for them, which is all it would do; so once they are
        gone it is killed. Its multiprocessing resource tracker ignores SIGTERM and exits by
        itself (after removing any shared memory left behind) once the launcher is gone; a
        background thread waits for that and kills whatever of the group is still there after
        `GROUP_EXIT_S` (`stop_live_servers` waits for those threads)."""
        if self.proc.poll() is None:
            import psutil

            try:
                tree = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            workers = [p for p in tree if not _is_resource_tracker(p)]
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            _wait_gone(workers, timeout=STOP_GRACE_S)
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            reaper = threading.Thread(target=_reap_group, args=(self.proc.pid,), daemon=True)
            reaper.start()
            _REAPERS.append(reaper)
        if not self._log.closed:
            self._log.close()
        LIVE.discard(self)


STOP_GRACE_S = 10.0  # for the scheduler and detokenizer to exit on SIGTERM (they do at once)
GROUP_EXIT_S = 15.0
LIVE: set = set()
"""Servers started and not yet stopped (`stop_live_servers` ends them at the end of a session)."""
_REAPERS: list = []


def _is_resource_tracker(proc) -> bool:
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - gone already
        return False


def _gone(proc) -> bool:
    """Exited (a zombie has exited: its parent, sglang's launcher, does not reap it at once)."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_gone(procs: list, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not all(_gone(p) for p in procs):
        time.sleep(0.05)


def _reap_group(pgid: int) -> None:
    """Wait until nothing of the process group `pgid` runs; kill what still runs after GROUP_EXIT_S."""
    import psutil

    deadline = time.time() + GROUP_EXIT_S
    while True:
        members = [p for p in psutil.process_iter() if _pgid(p) == pgid and not _gone(p)]
        if not members:
            return
        if time.time() > deadline:
            for p in members:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            return
        time.sleep(0.2)


def _pgid(proc) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except OSError:
        return None


def stop_live_servers() -> None:
    """Stop every server still running and wait until their processes are gone."""
    for server in list(LIVE):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - best effort at the end of a session
            pass
    for reaper in list(_REAPERS):
        reaper.join(GROUP_EXIT_S + 5)


@pytest.fixture(scope="session")
def toploc_server(model_path: str) -> Iterator[Server]:
    """The main test server: --toploc-verification, radix cache on, default chunked prefill."""
    server = Server(model_path, "--toploc-verification", log_name="toploc")
    yield server
    server.stop()

