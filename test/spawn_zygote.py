"""Spawned sglang processes without a fresh interpreter's imports, for the test servers.

sglang starts its scheduler and detokenizer with multiprocessing's spawn: each is a fresh
interpreter that imports sglang again before it runs (`python -c "import
sglang.srt.managers.scheduler"`: ~9 CPU-seconds on the 2-core test machine, the detokenizer the
same), ~18 of a CPU server start's ~35 CPU-seconds.

A zygote keeps that import state ready. Forked by a test server's launcher before sglang's
plugins load, it imports what a spawned scheduler or detokenizer imports before it loads them,
and nothing else. The launcher's spawns of those processes run `CLIENT` instead of a fresh
interpreter: it asks the zygote for a child, hands it its standard streams and the descriptors
spawn passed, and mirrors it (signals in, exit code out). The child runs multiprocessing's own
`spawn_main` on those pipes, so it unpickles and runs the same target in the same import state
as a spawned one, plugins loaded by that target as always. It is a grandchild of the launcher
(the zygote is its child), so stopping the server's process group stops it too.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

SOCKET_ENV = "SGLANG_RL_TEST_ZYGOTE"
# the processes sglang's launcher spawns (module, function): the zygote's children. Anything else
# it spawns (a plugin's process that watches its parent's pid) is spawned as always.
TARGETS = {("sglang.srt.managers.scheduler", "run_scheduler_process"),
           ("sglang.srt.managers.detokenizer_manager", "run_detokenizer_process"),
           ("sglang.srt.managers.data_parallel_controller", "run_data_parallel_controller_process")}
# what such a spawned process imports before its target runs: the targets' modules
PRELOAD = tuple(sorted({module for module, _ in TARGETS}))

CLIENT = r"""
import json, os, signal, socket, sys
argv = sys.argv[1:]
code = argv[argv.index("-c") + 1] if "-c" in argv else ""
if "spawn_main(" not in code:  # anything else multiprocessing starts (its resource tracker) runs as it would
    os.execv(REAL_PYTHON, [REAL_PYTHON, *argv])
def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
# what spawn handed this process: the pipes its command line names and those its pickled
# arguments name (a Connection's descriptor travels by number)
fds = sorted(fd for fd in map(int, os.listdir("/proc/self/fd")) if fd > 2 and is_open(fd))
conn = socket.socket(socket.AF_UNIX)
conn.connect(os.environ[SOCKET_ENV])
header = json.dumps({"code": code, "fds": [0, 1, 2, *fds], "env": dict(os.environ), "cwd": os.getcwd()})
socket.send_fds(conn, [header.encode() + b"\n"], [0, 1, 2, *fds])
def forward(signum, frame):
    try:
        conn.sendall(b"%d\n" % signum)
    except OSError:
        os._exit(128 + signum)
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(signum, forward)
reply = b""
while not reply.endswith(b"\n"):
    try:
        chunk = conn.recv(64)
    except InterruptedError:
        continue
    except OSError:  # the zygote is gone (its server stops): so is the process
        chunk = b""
    if not chunk:
        os._exit(1)
    reply += chunk
code = int(reply)
if code < 0:  # the process was killed by a signal: so is its mirror
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code & 0xFF)
"""


def write_client(folder: str) -> str:
    """The client script (an executable file) in `folder`; its path."""
    path = os.path.join(folder, "sglang-rl-spawn-client")
    text = (f"#!{sys.executable} -IS\nREAL_PYTHON = {sys.executable!r}\nSOCKET_ENV = {SOCKET_ENV!r}\n"
            + CLIENT)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.chmod(path + ".tmp", 0o755)
    os.replace(path + ".tmp", path)
    return path


def start(client: str, socket_path: str, preload: tuple = PRELOAD, targets: set = TARGETS) -> int:
    """Fork the zygote (from a launcher whose plugins are not loaded yet), importing `preload`, and
    make this process's spawns of `targets` go through it; returns the zygote's pid."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(socket_path)
    listener.listen(64)
    pid = os.fork()
    if pid == 0:
        try:
            _serve(listener, client, preload, targets)
        finally:
            os._exit(0)
    listener.close()
    os.environ[SOCKET_ENV] = socket_path
    _spawn_targets_with(client, targets)
    return pid


def _spawn_targets_with(client: str, targets: set) -> None:
    """Spawns of `targets` run `client` instead of a fresh interpreter (multiprocessing's spawn
    reads its executable as it builds each command line)."""
    from multiprocessing import popen_spawn_posix, spawn

    launch, python = popen_spawn_posix.Popen._launch, spawn.get_executable()

    def _launch(self, process_obj):
        target = getattr(process_obj, "_target", None)
        ours = (getattr(target, "__module__", None), getattr(target, "__name__", None)) in targets
        spawn.set_executable(client if ours else python)
        try:
            return launch(self, process_obj)
        finally:
            spawn.set_executable(python)

    popen_spawn_posix.Popen._launch = _launch


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _serve(listener: socket.socket, client: str, preload: tuple, targets: set) -> None:
    _die_with_parent()
    launcher = os.getppid()
    # a spawned process sends SIGQUIT to its parent when it fails: that parent is the launcher
    signal.signal(signal.SIGQUIT, lambda *_: os.kill(launcher, signal.SIGQUIT))
    import importlib

    for name in preload:
        importlib.import_module(name)
    children: dict[socket.socket, int] = {}
    while os.getppid() == launcher:
        readable, _, _ = select.select([listener, *children], [], [], 0.2)
        for conn in readable:
            if conn is listener:
                child_conn, _ = listener.accept()
                children[child_conn] = _fork_child(listener, child_conn, children, client, targets)
                continue
            data = conn.recv(64)
            if not data:  # the client is gone (killed): so is its process
                _signal(children.pop(conn), signal.SIGKILL)
                conn.close()
                continue
            for line in data.split(b"\n"):
                if line.strip():
                    _signal(children[conn], int(line))
        _reap(children)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def exit_status(exc: SystemExit) -> int:
    """The process exit status a `sys.exit(...)` asks for, as the interpreter would make it."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def reaped():
    """(pid, exit code) of each child that has exited, without waiting for the others."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _reap(children: dict) -> None:
    for pid, code in reaped():
        for conn, child in list(children.items()):
            if child == pid:
                try:
                    conn.sendall(b"%d\n" % code)
                except OSError:
                    pass
                conn.close()
                del children[conn]


def _fork_child(listener: socket.socket, conn: socket.socket, children: dict, client: str, targets: set) -> int:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 64)
    while not message.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        message += chunk
    request = json.loads(message.decode())
    pid = os.fork()
    if pid != 0:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        listener.close()
        conn.close()
        for other in children:
            other.close()
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        # the client's descriptors at the numbers spawn gave them (its command line and pickled
        # arguments name them by number)
        import fcntl

        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
        for fd in fds:
            os.close(fd)
        for fd, target in zip(high, request["fds"]):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import random

        random.seed()  # not the zygote's sequence, which every child would share
        _spawn_targets_with(client, targets)  # a data-parallel controller's schedulers come from here too
        sys.argv = ["-c", "--multiprocessing-fork"]
        exec(compile(request["code"], "<spawn>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

