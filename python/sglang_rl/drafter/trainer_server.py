"""One drafter trainer for several rollout servers: ``sglang-rl drafter trainer --listen HOST:PORT``.

The trainer runs the same co-training process a ``--drafter-cotrain`` server spawns
(:func:`cotrain_main` behind local queues) and bridges its queues to the servers that connect
with ``--drafter-cotrain-trainer HOST:PORT``: one thread per server feeds what it sends into the
inbox, one thread sends every outbox message (ready, round, held, error: drafter/messages.py) to
every connected server, and a server that connects later first gets the newest round. Engine-agnostic: no sglang import.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from typing import Any, Callable

from sglang_rl.drafter.cotrain import CotrainConfig, start_cotrain_process
from sglang_rl.drafter.messages import TO_SHARED_TRAINER, Error, Held, HubPort, Ready, Round, Sample
from sglang_rl.drafter.trainer_client import hang_up, parse_address

__all__ = ["TrainerHub", "hub_main", "is_loopback", "serve"]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class TrainerHub:
    """Connections of the servers, bridged to one co-training process's ``inbox``/``outbox``."""

    def __init__(self, listener: Listener, inbox: Any, outbox: Any,
                 log: Callable[[str], None] = print) -> None:
        self.listener = listener
        self.inbox = inbox
        self.outbox = outbox
        self.log = log
        self.lock = threading.Lock()  # guards the connection list and every send
        self.conns: dict[int, Connection] = {}
        self.latest: dict[type, Any] = {}  # the newest Ready and Round, for late joiners
        self.received = 0
        self.skipped_busy = 0
        self.next_id = 0
        self.stopped = False

    def start(self) -> "TrainerHub":
        threading.Thread(target=self._accept_loop, name="trainer-accept", daemon=True).start()
        threading.Thread(target=self._broadcast_loop, name="trainer-broadcast", daemon=True).start()
        return self

    @property
    def servers(self) -> int:
        with self.lock:
            return len(self.conns)

    def _accept_loop(self) -> None:
        while not self.stopped:
            try:
                conn = self.listener.accept()
            except Exception as exc:  # noqa: BLE001 - a failed handshake (wrong key) refuses that one only
                if self.stopped:
                    return
                self.log(f"trainer: refused a connection: {type(exc).__name__}: {exc}")
                continue
            with self.lock:
                cid, self.next_id = self.next_id, self.next_id + 1
                self.conns[cid] = conn
                for kind in (Ready, Round):
                    if kind in self.latest:
                        self._send(cid, self.latest[kind])
            self.log(f"trainer: server {cid} connected ({self.servers} connected)")
            threading.Thread(target=self._read_loop, args=(cid, conn), name=f"trainer-read-{cid}",
                             daemon=True).start()

    def _read_loop(self, cid: int, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except Exception:  # noqa: BLE001 - EOF, reset, or the hub closing
                break
            if not isinstance(message, TO_SHARED_TRAINER):
                continue
            try:
                self.inbox.put_nowait(message)
            except queue.Full:  # training is behind: skip, as a server's own bounded queue does
                self.skipped_busy += 1
                continue
            self.received += isinstance(message, Sample)
        with self.lock:
            self.conns.pop(cid, None)
        conn.close()
        self.log(f"trainer: server {cid} disconnected ({self.servers} connected)")

    def _send(self, cid: int, message: Any) -> None:
        """Send to one server (lock held); a server that cannot be reached is dropped."""
        conn = self.conns.get(cid)
        try:
            if conn is not None:
                conn.send(message)
        except (OSError, ValueError):
            self.conns.pop(cid, None)

    def broadcast(self, message: Any) -> None:
        with self.lock:
            if isinstance(message, (Ready, Round)):
                self.latest[type(message)] = message
            for cid in list(self.conns):
                self._send(cid, message)

    def _broadcast_loop(self) -> None:
        while not self.stopped:
            try:
                message = self.outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            except (OSError, EOFError, ValueError):
                return
            self.broadcast(message)
            match message:
                case Round(_, m):
                    self.log(f"trainer: round {m['round']}: loss {m['loss']:.4f}, top-1 {m['top1_agreement']:.3f}, "
                             f"{m['samples_used']} samples, {m['seconds']:.1f}s; sent to {self.servers} servers")
                case Held(metrics):
                    c = metrics["swap_check"]
                    self.log(f"trainer: round {c['round']} held by the swap check (scored {c['trained']:.3f} "
                             f"against the served drafter's {c['served']:.3f})")
                case Ready():
                    self.log("trainer: ready")
                case Error(text):
                    self.log(f"trainer: error: {text}")

    def close(self) -> None:
        self.stopped = True
        sock = getattr(getattr(self.listener, "_listener", None), "_socket", None)
        try:  # wake the accept() in progress (a plain close waits for it to return)
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for conn in self.conns.values():
                hang_up(conn)
            self.conns.clear()


def _start(config: CotrainConfig, host: str, port: int, authkey: bytes,
           log: Callable[[str], None]) -> tuple[Any, TrainerHub]:
    config.check()
    listener = Listener((host, port), authkey=authkey)
    process, inbox, outbox = start_cotrain_process(config, "sglang-rl-drafter-trainer")
    return process, TrainerHub(listener, inbox, outbox, log=log).start()


def _run(process: Any, hub: TrainerHub, parent: int = 0) -> int:
    """Until the co-training process ends, Ctrl-C, or (``parent`` set) that process is gone."""
    try:
        while process.is_alive():
            process.join(timeout=1.0)
            if parent and os.getppid() != parent:  # the server that started this hub was killed
                process.kill()
    except KeyboardInterrupt:
        process.kill()
        process.join()
    time.sleep(0.5)  # the broadcast thread forwards the process's last message (an error)
    hub.close()
    return 0 if process.exitcode in (0, -9) else 1


def serve(config: CotrainConfig, address: str, authkey: bytes,
          log: Callable[[str], None] = print) -> int:
    """Run a trainer until its co-training process ends (or Ctrl-C); the process exit code."""
    host, port = parse_address(address)
    process, hub = _start(config, host, port, authkey, log)
    log(f"trainer: listening on {host}:{hub.listener.address[1]}, {config.samples_per_round} samples per round")
    return _run(process, hub)


def hub_main(config: CotrainConfig, authkey: bytes, reply: Connection, parent: int) -> None:
    """Process entry of a server's own trainer hub (a server with several scheduler processes):
    listen on a free loopback port, send it through ``reply`` (`HubPort`, or an `Error`), and run
    until the server process ``parent`` is gone."""
    import traceback

    try:
        process, hub = _start(config, "127.0.0.1", 0, authkey, log=lambda line: None)
    except Exception:  # noqa: BLE001 - the server reports it and refuses to start
        reply.send(Error(traceback.format_exc()))
        return
    reply.send(HubPort(hub.listener.address[1]))
    reply.close()
    _run(process, hub, parent)


def flush_log(line: str) -> None:
    print(line, flush=True, file=sys.stdout)
