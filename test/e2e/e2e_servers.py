"""Starting real sglang servers for the end-to-end suite (see conftest.py for why the flags).

Every server of the suite is described once, by a `Spec` (its flags, environment, and how to
prepare what it serves: a drafter folder, a noisy model copy), and started by the session's `POOL`:

* shared: a spec is started once per pytest process, and every fixture that names it gets the
  same server (a `ServerHandle`), whichever module asks first;
* started ahead: the pool knows from the collected items which specs every test needs (the
  server fixtures in its fixture closure, `server_keys`). While one test runs it starts the
  servers the next tests need next, two starts at a time and while enough memory is free, at a
  lower priority than the server the test uses (AHEAD_NICENESS; back to 0 at the first use): a
  CPU server start keeps ~1.3 cores busy for ~25 s, and a test mostly keeps one core busy, so the
  other core starts the next servers meanwhile. While the next server may not start yet (two are
  starting, or memory is short) its prepare runs ahead. A test whose servers are not started yet
  when it begins has them all started at once;
* stopped when done: after each test, the servers no later test of the session needs are
  stopped (freeing memory for the next ones); the rest at the end of the session;
* memory: a start waits (MEMORY_WAIT_S at most) until one more server fits, as `make test` runs
  two pools side by side (conftest.py's `--e2e-part`).

A run of a single module gets the same servers, started when it needs them. After a session the
pool's log (what started when, how long a test waited) is in LOG_DIR/server-pool-PID.jsonl.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


def _root_conftest():
    """test/conftest.py as already imported by pytest (both files are named conftest.py)."""
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return module
    spec = importlib.util.spec_from_file_location("sglang_rl_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ROOT = _root_conftest()
Server = _ROOT.Server
SERVER_ENV = _ROOT.SERVER_ENV
launcher_fork = _ROOT.launcher_fork
ensure_random_model = _ROOT.ensure_random_model
free_port = _ROOT.free_port

E2E_FLAGS = ("--sleep-on-idle",)
LOG_DIR = Path(os.environ.get("SGLANG_RL_TEST_LOGS", "/tmp/sglang-rl-test-logs"))


# sglang torch.compiles a few small helpers of speculative decoding (the accepted-token filter and
# draft-token selection: integer arithmetic, gathers and top-k, which compute the same eagerly);
# on the CPU, dynamo and inductor cost ~10 CPU-seconds per EAGLE server start with a warm inductor
# cache, 10-20 s more on a fresh machine. EAGLE servers of the suite run them eagerly.
EAGER = {"TORCHDYNAMO_DISABLE": "1"}


# Popen arguments for a child in a process group of its own (killpg ends it and its children) in the
# tests' session, not a session of its own: a session is a scheduler autogroup, and niceness orders
# processes only within one (test/e2e/test_server_processes.py). Python 3.10's Popen has no
# process_group: there the child gets a session (and an autogroup) of its own
OWN_PROCESS_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def e2e_env(extra: dict | None = None) -> dict:
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra or {})}


def start_server(model: str, *extra: str, log_name: str, env: dict | None = None, niceness: int = 0) -> Server:
    return Server(model, *E2E_FLAGS, *extra, env=e2e_env(env), log_name=log_name, niceness=niceness)


# Resident memory of one CPU server of the default model (launcher + scheduler + detokenizer,
# measured ~2.7-3 GiB with the default KV cache) and what to leave free for everything else.
SERVER_GIB = 3.0
MARGIN_GIB = 2.0


def available_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


def one_more_server_fits() -> bool:
    """Whether one more server and the margin fit in the memory free now."""
    return available_gib() >= SERVER_GIB + MARGIN_GIB


# --------------------------------------------------------------------------------------------
# specs


@dataclass
class Prepared:
    """What a spec's `prepare` made: flags naming it, another model folder to serve, and data
    the tests of its module read back (`Pool.prepared_data`; JSON values and Paths)."""

    args: tuple = ()
    model: Optional[str] = None
    data: dict = field(default_factory=dict)


@dataclass
class Spec:
    """One server of the suite. `key` names it in the pool and in its log file.

    `prepare(model_path, workdir) -> Prepared`, a module-level function, makes what the server
    serves (a drafter folder, a model copy) once per session before the first start. It runs in
    a fresh interpreter (`run_prepare`), not in the pytest process: the pool prepares servers
    ahead, while other tests run, and building torch modules draws from torch's global
    generator (and a prepare may set torch's thread count), which must not change under them.
    `workdir` is removed at the end of the session.

    `polls_when_idle`: the server keeps a core busy while no request comes (sglang's
    data-parallel controller reads its socket in a loop that never sleeps,
    `DataParallelController.event_loop`). Started ahead, it waits for its first test at the lowest
    CPU priority, taking only cycles nothing else wants.

    `random_weights`: the server serves the suite's small random-weight model (test/random_model.py)
    instead of SmolLM2, for tests that need no real text."""

    key: str
    args: tuple = ()
    env: Optional[dict] = None
    prepare: Optional[Callable[[str, Path], Prepared]] = None
    polls_when_idle: bool = False
    random_weights: bool = False


def _encode(value: Any) -> Any:
    if isinstance(value, Path):
        return {"__path__": str(value)}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return Path(value["__path__"]) if set(value) == {"__path__"} else {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


_PREPARE_SCRIPT = """
import importlib.util, json, sys
from pathlib import Path
file, name, model, workdir = sys.argv[1:]
sys.path.insert(0, str(Path(file).parent))
spec = importlib.util.spec_from_file_location("e2e_prepare_" + Path(file).stem, file)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
prepared = getattr(module, name)(model, Path(workdir))
from e2e_servers import _encode
out = {"args": list(prepared.args), "model": prepared.model, "data": _encode(prepared.data)}
(Path(workdir) / "prepared.json").write_text(json.dumps(out))
"""


def run_prepare(prepare: Callable[[str, Path], Prepared], model_path: str, workdir: Path,
                niceness: int = 0) -> Prepared:
    """`prepare(model_path, workdir)` in a fresh interpreter (its module imported from its file)."""
    file = sys.modules[prepare.__module__].__file__
    run = subprocess.run(["nice", "-n", str(niceness), sys.executable, "-c", _PREPARE_SCRIPT, file, prepare.__name__,
                          model_path, str(workdir)],
                         env={**os.environ, **e2e_env()}, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"{prepare.__name__} of {file} failed:\n{(run.stdout + run.stderr)[-3000:]}")
    out = json.loads((workdir / "prepared.json").read_text())
    return Prepared(args=tuple(out["args"]), model=out["model"], data=_decode(out["data"]))


SPECS: dict[str, Spec] = {}


def register(spec: Spec) -> Spec:
    """Add a spec (once per key; registering the same key again must describe the same server)."""
    known = SPECS.get(spec.key)
    if known is not None and (known.args, known.env, known.random_weights) != (spec.args, spec.env,
                                                                               spec.random_weights):
        raise ValueError(f"two different servers named {spec.key!r}: {known} and {spec}")
    SPECS.setdefault(spec.key, spec)
    return SPECS[spec.key]


# --------------------------------------------------------------------------------------------
# the pool


MEMORY_WAIT_S = 300.0  # a start waits at most this long for memory another run's servers hold
MAX_UNUSED = 3  # servers started ahead that no test has used yet
MAX_STARTING = 2  # starts ahead at once (a start keeps ~1.3 cores busy, at AHEAD_NICENESS)
# memory free before a start ahead: that server and one more (make test's unit run, beside the two
# e2e runs, builds models of up to 2.6 GB: test_widen_smollm2)
PREFETCH_FREE_GIB = 2 * SERVER_GIB + MARGIN_GIB
# a start ahead (its prepare, then the server until a test first uses it) yields to the server a test is
# using (niceness 0) and takes the cycles before the unit tests (make test: nice -n 5)
AHEAD_NICENESS = 3


@dataclass
class _Entry:
    spec: Spec
    future: Future
    background: bool
    t_start: float
    niceness: int = 0
    t_ready: Optional[float] = None
    server: Optional[Server] = None
    used: bool = False
    released: bool = False
    waited_s: float = 0.0


class Pool:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._prepared: dict[str, Prepared] = {}
        self._prepare_locks: dict[str, threading.Lock] = {}
        self._workdirs: list[Path] = []
        self._model_path: Optional[str] = None
        self._plan: list[frozenset] = []  # per collected item: the spec keys it needs
        self._last_use: dict[str, int] = {}
        self._index = 0
        self._closed = False
        self._short_of_memory: Optional[str] = None
        self._preparing_ahead = False
        self.log: list[dict] = []

    # -- plan -----------------------------------------------------------------------------

    def set_plan(self, needs: list[frozenset]) -> None:
        """The keys each collected test needs, in run order; starts the first ones ahead."""
        with self._lock:
            self._plan = list(needs)
            self._last_use = {}
            for i, keys in enumerate(self._plan):
                for key in keys:
                    self._last_use[key] = i
            self._index = 0
        self._prefetch()

    def at_item(self, index: int) -> None:
        """Test `index` starts: the servers it needs and nobody started yet are started now, all
        at once (it waits for each of them anyway), then the next ones ahead."""
        with self._lock:
            self._index = index
            for key in sorted(self._plan[index]) if index < len(self._plan) else ():
                entry = self._entries.get(key)
                if key in SPECS and (entry is None or entry.released):
                    self._launch(key, background=False)
        self._prefetch()

    def after_item(self, index: int) -> None:
        """Stop the servers that no test after test `index` needs."""
        with self._lock:
            done = [key for key, entry in self._entries.items()
                    if not entry.released and self._last_use.get(key, -1) <= index and key in self._last_use]
        for key in done:
            self.release(key)
        self._prefetch()

    def _upcoming(self) -> list[str]:
        seen: dict[str, None] = {}
        for keys in self._plan[self._index:]:
            for key in sorted(keys):
                seen.setdefault(key, None)
        return list(seen)

    # -- starting -------------------------------------------------------------------------

    def model_path(self) -> str:
        return self._model()

    def _model(self) -> str:
        if self._model_path is None:
            from sglang_rl.default_model import ensure_default_model

            self._model_path = str(ensure_default_model())
        return self._model_path

    def _launch(self, key: str, background: bool) -> _Entry:
        """Start `key` in a thread (under the lock); at AHEAD_NICENESS if it is started ahead of
        the tests that need it (not for the test running now, which waits for it)."""
        spec = SPECS[key]
        now = self._plan[self._index] if self._index < len(self._plan) else frozenset()
        niceness = AHEAD_NICENESS if background and key not in now else 0
        entry = _Entry(spec, Future(), background, time.time(), niceness)
        self._entries[key] = entry
        self._event(key, "start ahead" if background else "start")
        thread = threading.Thread(target=self._run_start, args=(entry,), name=f"start-{key}", daemon=True)
        thread.start()
        return entry

    def _run_start(self, entry: _Entry) -> None:
        key = entry.spec.key
        try:
            prepared = self._prepare(entry.spec, entry.niceness)
            self._wait_for_memory(key)
            default = str(ensure_random_model()) if entry.spec.random_weights else self._model()
            server = start_server(prepared.model or default, *entry.spec.args, *prepared.args,
                                  log_name=key, env=entry.spec.env, niceness=entry.niceness)
            server.prepared = prepared.data
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the server
            entry.t_ready = time.time()
            self._event(key, "failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            entry.future.set_exception(exc)
        else:
            if entry.spec.polls_when_idle:  # no test has it yet: the future is not set
                set_priority(server, LOWEST_PRIORITY)
            with self._lock:
                entry.server, entry.t_ready = server, time.time()
                closed = self._closed or entry.released
            self._event(key, "ready", seconds=round(entry.t_ready - entry.t_start, 1))
            entry.future.set_result(server)
            if closed:  # the session ended (or the server was given up) while it started
                server.stop()
        self._prefetch()

    def _wait_for_memory(self, key: str) -> None:
        """Until one more server fits (`one_more_server_fits`), for at most MEMORY_WAIT_S: make
        test's two e2e runs start servers side by side, each pool unaware of the other's."""
        if one_more_server_fits():
            return
        self._event(key, "waits for memory", free_gib=round(available_gib(), 1))
        deadline = time.time() + MEMORY_WAIT_S
        while not one_more_server_fits() and time.time() < deadline and not self._closed:
            time.sleep(1.0)

    def _prepare(self, spec: Spec, niceness: int = 0) -> Prepared:
        with self._lock:
            lock = self._prepare_locks.setdefault(spec.key, threading.Lock())
        with lock:
            if spec.key not in self._prepared:
                if spec.prepare is None:
                    self._prepared[spec.key] = Prepared()
                else:
                    workdir = Path(tempfile.mkdtemp(prefix=f"sglang-rl-e2e-{spec.key}-"))
                    self._workdirs.append(workdir)
                    t0 = time.time()
                    self._prepared[spec.key] = run_prepare(spec.prepare, self._model(), workdir, niceness)
                    self._event(spec.key, "prepared", seconds=round(time.time() - t0, 1))
            return self._prepared[spec.key]

    def _prefetch(self) -> None:
        """Start the next server the remaining tests need, if fewer than MAX_STARTING are starting
        and than MAX_UNUSED started servers wait for their first test, and memory allows (for the
        starts under way too); if it may not start yet, run its prepare meanwhile."""
        with self._lock:
            if self._closed or not self._plan:
                return
            key = self._next_to_start()
            if key is None:
                return
            entries = [e for e in self._entries.values() if not e.released]
            starting = sum(1 for e in entries if not e.future.done())
            if starting < MAX_STARTING and sum(1 for e in entries if not e.used) < MAX_UNUSED:
                if available_gib() >= PREFETCH_FREE_GIB + starting * SERVER_GIB:
                    self._launch(key, background=True)
                    return
                if self._short_of_memory != key:
                    self._short_of_memory = key
                    self._event(key, "not started ahead: memory", free_gib=round(available_gib(), 1))
            self._prepare_ahead(key)

    def _next_to_start(self) -> Optional[str]:
        """The first server the remaining tests need that is not running or starting (None if
        there is none, or the plan was wrong: one stopped is needed again)."""
        for key in self._upcoming():
            entry = self._entries.get(key)
            if key not in SPECS or (entry is not None and not entry.released):
                continue
            return key if entry is None else None
        return None

    def _prepare_ahead(self, key: str) -> None:
        """Run `key`'s prepare in the background (one at a time; under the lock): what a start
        waits for least is a prepare that has already run (a drafter built, a model copied)."""
        spec = SPECS[key]
        if (spec.prepare is None or key in self._prepared or self._preparing_ahead
                or not one_more_server_fits()):
            return
        self._preparing_ahead = True

        def run() -> None:
            try:
                self._prepare(spec, AHEAD_NICENESS)
            except Exception:  # noqa: BLE001 - the start runs the prepare again and reports it
                pass
            finally:
                with self._lock:
                    self._preparing_ahead = False
            self._prefetch()

        threading.Thread(target=run, name=f"prepare-{key}", daemon=True).start()

    # -- handing out ----------------------------------------------------------------------

    def get(self, key: str) -> Server:
        """The running server of `key`: the one started ahead (waiting for its start to
        finish), or one started now. A start ahead that failed is tried once more here."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.released:
                entry = self._launch(key, background=False)
        t0 = time.time()
        try:
            server = entry.future.result()
        except Exception:
            if not entry.background:
                raise
            with self._lock:
                if self._entries.get(key) is entry:
                    entry = self._launch(key, background=False)
            server = entry.future.result()
        waited = time.time() - t0
        with self._lock:
            first = not entry.used
            if first:
                entry.used, entry.waited_s = True, waited
                self._event(key, "first use", waited=round(waited, 1))
        if first and (entry.niceness or entry.spec.polls_when_idle):
            set_priority(server, 0)
        return server

    def prepared_data(self, key: str) -> dict:
        """What the spec's `prepare` made (run now if it has not run yet), without the server."""
        return self._prepare(SPECS[key]).data

    def ensure_started(self, key: str) -> None:
        """Start `key` now in the background (if not started), e.g. while the caller computes
        what it needs the server for."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.released:
                self._launch(key, background=True)

    def release(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.released:
                return
            entry.released = True
            server = entry.server
        if server is not None:
            t0 = time.time()
            server.stop()
            self._event(key, "stopped", seconds=round(time.time() - t0, 2))

    def close(self) -> None:
        """Stop everything (end of the session) and remove the prepared folders."""
        with self._lock:
            self._closed = True
            keys = list(self._entries)
        for key in keys:
            self.release(key)
        _ROOT.stop_live_servers()
        for workdir in self._workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
        self._workdirs.clear()
        self._write_log()

    # -- what happened --------------------------------------------------------------------

    def _event(self, key: str, what: str, **values: Any) -> None:
        self.log.append({"t": round(time.time(), 2), "key": key, "event": what, **values})

    def summary(self) -> list[str]:
        """One line per server started in this session."""
        lines = []
        for key, entry in self._entries.items():
            start = (entry.t_ready - entry.t_start) if entry.t_ready else None
            lines.append(f"{key}: {'ahead' if entry.background else 'on demand'}, "
                         f"start {start:.0f}s" if start is not None else f"{key}: not finished")
            lines[-1] += f", test waited {entry.waited_s:.0f}s" if entry.used else ", never used"
        return lines

    def _write_log(self) -> None:
        if not self.log:
            return
        try:
            LOG_DIR.mkdir(parents=True, exist_ok=True)
            with open(LOG_DIR / f"server-pool-{os.getpid()}.jsonl", "w") as f:
                for event in self.log:
                    f.write(json.dumps(event) + "\n")
        except OSError:
            pass


LOWEST_PRIORITY = 19


def set_priority(server: Server, niceness: int) -> None:
    """Give every process of `server` this niceness (going back up to 0 needs root; without it
    the server keeps the lower priority, which only makes it slower)."""
    import psutil

    try:
        root = psutil.Process(server.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.nice(niceness)
        except (psutil.Error, OSError):
            pass


POOL = Pool()
atexit.register(POOL.close)


class ServerHandle:
    """What a server fixture gives a test: the pool's running server of one spec. Attribute
    reads go to that server (started again should the pool have stopped it, which it does only
    once no remaining test is expected to need it)."""

    def __init__(self, key: str) -> None:
        self.key = key
        POOL.get(key)

    @property
    def server(self) -> Server:
        return POOL.get(self.key)

    @property
    def url(self) -> str:
        return self.server.url

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.server, name)

    def stop(self) -> None:
        """Servers are stopped by the pool, when no test needs them any more."""

    def __repr__(self) -> str:
        return f"ServerHandle({self.key!r})"


def server_fixture(spec: Spec, scope: str = "session", doc: str = "",
                   on_use: Optional[Callable[[ServerHandle], None]] = None):
    """A pytest fixture giving the pool's server of `spec` (registered here); `on_use` runs when
    the fixture is set up. The pool learns which tests need which server from these fixtures
    (`server_keys`)."""
    import pytest

    register(spec)

    def fixture() -> ServerHandle:
        handle = ServerHandle(spec.key)
        if on_use is not None:
            on_use(handle)
        return handle

    fixture.__doc__ = doc or f"The suite's {spec.key!r} server: {' '.join(spec.args) or 'no extra flags'}."
    fixture._e2e_server_key = spec.key
    return pytest.fixture(scope=scope)(fixture)


USES_SERVERS = "uses_servers"
"""Marker naming server fixtures a test gets some other way than as fixture arguments
(request.getfixturevalue, a helper): `pytest.mark.uses_servers("plain_server")`."""


def server_keys(item: Any) -> frozenset:
    """The spec keys a collected test needs: those of the server fixtures in its fixture closure,
    of server fixtures named by its parameters (tests that call request.getfixturevalue with
    one) and by its `uses_servers` markers."""
    keys = set()
    info = getattr(item, "_fixtureinfo", None)
    names = list(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    names += [value for value in params.values() if isinstance(value, str)]
    for marker in item.iter_markers(USES_SERVERS):
        names += list(marker.args)
    for name in names:
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info is not None else ()):
            key = _fixture_key(fixturedef)
            if key:
                keys.add(key)
        if name not in getattr(info, "name2fixturedefs", {}) and item.session is not None:
            for fixturedef in item.session._fixturemanager.getfixturedefs(name, item) or ():
                key = _fixture_key(fixturedef)
                if key:
                    keys.add(key)
    return frozenset(keys)


def _fixture_key(fixturedef: Any) -> Optional[str]:
    func = getattr(fixturedef, "func", None)
    for candidate in (func, getattr(func, "__wrapped__", None), getattr(func, "_get_wrapped_function", lambda: None)()):
        key = getattr(candidate, "_e2e_server_key", None)
        if key:
            return key
    return None
