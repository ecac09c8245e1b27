"""One drafter trainer for several servers: the real co-training process behind the trainer hub,
reached over real authenticated localhost connections (the server side's `RemoteTrainer`)."""

from __future__ import annotations

import multiprocessing
import queue
import time
from multiprocessing.connection import Listener

import pytest
import torch

from sglang_rl.drafter import cli as drafter_cli
from sglang_rl.drafter.cotrain import cotrain_main
from sglang_rl.drafter.messages import Error, Ready, Round, Sample, Stop, from_wire
from sglang_rl.drafter.trainer_client import RemoteTrainer, check_trainer, connect
from sglang_rl.drafter.trainer_server import TrainerHub
from test_drafter_cotrain_loop import config, folders, sample  # noqa: F401 - folders is a fixture

KEY = b"test-key"


def next_message(trainer: RemoteTrainer, timeout: float = 120) -> object:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return trainer.outbox.get_nowait()  # the runtime's own non-blocking read
        except queue.Empty:
            time.sleep(0.05)
    raise AssertionError("nothing from the trainer")


def test_every_server_gets_each_round_and_a_late_one_the_newest(folders) -> None:  # noqa: F811
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(maxsize=64), ctx.Queue()
    proc = ctx.Process(target=cotrain_main, args=(config(folders, threads=1), inbox, outbox), daemon=True)
    proc.start()
    listener = Listener(("127.0.0.1", 0), authkey=KEY)
    address = f"127.0.0.1:{listener.address[1]}"
    hub = TrainerHub(listener, inbox, outbox, log=lambda line: None).start()
    try:
        a, b = RemoteTrainer(address, 8, authkey=KEY), RemoteTrainer(address, 8, authkey=KEY)
        assert isinstance(next_message(a), Ready) and isinstance(next_message(b), Ready)
        # a server that stops does not stop the shared trainer, even one sending "stop" itself
        rogue = connect(address, KEY)
        rogue.send(Stop())
        a.inbox.put(Stop())
        for i in range(2):  # one round's 4 samples, split over the two servers
            a.inbox.put_nowait(Sample.of(sample(seed=i)))
            b.inbox.put_nowait(Sample.of(sample(seed=10 + i)))
        got_a, got_b = next_message(a), next_message(b)
        assert isinstance(got_a, Round) and isinstance(got_b, Round), (got_a, got_b)
        assert got_a.metrics["round"] == got_b.metrics["round"] == 1 and got_a.metrics["received"] == 4
        assert got_a.metrics["loss"] == got_b.metrics["loss"]
        weights_a = {n: from_wire(w) for n, w in got_a.weights}
        weights_b = {n: from_wire(w) for n, w in got_b.weights}
        assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)

        late = RemoteTrainer(address, 8, authkey=KEY)
        assert isinstance(next_message(late), Ready)
        newest = next_message(late)
        assert isinstance(newest, Round) and newest.metrics == got_a.metrics
        assert hub.received == 4 and a.is_alive() and late.is_alive()

        b.join()  # one server leaving: the others still get rounds
        for i in range(4):
            late.inbox.put_nowait(Sample.of(sample(seed=20 + i, version=1)))
        second = next_message(a)
        assert isinstance(second, Round) and second.metrics["round"] == 2
        assert next_message(late).metrics["round"] == 2

        # the trainer dies: every server sees it, with one error, and sending fails fast
        proc.kill()
        hub.close()
        for server in (a, late):
            lost = next_message(server, timeout=30)
            assert isinstance(lost, Error) and "connection lost" in lost.text and address in lost.text
            assert not server.is_alive()
            with pytest.raises(queue.Full):
                server.inbox.put_nowait(Sample.of(sample()))
    finally:
        hub.close()
        if proc.is_alive():
            proc.kill()


def test_a_trainer_that_does_not_answer_or_rejects_the_key_is_refused() -> None:
    listener = Listener(("127.0.0.1", 0), authkey=KEY)
    port = listener.address[1]
    hub = TrainerHub(listener, queue.Queue(), queue.Queue(), log=lambda line: None).start()
    try:
        check_trainer(f"127.0.0.1:{port}", authkey=KEY)
        with pytest.raises(ValueError, match="authentication failed"):
            check_trainer(f"127.0.0.1:{port}", authkey=b"wrong")
    finally:
        hub.close()
    with pytest.raises(ValueError, match="does not answer"):
        check_trainer(f"127.0.0.1:{port}", authkey=KEY)
    with pytest.raises(ValueError, match="HOST:PORT"):
        check_trainer("localhost", authkey=KEY)


def test_trainer_cli_refuses_bad_options(folders, capsys, monkeypatch) -> None:  # noqa: F811
    monkeypatch.delenv("SGLANG_RL_COTRAIN_AUTHKEY", raising=False)
    draft, target = folders
    base = ["trainer", "--model-path", target, "--drafter-path", draft]
    assert drafter_cli.main([*base, "--listen", "0.0.0.0:29999"]) == 2
    assert "needs a shared key" in capsys.readouterr().err
    assert drafter_cli.main([*base, "--listen", "127.0.0.1"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert drafter_cli.main([*base, "--listen", "127.0.0.1:29999", "--lr", "5"]) == 2
    assert "lr must be in (0, 1)" in capsys.readouterr().err
