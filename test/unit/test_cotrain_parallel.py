"""Co-training with several schedulers (adapters/cotrain_parallel.py): the start-up checks, the
statistics of a DP server, and a TP rank's rounds waiting for its rank 0's swap order."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_rl.adapters import cotrain_parallel
from sglang_rl.adapters.cotrain_parallel import TpSwap, check_tp_shapes, combine_stats
from sglang_rl.drafter.messages import HubPort, Ready, Round
from test_drafter_cotrain_loop import config, folders  # noqa: F401 - folders is a fixture


def _draft(tmp_path: Path, heads: int, kv: int, inter: int = 1536) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter}))
    return tmp_path


def test_tp_shapes_split_or_stop_with_the_reason(tmp_path: Path) -> None:
    check_tp_shapes(str(_draft(tmp_path, 12, 4)), 2)
    check_tp_shapes(str(_draft(tmp_path, 8, 1)), 4)  # one key/value head, replicated on every rank
    with pytest.raises(ValueError, match="9 attention heads do not split over 2 ranks"):
        check_tp_shapes(str(_draft(tmp_path, 9, 3)), 2)
    with pytest.raises(ValueError, match="3 key/value heads"):
        check_tp_shapes(str(_draft(tmp_path, 6, 3)), 2)
    with pytest.raises(ValueError, match="intermediate size 1537"):
        check_tp_shapes(str(_draft(tmp_path, 12, 4, 1537)), 2)


def _replica(dp_rank: int, rounds: int, samples: int, tokens: list, steps: list) -> dict:
    return {"dp_rank": dp_rank, "rounds": rounds, "samples": samples, "samples_dropped": 1,
            "samples_skipped_busy": 0, "rows_sent": 10 * samples, "target_head_updates": 0,
            "policy_version": dp_rank, "trainer_alive": True, "loss": [0.5] * rounds,
            "top1_agreement": [0.1] * rounds, "round_seconds": [1.0 + dp_rank] * rounds,
            "round_swap_seconds": [0.01 * (1 + dp_rank)] * rounds, "rounds_held": dp_rank,
            "swap_checks": [{"round": r + 1, "swapped": True} for r in range(rounds)],
            "round_policy_version": [0] * rounds, "errors": [f"e{dp_rank}"],
            "acceptance_tokens": tokens, "acceptance_verify_steps": steps,
            "held_out_tokens": [0] * len(tokens), "held_out_verify_steps": [0] * len(steps),
            "buffer_bytes": 100 * rounds, "trainer_peak_rss_bytes": 1000 * rounds, "trainer_peak_device_bytes": None}


def test_dp_stats_are_totals_and_each_replica() -> None:
    one, zero = _replica(1, 3, 5, [10, 20, 0], [8, 10, 0]), _replica(0, 2, 4, [12, 6], [10, 4])
    total = combine_stats([one, zero])
    assert [r["dp_rank"] for r in total["replicas"]] == [0, 1]
    assert total["samples"] == 9 and total["samples_dropped"] == 2 and total["rows_sent"] == 90
    assert total["rounds"] == 2, "rounds: the number every replica has loaded"
    assert total["acceptance_tokens_total"] == 48 and total["acceptance_verify_steps_total"] == 32
    assert total["acceptance_length_total"] == 1.5
    assert total["held_out_length_total"] is None
    assert total["policy_version"] == 1 and total["errors"] == ["e0", "e1"] and total["dp_size"] == 2
    # the one trainer's memory, as the replica that loaded the newest round last heard it
    assert total["buffer_bytes"] == 300 and total["trainer_peak_rss_bytes"] == 3000
    assert total["round_seconds"] == [2.0] * 3, "the round lists: the newest replica's"
    assert total["round_swap_seconds"] == [0.02] * 3 and total["rounds_held"] == 1
    assert [c["round"] for c in total["swap_checks"]] == [1, 2, 3]
    assert combine_stats([zero, None]) is None  # a replica without co-training


class _Runtime:
    """What a TP rank's CotrainRuntime gives TpSwap: its outbox, errors, handle and apply."""

    def __init__(self, swap: TpSwap) -> None:
        self.swap, self.outbox, self.errors, self.applied = swap, queue.Queue(), [], []
        self.process = SimpleNamespace(is_alive=lambda: True)

    def handle(self, scheduler, message) -> None:
        if isinstance(message, Round):
            self.swap.received(message.weights, message.metrics)

    def apply(self, scheduler, weights: list, metrics: dict) -> None:
        self.applied.append((metrics["round"], weights))


SCHEDULER = SimpleNamespace(weight_updater=SimpleNamespace(offload_tags=set()))


def test_a_rank_waits_for_the_round_its_rank_0_has(monkeypatch) -> None:
    monkeypatch.setattr(cotrain_parallel, "SWAP_WAIT_SECONDS", 5.0)
    swap = TpSwap(SCHEDULER, leader=False)
    rt = _Runtime(swap)
    swap.received(["w1"], {"round": 1})
    threading.Timer(0.3, rt.outbox.put, args=(Round(["w2"], {"round": 2}),)).start()
    began = time.time()
    swap.swap(rt, SCHEDULER, 2)  # round 2 is not here yet: it arrives 0.3 s later
    assert rt.applied == [(2, ["w2"])] and time.time() - began >= 0.25
    assert swap.pending == {}, "round 1, older than the one loaded, is dropped"


def test_a_round_that_never_arrives_is_an_error_not_a_hang(monkeypatch) -> None:
    monkeypatch.setattr(cotrain_parallel, "SWAP_WAIT_SECONDS", 0.2)
    swap = TpSwap(SCHEDULER, leader=False)
    rt = _Runtime(swap)
    for r in range(1, 6):
        swap.received([f"w{r}"], {"round": r})
    assert sorted(swap.pending) == [3, 4, 5], "a rank keeps the newest rounds only"
    swap.swap(rt, SCHEDULER, 7)
    assert rt.applied == [] and "round 7 not applied" in rt.errors[0]
    swap.swap(rt, SCHEDULER, 4)
    assert rt.applied == [(4, ["w4"])] and sorted(swap.pending) == [5]


def test_released_weights_defer_the_swap(monkeypatch) -> None:
    from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

    released = SimpleNamespace(weight_updater=SimpleNamespace(offload_tags={GPU_MEMORY_TYPE_WEIGHTS}))
    swap = TpSwap(released, leader=False)
    rt = _Runtime(swap)
    swap.received(["w1"], {"round": 1})
    swap.requested = 1
    swap.swap(rt, released, 1)
    assert rt.applied == [] and swap.requested == 0 and 1 in swap.pending, "asked again after the resume"


def test_bad_parallel_options_stop_the_start(tmp_path: Path) -> None:
    from sglang_rl.server_args import RLServerArgs

    base = dict(model_path="unused", speculative_algorithm="EAGLE", drafter_cotrain=True,
                speculative_draft_model_path=str(_draft(tmp_path, 9, 3)))
    with pytest.raises(ValueError, match="not pipeline parallelism or --enable-dp-attention"):
        RLServerArgs(**base, pp_size=2)
    with pytest.raises(ValueError, match="not pipeline parallelism or --enable-dp-attention"):
        RLServerArgs(**base, tp_size=2, dp_size=2, enable_dp_attention=True)
    with pytest.raises(ValueError, match="--drafter-cotrain-trainer HOST:PORT"):
        RLServerArgs(**base, nnodes=2)
    with pytest.raises(ValueError, match="9 attention heads do not split over 2 ranks"):
        RLServerArgs(**base, tp_size=2)


def test_a_servers_own_hub_answers_its_port_and_ends_with_its_server(folders) -> None:  # noqa: F811
    import multiprocessing
    import os

    from sglang_rl.drafter.trainer_client import RemoteTrainer
    from sglang_rl.drafter.trainer_server import hub_main
    from test_drafter_trainer_hub import next_message

    ctx = multiprocessing.get_context("spawn")
    procs = []
    for parent in (os.getpid(), 1):  # 1: not its parent, as when the server that started it is gone
        reply, end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=hub_main, args=(config(folders, threads=1), b"k", end, parent))
        proc.start()
        end.close()
        assert reply.poll(120), "the hub never answered"
        answer = reply.recv()
        assert isinstance(answer, HubPort) and answer.port > 0, answer
        port = answer.port
        procs.append((proc, port))
    try:
        trainer = RemoteTrainer(f"127.0.0.1:{procs[0][1]}", 8, authkey=b"k")
        assert isinstance(next_message(trainer), Ready)
        trainer.join()
        procs[1][0].join(timeout=30)
        assert procs[1][0].exitcode is not None, "a hub whose server is gone must stop"
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.join()
