"""Several servers, one drafter trainer: `sglang-rl drafter trainer` and two real CPU servers
started with `--drafter-cotrain-trainer`. Rollouts split across the servers train one drafter,
both servers load every round, and when the trainer dies both keep serving with the last draft.

The trainer is started by the first of the two servers' `prepare`s (the other finds it), so the
suite's pool starts both servers ahead, while earlier tests run."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from e2e_servers import EAGER, LOG_DIR, OWN_PROCESS_GROUP, POOL, Prepared, ServerHandle, Spec, server_fixture
from test_drafter_cotrain import chat, draft_fc_rows, gsm8k, init_drafter, stats

ROUND = 4
MAX_TOKENS = 16  # per rollout: rows enough for a round
FLAGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4", "--drafter-cotrain")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _shared_trainer(model_path: str, workdir: Path) -> Prepared:
    """The flags of a server of the shared trainer; the first call of the session (a prepare runs
    in a child of the pytest process) starts the trainer, in a process group of its own."""
    home = LOG_DIR / f"shared-trainer-{os.getppid()}"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = home / "trainer.json"
        if not info.exists():
            draft = init_drafter(model_path, home / "d0")
            address = f"127.0.0.1:{_free_port()}"
            log = home / "trainer.log"
            with open(log, "w") as out:
                trainer = subprocess.Popen(
                    [sys.executable, "-m", "sglang_rl.cli", "drafter", "trainer", "--listen", address,
                     "--model-path", model_path, "--drafter-path", str(draft), "--samples-per-round", str(ROUND),
                     "--steps", "3", "--lr", "1e-3", "--soft-topk", "64", "--threads", "1",
                     "--serve-dtype", "float32"],
                    stdout=out, stderr=subprocess.STDOUT, text=True, **OWN_PROCESS_GROUP)
            _wait(lambda: "trainer: listening" in log.read_text() or trainer.poll() is not None, "the trainer", 120)
            assert trainer.poll() is None, log.read_text()
            info.write_text(json.dumps({"pid": trainer.pid, "address": address, "draft": str(draft),
                                        "log": str(log)}))
        data = json.loads(info.read_text())
    return Prepared(args=("--speculative-draft-model-path", data["draft"], "--drafter-cotrain-trainer",
                          data["address"]), data=data)


SHARED = [Spec(f"cotrain-shared-{i}", FLAGS, env=EAGER, prepare=_shared_trainer) for i in range(2)]
shared_a = server_fixture(SHARED[0], scope="module", doc="EAGLE co-training with the shared trainer (first).")
shared_b = server_fixture(SHARED[1], scope="module", doc="EAGLE co-training with the shared trainer (second).")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _kill(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def shared(shared_a: ServerHandle, shared_b: ServerHandle) -> Iterator[tuple]:
    """The trainer's process id and log, and the two servers pointing at it."""
    trainer = POOL.prepared_data(SHARED[0].key)
    assert POOL.prepared_data(SHARED[1].key)["address"] == trainer["address"]
    atexit.register(_kill, trainer["pid"])  # a run stopped early leaves no trainer behind
    try:
        yield trainer["pid"], (shared_a, shared_b), Path(trainer["log"])
    finally:
        _kill(trainer["pid"])


def test_two_servers_share_one_trainer(shared: tuple) -> None:
    trainer, (a, b), log = shared
    assert _alive(trainer), log.read_text()[-2000:]
    start = [stats(s.url) for s in (a, b)]
    assert all(s["trainer_alive"] and s["rounds"] == 0 for s in start), start
    before = draft_fc_rows(a.url)
    assert draft_fc_rows(b.url) == before
    prompts = gsm8k()
    # two rounds' worth of rollouts, half on each server
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: chat((a, b)[i % 2].url, prompts[i], max_tokens=MAX_TOKENS), range(2 * ROUND)))

    def settled() -> tuple | None:
        sa, sb = stats(a.url), stats(b.url)
        same = sa["rounds"] == sb["rounds"] >= 1 and sa["trainer_received"] == sb["trainer_received"]
        # each server posts its finished rollouts at its next idle loop: a round of the other's may come first
        posted = min(sa["samples"], sb["samples"]) >= ROUND
        trained = sa["trainer_received"] >= sa["samples"] + sb["samples"] - ROUND + 1
        return (sa, sb) if same and posted and trained else None

    sa, sb = _wait(settled, "both servers to load the same rounds")
    assert sa["loss"] == sb["loss"] and sa["round_seconds"] == sb["round_seconds"], (sa, sb)
    # the rounds trained on both servers' rollouts, and both serve the same new draft
    assert sa["samples"] > 0 and sb["samples"] > 0, (sa, sb)
    assert sa["trainer_received"] > max(sa["samples"], sb["samples"]), (sa, sb)
    assert draft_fc_rows(a.url) == draft_fc_rows(b.url) != before
    assert not sa["errors"] and not sb["errors"], (sa["errors"], sb["errors"])
    assert "round 1: loss" in log.read_text()

    _kill(trainer)
    _wait(lambda: not _alive(trainer), "the trainer to exit", 30)
    for server, s in ((a, sa), (b, sb)):
        dead = _wait(lambda: (lambda x: x if not x["trainer_alive"] else None)(stats(server.url)), "trainer_alive false", 60)
        assert any("connection lost" in e for e in dead["errors"]), dead["errors"]
        out = chat(server.url, prompts[300], max_tokens=MAX_TOKENS)  # still serving, with the last draft
        assert out["choices"][0]["message"]["content"]
        after = stats(server.url)
        assert after["rounds"] == s["rounds"] and after["loss"] == s["loss"] and not after["trainer_alive"]
