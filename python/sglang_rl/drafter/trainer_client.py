"""A server's side of a shared drafter trainer (`sglang-rl drafter trainer`): one connection.

Several rollout servers (verl's replicas are separate servers) can send their samples to one
trainer and receive every round it trains. :class:`RemoteTrainer` stands where the spawned
co-training process stands otherwise: its ``inbox`` and ``outbox`` keep the queue behaviour the
runtime relies on (a bounded ``put``/``put_nowait`` that never blocks the serving loop on the
network, ``get_nowait``), and ``is_alive()`` is the connection's state. When the connection
drops, the outbox yields one `Error` message and the server keeps its last draft.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from typing import Any

from sglang_rl.drafter.messages import FROM_TRAINER, Error, Stop

__all__ = ["AUTHKEY_ENV", "RemoteTrainer", "authkey_from_env", "check_trainer", "connect", "hang_up", "parse_address"]

# the environment variable holding the shared secret of servers and trainer
AUTHKEY_ENV = "SGLANG_RL_COTRAIN_AUTHKEY"
# used when the variable is unset: only accepted for a trainer listening on a loopback address
DEFAULT_AUTHKEY = b"sglang-rl-cotrain-local"
CONNECT_TIMEOUT = 5.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as a (host, port) pair; ValueError with the reason otherwise."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a trainer address is HOST:PORT (port 1..65535), got {text!r}")
    return host.strip("[]"), int(port)


def authkey_from_env(var: str = AUTHKEY_ENV) -> bytes:
    value = os.environ.get(var)
    return value.encode() if value else DEFAULT_AUTHKEY


def connect(address: str, authkey: bytes, timeout: float = CONNECT_TIMEOUT) -> Connection:
    """An authenticated connection to a trainer; ConnectionError naming the address and the
    reason (nothing answers, wrong key, not a trainer) within about ``timeout`` seconds."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ConnectionError(f"drafter trainer at {address} does not answer: {exc}") from None
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        # the trainer speaks first; a peer that says nothing is not a trainer
        if not conn.poll(timeout):
            raise ConnectionError("no handshake (is it an sglang-rl drafter trainer?)")
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except (AuthenticationError, ConnectionError, EOFError, OSError) as exc:
        conn.close()
        reason = f"authentication failed (same {AUTHKEY_ENV} on both sides?): {exc}" \
            if isinstance(exc, AuthenticationError) else str(exc) or type(exc).__name__
        raise ConnectionError(f"drafter trainer at {address}: {reason}") from None
    return conn


def check_trainer(address: str, authkey: bytes | None = None) -> None:
    """Connect once and hang up: a server refuses to start when its trainer does not answer
    (ValueError with the reason, as for any other bad option)."""
    try:
        connect(address, authkey_from_env() if authkey is None else authkey).close()
    except ConnectionError as exc:
        raise ValueError(f"--drafter-cotrain-trainer: {exc}") from None


def hang_up(conn: Connection) -> None:
    """Close a connection another thread may be reading: shut the socket down first (a plain
    close waits for that read to return, so the peer would never hear of it)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


class _Inbox(queue.Queue):
    """Bounded like the local inbox; a thread sends what is queued (a slow network never blocks
    the scheduler: when it falls behind, put_nowait raises queue.Full as the local queue does)."""

    alive = True

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, Stop):
            return  # the trainer is shared: one server leaving does not stop it
        if not self.alive:
            raise queue.Full  # nobody to send to: the caller counts it as skipped
        super().put(item, block, timeout)


class RemoteTrainer:
    """One server's connection to a shared trainer: ``inbox``, ``outbox`` and ``is_alive()``."""

    def __init__(self, address: str, maxsize: int, authkey: bytes | None = None) -> None:
        self.address = address
        self.conn = connect(address, authkey_from_env() if authkey is None else authkey)
        self.inbox: queue.Queue = _Inbox(maxsize=maxsize)
        self.outbox: queue.Queue = queue.Queue()
        self._alive = True
        self._closed = False
        threading.Thread(target=self._send_loop, name="sglang-rl-trainer-send", daemon=True).start()
        threading.Thread(target=self._recv_loop, name="sglang-rl-trainer-recv", daemon=True).start()

    def is_alive(self) -> bool:
        return self._alive

    def _lost(self, exc: BaseException) -> None:
        if self._alive and not self._closed:
            self.outbox.put(Error(f"drafter trainer at {self.address}: connection lost "
                                  f"({type(exc).__name__}: {exc}); serving with the last draft"))
        self._alive = self.inbox.alive = False

    def _send_loop(self) -> None:
        while self._alive:
            message = self.inbox.get()
            if message is None:
                return
            try:
                self.conn.send(message)
            except (OSError, EOFError, ValueError) as exc:
                self._lost(exc)

    def _recv_loop(self) -> None:
        while self._alive:
            try:
                message = self.conn.recv()
            except Exception as exc:  # noqa: BLE001 - EOF, reset, or a close from join()
                self._lost(exc)
                return
            if isinstance(message, FROM_TRAINER):
                self.outbox.put(message)

    def join(self, timeout: float | None = None) -> None:
        """Hang up (the runtime's shutdown); the trainer goes on serving the other servers."""
        self._closed = True
        self._alive = False
        queue.Queue.put(self.inbox, None)
        hang_up(self.conn)

    kill = join
