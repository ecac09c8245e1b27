"""Test servers forked from one interpreter that has imported sglang's launcher.

A CPU server start spends ~6 of its ~30 CPU seconds importing `sglang.launch_server` (`python -c
"import sglang.launch_server"`: 5.8-6.9 s on the 2-core test machine), and the suite starts ~25
servers. `LauncherFork` imports it once, in a process of its own, and forks a child per server
that runs `python -m sglang.launch_server`'s main with that server's arguments, environment and
log: the child loads sglang's plugins itself, at the same point as always (so their hooks reach
everything imported later). Its scheduler and detokenizer are started by sglang's spawn through a
zygote that has their imports ready (spawn_zygote.py; SGLANG_RL_TEST_FRESH_SPAWN=1: fresh
interpreters). sglang reads its environment when asked, not at import (`sglang.srt.environ`), so
a child's environment is its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Optional

FORK_SERVER = r"""
import json, os, runpy, select, sys, tempfile, traceback
sys.path.insert(0, sys.argv[1])
import spawn_zygote  # the standard library only
ZYGOTE_DIR = tempfile.mkdtemp(prefix="sglang-rl-zygote-")
CLIENT = spawn_zygote.write_client(ZYGOTE_DIR)
FRESH_SPAWN = "SGLANG_RL_TEST_FRESH_SPAWN"  # "1": a server's processes are spawned as sglang does it
# what a `python -m sglang.launch_server` has imported when its main loads the plugins, no more: a
# module imported here before the plugins' hooks are applied would keep the functions it imported
import sglang.launch_server  # noqa: F401
# not sglang's (a C module that retitles the process): set up now, while argv and environ lie as
# exec left them, it can retitle a child after the launcher replaced its environment
import setproctitle
setproctitle.getproctitle()


def report(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def reap():
    for pid, code in spawn_zygote.reaped():
        report({"exited": pid, "code": code})


def launch(request):
    # its own process group (killpg ends the server), in the tests' session: a session is a scheduler
    # autogroup, and niceness orders processes only within one (test/e2e/test_server_processes.py)
    os.setpgid(0, 0)
    os.nice(request.get("niceness", 0))  # inherited by everything the server starts
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["sglang.launch_server", *request["args"]]
    if os.environ.get(FRESH_SPAWN) != "1":
        spawn_zygote.start(CLIENT, os.path.join(ZYGOTE_DIR, f"{os.getpid()}.sock"))
    code = 0
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = spawn_zygote.exit_status(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


report({"ready": os.getpid()})
pending = b""
while True:
    readable, _, _ = select.select([0], [], [], 0.2)
    reap()
    if not readable:
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        break
    pending += chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            launch(request)
        report({"launched": request["id"], "pid": pid})
import shutil
shutil.rmtree(ZYGOTE_DIR, ignore_errors=True)
"""

READY_S = 300.0


class ForkedServerProcess:
    """A forked `launch_server` as the test server sees it: Popen's `pid`, `poll` and `wait`."""

    def __init__(self, fork: "LauncherFork", pid: int) -> None:
        self.fork, self.pid = fork, pid

    def poll(self) -> Optional[int]:
        return self.fork.exit_code(self.pid)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(["sglang.launch_server"], timeout)
            time.sleep(0.05)
        return code


class LauncherFork:
    """The fork server: `launch` sends it one server's arguments and gets the child's pid back;
    it reports each child's exit code as it reaps it."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER, os.path.dirname(os.path.abspath(__file__))],
                                     env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.ready = False
        self.pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True, name="launcher-fork-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "ready" in message:
                    self.ready = True
                elif "launched" in message:
                    self.pids[message["launched"]] = message["pid"]
                elif "exited" in message:
                    self.exits[message["exited"]] = message["code"]
                self.changed.notify_all()
        with self.changed:  # the fork server is gone: so is any report still to come
            self.changed.notify_all()

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: predicate() or self.proc.poll() is not None, timeout):
                raise RuntimeError(f"the launcher fork server did not report {what} within {timeout:.0f} s")
            if not predicate():
                raise RuntimeError(f"the launcher fork server exited ({self.proc.poll()}) before {what}")

    def launch(self, args: list[str], env: dict, log_path: str, niceness: int = 0) -> ForkedServerProcess:
        with self.lock:
            self.next_id += 1
            request_id = self.next_id
            request = {"id": request_id, "args": args, "env": env, "log": log_path, "niceness": niceness}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        self._wait_for(lambda: self.ready and request_id in self.pids, READY_S, "a launched server")
        return ForkedServerProcess(self, self.pids[request_id])

    def exit_code(self, pid: int) -> Optional[int]:
        with self.changed:
            if pid in self.exits:
                return self.exits[pid]
        if self.proc.poll() is not None:  # unreaped: it is this process's grandchild no more
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -1
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_FORK: Optional[LauncherFork] = None
_FORK_LOCK = threading.Lock()


def launcher_fork(env: dict) -> LauncherFork:
    """The session's fork server, started by the first server (`env`: what sglang may read as it
    is imported; each server brings its own environment)."""
    global _FORK
    with _FORK_LOCK:
        if _FORK is None or _FORK.proc.poll() is not None:
            _FORK = LauncherFork(env)
        return _FORK
