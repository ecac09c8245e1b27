"""The co-training loop without a server: rounds, policy-version preference, the wire format,
option checks, and the process entry point with real multiprocessing queues."""

from __future__ import annotations

import contextlib
import multiprocessing
from pathlib import Path
from typing import Iterator

import pytest
import torch

from sglang_rl.drafter import init_drafter, save_drafter
from sglang_rl.drafter.cotrain import CotrainConfig, CotrainLoop, cotrain_main, peak_memory
from sglang_rl.drafter.messages import Ready, RolloutSample, Round, Sample, Stop, TargetHead, from_wire, to_wire
from test_drafter_checkpoint import H, V, write_target


@pytest.fixture()
def folders(tmp_path: Path) -> tuple[str, str]:
    target = write_target(tmp_path / "target")
    save_drafter(init_drafter(target, seed=0), tmp_path / "draft")
    return str(tmp_path / "draft"), str(target)


def sample(n: int = 40, version: int = 0, seed: int = 0) -> RolloutSample:
    gen = torch.Generator().manual_seed(seed)
    return RolloutSample(torch.randint(0, V, (n,), generator=gen), torch.randn(n, H, generator=gen), n // 2, version)


def config(folders: tuple[str, str], **over) -> CotrainConfig:
    return CotrainConfig(draft_path=folders[0], target_path=folders[1], **{
        "samples_per_round": 4, "steps": 3, "lr": 1e-3, "window": 32, "samples_per_step": 2, **over})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_wire_round_trip_is_exact(dtype: torch.dtype) -> None:
    t = (torch.randn(5, 7) * 100).to(dtype)
    back = from_wire(to_wire(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    s = sample(9, version=3)
    r = Sample.of(s).rollout()
    assert torch.equal(r.input_ids, s.input_ids) and torch.equal(r.rows, s.rows)
    assert (r.response_start, r.policy_version) == (s.response_start, 3)


def test_a_round_is_due_after_samples_per_round_and_changes_the_weights(folders) -> None:
    loop = CotrainLoop(config(folders))
    before = {n: t.clone() for n, t in loop.trainer.model.state_dict().items()}
    for i in range(3):
        loop.add(sample(seed=i))
        assert not loop.due()
    loop.add(sample(seed=3))
    assert loop.due()
    weights, metrics = loop.train_round()
    assert not loop.due() and metrics["round"] == 1 and metrics["samples_used"] == 4
    changed = {n for n, t in weights if not torch.equal(t.float(), before[n].float())}
    assert "fc.weight" in changed and any(n.startswith("layers.0.") for n in changed)
    assert all(t.dtype == torch.bfloat16 for _, t in weights)  # serve_dtype default


def test_windows_keep_the_end_of_a_long_rollout(folders) -> None:
    loop = CotrainLoop(config(folders, window=16))
    loop.add(sample(n=100))
    [stored] = loop.buffer.get_all()
    assert stored.input_ids.numel() == 16
    assert torch.equal(stored.input_ids, sample(n=100).input_ids[-16:])


def test_rounds_prefer_the_newest_policy_version(folders) -> None:
    loop = CotrainLoop(config(folders))
    old = [sample(seed=i, version=0) for i in range(6)]
    new = [sample(seed=10 + i, version=1) for i in range(3)]
    for s in old + new:
        loop.add(s)
    chosen = loop.round_samples()
    ids = [c.input_ids.tolist() for c in chosen]
    assert len(chosen) == 4
    assert ids[-3:] == [s.input_ids[-32:].tolist() for s in new]  # every new-policy sample
    assert ids[0] == old[-1].input_ids[-32:].tolist()  # filled with the newest old one


@pytest.mark.parametrize("field, value, reason", [
    ("lr", 5.0, "lr must be in (0, 1)"),
    ("samples_per_round", 0, "samples_per_round must be a positive integer"),
    ("window", 1, "window must be >= 2"),
    ("soft_topk", 1, "soft_topk must be >= 2"),
    ("serve_dtype", "float8", "float8"),
])
def test_bad_options_are_refused(folders, field: str, value, reason: str) -> None:
    with pytest.raises(Exception, match=reason.replace("(", r"\(").replace(")", r"\)")):
        config(folders, **{field: value}).check()


def test_process_entry_point_trains_round_after_round(folders) -> None:
    """The real process protocol through spawn queues: ready, then a round per 4 samples,
    several times in a row (a queue that stops delivering after the first round fails here)."""
    with cotrain_process(folders) as (inbox, outbox, proc):
        for r in range(1, 4):
            for i in range(4):
                inbox.put(Sample.of(sample(seed=10 * r + i, version=r)))
            message = outbox.get(timeout=120)
            assert isinstance(message, Round), message
            weights, metrics = message.weights, message.metrics
            assert metrics["round"] == r and metrics["policy_version"] == r
            assert {n for n, _ in weights} >= {"fc.weight"}
            # the process's own peak memory (a torch process holds well over 50 MB); no device memory on the CPU
            assert 50 * 2**20 < metrics["trainer_peak_rss_bytes"] < 16 * 2**30
            assert metrics["trainer_peak_device_bytes"] is None
        inbox.put(Stop())
        proc.join(timeout=30)
        assert proc.exitcode == 0


def test_peak_memory_follows_the_process_peak() -> None:
    import psutil

    before = peak_memory(torch.device("cpu"))["trainer_peak_rss_bytes"]
    # touched bytes that take the resident size 64 MiB past the peak so far
    held = torch.ones(max(before - psutil.Process().memory_info().rss, 0) + 64 * 2**20, dtype=torch.uint8)
    after = peak_memory(torch.device("cpu"))["trainer_peak_rss_bytes"]
    del held
    assert after >= before + 60 * 2**20, (before, after)


@contextlib.contextmanager
def cotrain_process(folders) -> Iterator[tuple]:
    """The co-training process entry point behind real spawn queues, once it said ready."""
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=cotrain_main, args=(config(folders, threads=1), inbox, outbox), daemon=True)
    proc.start()
    try:
        assert isinstance(outbox.get(timeout=120), Ready)
        yield inbox, outbox, proc
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("tied", [True, False])
def test_the_target_head_follows_the_target(tmp_path: Path, tied: bool) -> None:
    """After an RL step changes the target's embedding and LM head, the drafter trains against
    the new ones: same logits as a drafter loaded from the updated target folder."""
    target = write_target(tmp_path / "target", tied=tied)
    save_drafter(init_drafter(target, seed=0), tmp_path / "draft")
    loop = CotrainLoop(config((str(tmp_path / "draft"), str(target))))
    model = loop.trainer.model
    gen = torch.Generator().manual_seed(7)
    embed = torch.randn(V + 16, H, generator=gen)  # sglang pads its embedding past the vocabulary
    head = None if tied else torch.randn(V, H, generator=gen)
    hidden = torch.randn(3, H, generator=gen)
    before = model.logits(hidden).clone()
    loop.set_target_head(embed, head)
    assert torch.equal(model.embed_tokens, embed[:V].to(model.embed_tokens))
    expected = (embed[:V] if tied else head).to(model.head_weight)
    assert torch.equal(model.head_weight, expected)
    assert not torch.allclose(model.logits(hidden), before)
    assert loop.head_updates == 1


def test_process_entry_point_takes_a_new_target_head(folders) -> None:
    """The target head message goes through the real process protocol and reaches the round."""
    with cotrain_process(folders) as (inbox, outbox, _):
        inbox.put(TargetHead(to_wire(torch.randn(V, H)), None))
        for i in range(4):
            inbox.put(Sample.of(sample(seed=i, version=1)))
        message = outbox.get(timeout=120)
        assert isinstance(message, Round) and message.metrics["head_updates"] == 1, message


def _start_cotrain_then_wait(folders: tuple[str, str], pid_file: str) -> None:
    """A stand-in server process: starts the co-training process, then waits to be killed."""
    import time

    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=cotrain_main, args=(config(folders, threads=1), inbox, outbox), daemon=True)
    proc.start()
    assert isinstance(outbox.get(timeout=120), Ready)
    Path(pid_file).write_text(str(proc.pid))
    time.sleep(600)


def test_process_exits_when_its_server_is_killed(folders, tmp_path: Path) -> None:
    """A server killed outright (as Ray kills an actor) cannot stop its co-training process;
    the process notices and exits instead of lingering with its memory."""
    import os
    import signal
    import time

    pid_file = tmp_path / "cotrain.pid"
    server = multiprocessing.get_context("spawn").Process(target=_start_cotrain_then_wait,
                                                          args=(folders, str(pid_file)))
    server.start()
    deadline = time.monotonic() + 180
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    cotrain_pid = int(pid_file.read_text())
    os.kill(server.pid, signal.SIGKILL)
    server.join(timeout=30)

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with contextlib.suppress(FileNotFoundError):  # a zombie waiting for init to reap it is gone
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        return False

    deadline = time.monotonic() + 30
    while alive(cotrain_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(cotrain_pid), "the co-training process outlived its server"
