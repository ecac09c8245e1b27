"""Several servers, one drafter trainer: `sglang-rl drafter trainer` and two real CPU servers
started with `--drafter-cotrain-trainer`. Rollouts split across the servers train one drafter,
both servers load every round, and when the trainer dies both keep serving with the last draft."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from e2e_servers import EAGER, LOG_DIR, Server, start_server
from test_drafter_cotrain import chat, draft_fc_rows, gsm8k, init_drafter, stats

ROUND = 4
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


@pytest.fixture(scope="module")
def shared(model_path: str, tmp_path_factory) -> Iterator[tuple]:
    """A trainer process and two servers pointing at it."""
    work = tmp_path_factory.mktemp("shared-trainer")
    draft = init_drafter(model_path, work / "d0")
    address = f"127.0.0.1:{_free_port()}"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"trainer-{address.split(':')[1]}.log"
    with open(log, "w") as out:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "sglang_rl.cli", "drafter", "trainer", "--listen", address,
             "--model-path", model_path, "--drafter-path", str(draft), "--samples-per-round", str(ROUND),
             "--steps", "3", "--lr", "1e-3", "--soft-topk", "64", "--threads", "1", "--serve-dtype", "float32"],
            stdout=out, stderr=subprocess.STDOUT, text=True)
    servers: list[Server] = []
    try:
        _wait(lambda: "trainer: listening" in log.read_text() or trainer.poll() is not None, "the trainer", 120)
        assert trainer.poll() is None, log.read_text()
        args = (*FLAGS, "--speculative-draft-model-path", str(draft), "--drafter-cotrain-trainer", address)
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_server, model_path, *args, log_name=f"cotrain-shared-{i}", env=EAGER)
                       for i in range(2)]
            servers = [f.result() for f in futures]
        yield trainer, servers, log
    finally:
        for server in servers:
            server.stop()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_two_servers_share_one_trainer(shared: tuple) -> None:
    trainer, (a, b), log = shared
    start = [stats(s.url) for s in (a, b)]
    assert all(s["trainer_alive"] and s["rounds"] == 0 for s in start), start
    before = draft_fc_rows(a.url)
    assert draft_fc_rows(b.url) == before
    prompts = gsm8k()
    # two rounds' worth of rollouts, half on each server
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: chat((a, b)[i % 2].url, prompts[i]), range(2 * ROUND)))

    def settled() -> tuple | None:
        sa, sb = stats(a.url), stats(b.url)
        same = sa["rounds"] == sb["rounds"] >= 1 and sa["trainer_received"] == sb["trainer_received"]
        return (sa, sb) if same and sa["trainer_received"] >= sa["samples"] + sb["samples"] - ROUND + 1 else None

    sa, sb = _wait(settled, "both servers to load the same rounds")
    assert sa["loss"] == sb["loss"] and sa["round_seconds"] == sb["round_seconds"], (sa, sb)
    # the rounds trained on both servers' rollouts, and both serve the same new draft
    assert sa["samples"] > 0 and sb["samples"] > 0 and sa["trainer_received"] > max(sa["samples"], sb["samples"])
    assert draft_fc_rows(a.url) == draft_fc_rows(b.url) != before
    assert not sa["errors"] and not sb["errors"], (sa["errors"], sb["errors"])
    assert "round 1: loss" in log.read_text()

    trainer.kill()
    trainer.wait()
    for server, s in ((a, sa), (b, sb)):
        dead = _wait(lambda: (lambda x: x if not x["trainer_alive"] else None)(stats(server.url)), "trainer_alive false", 60)
        assert any("connection lost" in e for e in dead["errors"]), dead["errors"]
        out = chat(server.url, prompts[300])  # still serving, with the last draft
        assert out["choices"][0]["message"]["content"]
        after = stats(server.url)
        assert after["rounds"] == s["rounds"] and after["loss"] == s["loss"] and not after["trainer_alive"]
