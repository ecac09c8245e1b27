"""Co-training on a server with several scheduler processes (`--tp-size N`, `--dp-size N`).

One trainer serves every scheduler of the server: the launcher starts a trainer hub (the
shared trainer of `sglang-rl drafter trainer`, `drafter/trainer_server.hub_main`) on a loopback
port before the schedulers start, and every scheduler connects to it, as separate servers connect
to a shared trainer. Rows come from TP rank 0 of each DP replica; every rank receives every round.

The draft model is TP-sharded, so every TP rank of a replica loads each round (sglang's loader
shards the full tensors) and all of them must swap at the same scheduler iteration, since they
run the draft's collectives together. TP rank 0 decides: it puts a `CotrainSwapReqInput` on its
own request socket, and sglang's receive path broadcasts it to the TP group with the iteration's
requests, so each rank handles it at the same point of the same iteration.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import secrets
import tempfile
import uuid
from pathlib import Path
from typing import Any, Optional

from sglang.srt.managers.io_struct import BaseReq

from sglang_rl.drafter.messages import Error, HubPort

__all__ = ["CotrainSwapReqInput", "TpSwap", "check_tp_agree", "check_tp_shapes", "combine_stats", "gather_tp_stats",
           "trainer_address"]

HUB_ATTR = "_sglang_rl_cotrain_hub"  # (address, authkey hex) on the server args, pickled to schedulers
HUB_START_SECONDS = 300.0
SWAP_WAIT_SECONDS = 60.0  # how long a TP rank waits for a round its rank 0 already has
KEEP_ROUNDS = 3


def needs_hub(server_args: Any) -> bool:
    """Whether this server starts its own trainer hub: co-training with several schedulers and
    no shared trainer named."""
    return bool(getattr(server_args, "drafter_cotrain", False)) and not server_args.drafter_cotrain_trainer \
        and (server_args.tp_size > 1 or server_args.dp_size > 1)


def trainer_address(server_args: Any) -> tuple[Optional[str], Optional[bytes]]:
    """(HOST:PORT, authkey) of the trainer this scheduler connects to; (None, None) when it
    trains in a process of its own. authkey None: SGLANG_RL_COTRAIN_AUTHKEY's."""
    if server_args.drafter_cotrain_trainer:
        return server_args.drafter_cotrain_trainer, None
    hub = getattr(server_args, HUB_ATTR, None)
    if hub is not None:
        return hub[0], bytes.fromhex(hub[1])
    return None, None


def check_tp_shapes(draft_path: str, tp_size: int) -> None:
    """ValueError when the drafter's heads or MLP cannot be split over ``tp_size`` ranks."""
    config = json.loads((Path(draft_path) / "config.json").read_text())
    heads = int(config.get("num_attention_heads", 0))
    kv = int(config.get("num_key_value_heads") or heads)
    inter = int(config.get("intermediate_size", 0))
    if heads % tp_size:
        raise ValueError(f"--drafter-cotrain with --tp-size {tp_size}: the drafter's {heads} attention heads "
                         f"do not split over {tp_size} ranks")
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"--drafter-cotrain with --tp-size {tp_size}: the drafter's {kv} key/value heads "
                         f"neither split over nor replicate onto {tp_size} ranks")
    if inter % tp_size:
        raise ValueError(f"--drafter-cotrain with --tp-size {tp_size}: the drafter's intermediate size {inter} "
                         f"does not split over {tp_size} ranks")


def launch_subprocesses_before(engine_cls: type, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Engine._launch_subprocesses: a co-training server with several schedulers starts
    its trainer hub, whose address the schedulers find on their (pickled) server args."""
    import multiprocessing

    from sglang_rl.adapters.cotrain_config import config_from_args
    from sglang_rl.drafter.trainer_server import hub_main

    if not needs_hub(server_args) or getattr(server_args, HUB_ATTR, None) is not None:
        return
    key = secrets.token_bytes(32)
    ctx = multiprocessing.get_context("spawn")
    reply, child_end = ctx.Pipe(duplex=False)
    # not a daemon: a daemon process may not start the training process it needs
    process = ctx.Process(target=hub_main, args=(config_from_args(server_args), key, child_end, os.getpid()),
                          name="sglang-rl-drafter-trainer-hub")
    process.start()
    child_end.close()
    atexit.register(_stop, process)
    answer = reply.recv() if reply.poll(HUB_START_SECONDS) else Error("no answer")
    if not isinstance(answer, HubPort):
        _stop(process)
        raise RuntimeError(f"--drafter-cotrain: the server's trainer hub did not start: {answer.text}")
    object.__setattr__(server_args, HUB_ATTR, (f"127.0.0.1:{answer.port}", key.hex()))


def _stop(process: Any) -> None:
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


class CotrainSwapReqInput(BaseReq, kw_only=True):
    """TP rank 0 to its TP group: load round ``draft_round`` now."""

    draft_round: int


class TpSwap:
    """One TP rank's rounds, stashed until its rank 0 asks the group to swap one in."""

    def __init__(self, scheduler: Any, leader: bool) -> None:
        self.pending: dict[int, tuple[list, dict]] = {}
        self.requested = 0
        self.leader = leader
        self.push = self.address = None
        if leader:
            self._connect(scheduler)

    def _connect(self, scheduler: Any) -> None:
        """A socket of our own feeding rank 0's request socket (a zmq PULL socket takes several
        peers), so the swap order rides sglang's own receive-and-broadcast of the iteration."""
        import zmq

        pull = getattr(scheduler, "recv_from_tokenizer", None)
        if not hasattr(pull, "connect"):
            raise RuntimeError("--drafter-cotrain with --tp-size > 1 needs sglang's zmq request socket "
                               f"(this scheduler receives through {type(pull).__name__})")
        self.address = f"ipc://{tempfile.gettempdir()}/sglang-rl-swap-{uuid.uuid4().hex}"
        self.push = zmq.Context.instance().socket(zmq.PUSH)
        self.push.bind(self.address)
        pull.connect(self.address)

    def received(self, weights: list, metrics: dict) -> None:
        self.pending[int(metrics["round"])] = (weights, metrics)
        for old in sorted(self.pending)[:-KEEP_ROUNDS]:
            del self.pending[old]

    def ask(self) -> None:
        """Rank 0 (between batches): ask the group to swap in the newest round it has."""
        from sglang.srt.managers.io_struct import sock_send

        newest = max(self.pending, default=0)
        if self.leader and newest > self.requested:
            self.requested = newest
            # sglang broadcasts rank 0's requests to its TP group each iteration: all ranks swap together
            sock_send(self.push, CotrainSwapReqInput(draft_round=newest))

    def swap(self, runtime: Any, scheduler: Any, draft_round: int) -> None:
        """Every rank, at the same iteration: load the round (waiting for it if rank 0 got it first)."""
        from sglang_rl.adapters.cotrain_idle import weights_released

        if weights_released(scheduler):
            self.requested = min(self.requested, draft_round - 1)  # rank 0 asks again after resume
            return
        while draft_round not in self.pending and runtime.process.is_alive():
            try:
                runtime.handle(scheduler, runtime.outbox.get(timeout=SWAP_WAIT_SECONDS))
            except queue.Empty:
                break
        if draft_round not in self.pending:
            runtime.errors.append(f"round {draft_round} not applied on this TP rank: it never arrived")
            return
        weights, metrics = self.pending[draft_round]
        for old in [r for r in self.pending if r <= draft_round]:
            del self.pending[old]
        runtime.apply(scheduler, weights, metrics)

    def close(self) -> None:
        if self.push is not None:
            self.push.close(linger=0)
            try:
                os.unlink(self.address.removeprefix("ipc://"))
            except OSError:
                pass


def check_tp_agree(scheduler: Any) -> None:
    """Every TP rank must see the same draft (names and full shapes): a round is one set of
    full tensors. RuntimeError with the difference otherwise (the server does not start)."""
    from sglang_rl.adapters.eagle_draft import draft_spec, find_eagle_draft

    eagle, why = find_eagle_draft(getattr(scheduler, "draft_worker", None))
    mine = why if eagle is None else sorted((n, s.shape) for n, s in draft_spec(eagle)[0].slots.items())
    everyone = _from_every_tp_rank(scheduler, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = sorted(set(map(str, theirs)) ^ set(map(str, everyone[0])))[:4]
            raise RuntimeError(f"--drafter-cotrain: TP ranks 0 and {rank} disagree on the draft model: {diff}")


def gather_tp_stats(scheduler: Any, runtime: Any) -> list[dict]:
    """Each TP rank's rounds (number, and the scheduler iteration each was loaded at), a checksum
    of its draft's fc weight and its errors, gathered over the TP group: every rank must have
    loaded the same rounds at the same step."""
    from sglang_rl.adapters.eagle_draft import draft_spec, find_eagle_draft

    eagle, _ = find_eagle_draft(getattr(scheduler, "draft_worker", None))
    fc = draft_spec(eagle)[1].get("fc.weight") if eagle is not None else None
    mine = {"tp_rank": scheduler.ps.tp_rank, "rounds": runtime.draft_round,
            # fc is not sharded: every rank holding the same round holds the same fc
            "fc_checksum": None if fc is None else float(fc.detach().double().sum()),
            # an EAGLE3 draft's own head is: each rank sums the vocabulary rows it holds
            "head_shard_checksum": _head_shard_checksum(eagle),
            "loaded_rounds": [r["round"] for r in runtime.rounds],
            "loaded_at_forward": [r["forward_ct"] for r in runtime.rounds], "errors": runtime.errors[-3:]}
    return _from_every_tp_rank(scheduler, mine)


def _head_shard_checksum(eagle: Any) -> Optional[float]:
    """Sum of the draft-head rows this TP rank holds (its vocabulary shard, padding left out);
    None for a draft that reads the target's head."""
    from sglang_rl.adapters.eagle_draft import is_eagle3

    if eagle is None or not is_eagle3(eagle):
        return None
    head = eagle.draft_runner.model.lm_head
    shard = head.shard_indices
    rows = shard.org_vocab_end_index - shard.org_vocab_start_index
    return float(head.weight.detach()[:rows].double().sum())


def _from_every_tp_rank(scheduler: Any, mine: Any) -> list:
    """``mine`` of every rank of this scheduler's TP group, in rank order (a collective: every
    rank calls it at the same point)."""
    import torch

    everyone: list = [None] * scheduler.ps.tp_size
    torch.distributed.all_gather_object(everyone, mine, group=scheduler.tp_cpu_group)
    return everyone


SUMMED = ("samples", "samples_dropped", "samples_skipped_busy", "rows_sent", "target_head_updates")


def combine_stats(replicas: list[Optional[dict]]) -> Optional[dict]:
    """The statistics of a DP server: totals over the replicas, and each replica's own under
    ``replicas``. ``rounds`` is the number every replica has loaded."""
    if any(r is None for r in replicas):
        return None
    replicas = sorted(replicas, key=lambda r: r["dp_rank"])
    total: dict[str, Any] = {key: sum(r[key] for r in replicas) for key in SUMMED}
    for kind in ("acceptance", "held_out"):
        tokens = sum(sum(r[f"{kind}_tokens"]) for r in replicas)
        steps = sum(sum(r[f"{kind}_verify_steps"]) for r in replicas)
        total[f"{kind}_tokens_total"], total[f"{kind}_verify_steps_total"] = tokens, steps
        total[f"{kind}_length_total"] = tokens / steps if steps else None
    newest = max(replicas, key=lambda r: r["rounds"])
    total.update({
        "rounds": min(r["rounds"] for r in replicas),
        "policy_version": max(r["policy_version"] for r in replicas),
        "trainer_alive": all(r["trainer_alive"] for r in replicas),
        **{key: newest[key] for key in ("loss", "top1_agreement", "round_seconds", "round_swap_seconds",
                                        "round_policy_version", "rounds_held", "swap_checks")},
        **{key: newest[key] for key in ("buffer_bytes", "trainer_peak_rss_bytes", "trainer_peak_device_bytes")},
        "errors": [e for r in replicas for e in r["errors"]][-5:],
        "dp_size": len(replicas),
        "replicas": replicas,
    })
    return total
