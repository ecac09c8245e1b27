"""Co-training in the server's idle gaps: the gate alone, and the real co-training process, whose
round waits while the server is busy and trains once it is idle (or its waiting budget is spent)."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time

import pytest
import torch

from sglang_rl.drafter.cotrain import CotrainLoop, cotrain_main
from sglang_rl.drafter.messages import Ready, Round, Sample, Stop
from sglang_rl.drafter.gaps import IdleGate
from test_drafter_cotrain_loop import config, folders, sample  # noqa: F401 - folders is a fixture
from test_drafter_checkpoint import H, V


def test_the_gate_waits_for_idle_then_passes() -> None:
    idle = threading.Event()
    gate = IdleGate(idle, max_wait_s=30)
    threading.Timer(0.3, idle.set).start()
    start = time.perf_counter()
    gate.wait()
    assert 0.25 <= time.perf_counter() - start < 5 and 0.25 <= gate.waited_s < 5
    gate.wait()  # idle now: no wait
    assert gate.waited_s < 5


def test_the_gate_gives_up_after_the_rounds_budget() -> None:
    gate = IdleGate(threading.Event(), max_wait_s=0.2)
    for _ in range(3):  # the budget is the round's, not each step's
        gate.wait()
    assert 0.2 <= gate.waited_s < 1
    gate.new_round()
    assert gate.waited_s == 0.0


def _compute_share(gate: IdleGate, steps: int, step_s: float) -> float:
    """Share of the wall time spent in `steps` steps of `step_s` each, each after `gate.wait()`.
    A step's time is what it took, not `step_s`: on a loaded machine a sleep overruns, and the
    gate paces by the time a step took."""
    start = time.perf_counter()
    computed = 0.0
    for _ in range(steps):
        gate.wait()
        step_start = time.perf_counter()
        time.sleep(step_s)  # the optimizer step
        computed += time.perf_counter() - step_start
    return computed / (time.perf_counter() - start)


def test_busy_steps_are_paced_to_their_share_once_the_wait_is_spent() -> None:
    busy = threading.Event()
    assert _compute_share(IdleGate(busy, max_wait_s=0), 10, 0.02) > 0.8  # no limit: back to back
    paced = IdleGate(busy, max_wait_s=0, busy_share=0.25)
    assert _compute_share(paced, 10, 0.02) < 0.35  # a rest of 3x each step after the first
    assert paced.waited_s >= 9 * 0.02 * 3
    idle = threading.Event()
    idle.set()
    assert _compute_share(IdleGate(idle, max_wait_s=0, busy_share=0.25), 10, 0.02) > 0.8  # idle: no pacing


def test_a_bad_wait_budget_is_refused(folders) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="gap_max_wait_s must be >= 0"):
        config(folders, gap_max_wait_s=-1).check()
    for share in (0, 1.5, True):
        with pytest.raises(ValueError, match="gap_busy_share must be in"):
            config(folders, gap_busy_share=share).check()


def test_a_round_waits_while_the_server_is_busy(folders) -> None:  # noqa: F811
    """The process protocol with the server's idle Event cleared: no round while busy (the
    budget is long), the round once the server goes idle, with the wait in its metrics."""
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox, idle = ctx.Queue(), ctx.Queue(), ctx.Event()
    cfg = config(folders, threads=1, train_in_gaps=True, gap_max_wait_s=120)
    proc = ctx.Process(target=cotrain_main, args=(cfg, inbox, outbox, idle), daemon=True)
    proc.start()
    try:
        assert isinstance(outbox.get(timeout=120), Ready)
        for i in range(4):
            inbox.put(Sample.of(sample(seed=i)))
        with pytest.raises(queue.Empty):
            outbox.get(timeout=3)  # busy: the round's first step waits
        idle.set()
        message = outbox.get(timeout=60)
        assert isinstance(message, Round), message
        metrics = message.metrics
        assert metrics["round"] == 1 and metrics["gap_wait_s"] >= 2.5
        inbox.put(Stop())
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_new_target_head_waits_for_the_rounds_idle_time(folders) -> None:  # noqa: F811
    """With a gate, a target head that arrives while the server is busy is not copied into the
    drafter then (on a GPU the copy would compete with the rollouts): the next round takes it,
    after its wait for idle time."""
    idle = threading.Event()
    loop = CotrainLoop(config(folders, train_in_gaps=True), IdleGate(idle, max_wait_s=30))
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(3))
    before = loop.trainer.model.embed_tokens.clone()
    loop.receive_target_head(embed)
    assert torch.equal(loop.trainer.model.embed_tokens, before) and loop.head_updates == 0
    for i in range(4):
        loop.add(sample(seed=i))
    threading.Timer(0.5, idle.set).start()
    _, metrics = loop.train_round()
    assert metrics["head_updates"] == 1 and metrics["gap_wait_s"] >= 0.4
    assert torch.equal(loop.trainer.model.embed_tokens, embed.to(before))
