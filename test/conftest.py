"""Shared fixtures: the default model and real sglang server processes on the CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))


@pytest.fixture(scope="session")
def model_path() -> str:
    from sglang_rl.default_model import ensure_default_model

    return str(ensure_default_model())


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
    """A `python -m sglang.launch_server` process on the CPU, stopped by `stop()`."""

    def __init__(self, model: str, *extra: str, env: dict | None = None, log_name: str = "server") -> None:
        log_dir = Path(os.environ.get("SGLANG_RL_TEST_LOGS", "/tmp/sglang-rl-test-logs"))
        log_dir.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **(env or {})}
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            # sglang picks its rendezvous port itself (bind, close, bind later): servers starting
            # together can pick the same one, so each gets its own from this session's ports.
            nccl_port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log_path = log_dir / f"{log_name}-{self.port}.log"
            cmd = [
                sys.executable, "-m", "sglang.launch_server", "--model-path", model,
                "--device", "cpu", "--attention-backend", "torch_native",
                "--max-total-tokens", "16384", "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(self.port), "--nccl-port", str(nccl_port),
                "--log-level", "warning", *extra,
            ]
            self._log = open(self.log_path, "w")
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True)
            try:
                self._wait_healthy()
                return
            except _PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise

    def _wait_healthy(self, timeout: float = 420.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(line in self.log_path.read_text() for line in PORT_TAKEN):
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
            time.sleep(2)
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
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
        self._log.close()


@pytest.fixture(scope="session")
def toploc_server(model_path: str) -> Iterator[Server]:
    """The main test server: --toploc-verification, radix cache on, default chunked prefill."""
    server = Server(model_path, "--toploc-verification", log_name="toploc")
    yield server
    server.stop()

