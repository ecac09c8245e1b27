"""Online drafter co-training: a loop that turns finished rollouts into new draft weights.

Engine-agnostic (no sglang import). The serving side feeds finished rollouts into an inbox and
applies the weights it finds in the outbox (the messages: ``drafter/messages.py``); :func:`cotrain_main` runs in a process of
its own (and on its own device if asked), so training never runs on the serving loop.

A round starts once ``samples_per_round`` new samples have arrived since the last one. It trains
``steps`` optimizer steps on the newest ``samples_per_round`` samples of the buffer, preferring
samples of the newest policy version: after an RL step changes the target, what the drafter must
learn is the new policy's rows, and older samples only fill the round when too few new ones exist.
The buffer is bounded in bytes (:class:`HiddenStateReplayBuffer`) and tags each sample with the
policy version that produced it. With ``replay_samples`` a round also replays that many older
samples drawn from the whole buffer, weighted ``replay_decay ** (versions behind)``, so the drafter
keeps what it learnt from earlier rollouts without preferring stale policies.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
import traceback
from typing import Any, Optional

import torch

from sglang_rl.drafter.checkpoint import load_drafter, sglang_weights
from sglang_rl.drafter.config import dtype_from_name
from sglang_rl.drafter.data import sample_from_rows
from sglang_rl.drafter.gaps import IdleGate
from sglang_rl.drafter.loss import EagleLossConfig
from sglang_rl.drafter.messages import Error, Held, Ready, RolloutSample, Round, Sample, Stop, TargetHead, from_wire, to_wire
from sglang_rl.drafter.sampled import check_objective
from sglang_rl.drafter.schedule import LrSchedule
from sglang_rl.drafter.swap_check import SwapCheck
from sglang_rl.drafter.trainer import DrafterTrainer
from sglang_rl.drafter.buffer import HiddenStateReplayBuffer

__all__ = ["CotrainConfig", "CotrainLoop", "cotrain_main", "inbox_size", "peak_memory", "start_cotrain_process"]


@dataclasses.dataclass(frozen=True)
class CotrainConfig:
    """What one co-training process needs; every field has a documented default (README)."""

    draft_path: str
    target_path: str
    device: str = "cpu"
    buffer_bytes: int = 1 << 30
    samples_per_round: int = 64
    steps: int = 20
    lr: float = 1e-4
    window: int = 512
    samples_per_step: int = 16
    soft_topk: Optional[int] = None
    serve_dtype: str = "bfloat16"
    train_dtype: str = "float32"
    threads: int = 0
    unroll_steps: int = 1
    feature_noise: float = 0.0
    replay_samples: int = 0
    replay_decay: float = 0.5
    lr_schedule: Optional[str] = None
    seed: int = 0
    train_in_gaps: bool = False
    gap_max_wait_s: float = 10.0
    gap_busy_share: float = 1.0
    swap_check_samples: int = 0
    objective: str = "greedy"
    temperature: float = 1.0

    def check(self) -> None:
        """Raise ValueError naming the first bad value."""
        positive = ("buffer_bytes", "samples_per_round", "steps", "window", "samples_per_step")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"drafter co-training: {name} must be a positive integer, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise ValueError(f"drafter co-training: lr must be in (0, 1), got {self.lr!r}")
        if self.soft_topk is not None and self.soft_topk < 2:
            raise ValueError(f"drafter co-training: soft_topk must be >= 2, got {self.soft_topk!r}")
        if self.window < 2:
            raise ValueError("drafter co-training: window must be >= 2 (a pair needs two rows)")
        for name in ("serve_dtype", "train_dtype"):
            dtype_from_name(getattr(self, name))
        if isinstance(self.unroll_steps, bool) or not isinstance(self.unroll_steps, int) or not 1 <= self.unroll_steps <= 8:
            raise ValueError(f"drafter co-training: unroll_steps must be an integer in 1..8, got {self.unroll_steps!r}")
        if isinstance(self.feature_noise, bool) or not isinstance(self.feature_noise, (int, float)) \
                or not 0 <= self.feature_noise < 100:
            raise ValueError(f"drafter co-training: feature_noise must be in [0, 100), got {self.feature_noise!r}")
        if isinstance(self.replay_samples, bool) or not isinstance(self.replay_samples, int) or self.replay_samples < 0:
            raise ValueError(f"drafter co-training: replay_samples must be >= 0, got {self.replay_samples!r}")
        if not (isinstance(self.replay_decay, (int, float)) and 0 < self.replay_decay <= 1):
            raise ValueError(f"drafter co-training: replay_decay must be in (0, 1], got {self.replay_decay!r}")
        if isinstance(self.gap_max_wait_s, bool) or not isinstance(self.gap_max_wait_s, (int, float)) \
                or not self.gap_max_wait_s >= 0:
            raise ValueError(f"drafter co-training: gap_max_wait_s must be >= 0, got {self.gap_max_wait_s!r}")
        if isinstance(self.gap_busy_share, bool) or not isinstance(self.gap_busy_share, (int, float)) \
                or not 0 < self.gap_busy_share <= 1:
            raise ValueError(f"drafter co-training: gap_busy_share must be in (0, 1], got {self.gap_busy_share!r}")
        if isinstance(self.swap_check_samples, bool) or not isinstance(self.swap_check_samples, int) \
                or not 0 <= self.swap_check_samples < self.samples_per_round:
            raise ValueError("drafter co-training: swap_check_samples must be an integer in "
                             f"[0, samples_per_round={self.samples_per_round}), got {self.swap_check_samples!r}")
        try:
            check_objective(self.objective, self.temperature)
            LrSchedule.parse(self.lr_schedule)
        except ValueError as exc:
            raise ValueError(f"drafter co-training: {exc}") from None


class CotrainLoop:
    """The training state of one co-training process: buffer, trainer and round bookkeeping."""

    def __init__(self, config: CotrainConfig, gate: Optional[IdleGate] = None) -> None:
        config.check()
        self.gate = gate
        self.config = config
        device = torch.device(config.device)
        # weights and AdamW state stay float32; a lower train_dtype is autocast compute
        model = load_drafter(config.draft_path, config.target_path, dtype=torch.float32)
        if model.config.is_eagle3 and config.objective == "sampled":  # served rows are aux rows: no p_T
            raise ValueError("drafter co-training: objective sampled needs EAGLE-1/2; an EAGLE3 server's rows "
                             "are the target's aux rows, which do not give its sampling distribution")
        schedule = LrSchedule.parse(config.lr_schedule)
        per_round = config.steps
        self.trainer = DrafterTrainer(
            model.to(device), lr=config.lr, window=config.window,
            loss=EagleLossConfig(soft_topk=config.soft_topk, objective=config.objective,
                                 temperature=config.temperature), unroll_steps=config.unroll_steps,
            lr_factor=None if schedule.constant else (lambda step: schedule.factor(step / per_round)),
            autocast_dtype=dtype_from_name(config.train_dtype), feature_noise=config.feature_noise, seed=config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.buffer = HiddenStateReplayBuffer(config.buffer_bytes)
        self.fresh = 0
        self.received = 0
        self.rounds = 0
        self.head_updates = 0
        self.pending_head: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self.swap_check = SwapCheck(self.trainer.model, config.swap_check_samples) if config.swap_check_samples else None

    def set_target_head(self, embed: torch.Tensor, head: Optional[torch.Tensor] = None) -> None:
        """Follow the target's embedding and LM head after an RL step changed them (``head`` None:
        tied to the embedding). Rows past the vocabulary (sglang pads its embedding) are cut.
        An EAGLE3 drafter takes only the embedding: its LM head is its own, and trained."""
        model = self.trainer.model
        if model.config.is_eagle3:
            model.set_target_embed(embed)
            self.head_updates += 1
            return
        vocab = model.embed_tokens.shape[0]
        model.embed_tokens.copy_(embed[:vocab].to(model.embed_tokens))
        if model.lm_head is not None:
            model.lm_head.copy_((embed if head is None else head)[:vocab].to(model.lm_head))
        self.head_updates += 1

    def receive_target_head(self, embed: torch.Tensor, head: Optional[torch.Tensor] = None) -> None:
        """A new target head from the server. With a gate it waits for the next round's first idle
        moment: copying it to the serving GPU while rollouts run would compete with them."""
        if self.gate is None:
            self.set_target_head(embed, head)
        else:
            self.pending_head = (embed, head)

    def add(self, sample: RolloutSample) -> None:
        """Window and store one sample (a sample with fewer than two rows is dropped)."""
        n = int(sample.input_ids.numel())
        if n < 2:
            return
        keep = min(n, self.config.window)
        start = n - keep
        aligned = sample_from_rows(sample.input_ids[start:], sample.rows[start:],
                                   max(sample.response_start - start, 0))
        self.received += 1
        if self.buffer.add(aligned, step=sample.policy_version):
            self.fresh += 1

    def due(self) -> bool:
        return self.fresh >= self.config.samples_per_round

    def round_samples(self) -> list:
        """The newest ``samples_per_round`` samples, newest policy version first, then
        ``replay_samples`` older ones drawn from the whole buffer (newer versions more likely)."""
        fresh, replay = self._round_parts()
        return fresh + replay

    def _round_parts(self) -> tuple[list, list]:
        want = self.config.samples_per_round
        newest = self.buffer.get_data_from_last_n_steps(1)
        chosen = newest[-want:]
        if len(chosen) < want:
            older = [s for s in self.buffer.get_all() if not any(s is c for c in newest)]
            chosen = older[-(want - len(chosen)):] + chosen
        replay = self.buffer.replay(self.config.replay_samples, self.config.replay_decay, chosen, self.generator)
        return chosen, replay

    def train_round(self) -> tuple[Optional[list[tuple[str, torch.Tensor]]], dict]:
        """One round: train, then the new draft weights (serving dtype, CPU) and its metrics.
        With a swap check the weights are None when the round is held (``metrics["swap_check"]``)."""
        start = time.perf_counter()
        if self.gate is not None:  # the batches' device copies and soft targets wait for idle time too
            self.gate.new_round()
            self.gate.wait()
        if self.pending_head is not None:
            self.set_target_head(*self.pending_head)
            self.pending_head = None
        fresh, replay = self._round_parts()
        held: list = []
        if self.swap_check is not None:
            fresh, held = self.swap_check.hold_back(fresh)
        samples = fresh + replay
        data = [samples[i:i + self.config.samples_per_step]
                for i in range(0, len(samples), self.config.samples_per_step)]
        batches = [b for group in data for b in self.trainer.as_batches(group)]
        history = self.trainer.train_steps(batches, self.config.steps,
                                           before_step=None if self.gate is None else self.gate.wait)
        self.fresh = 0
        self.rounds += 1
        trained = [h for h in history if not h["skipped"]]
        last = trained[-len(batches):] if trained else history[-1:]
        metrics = {
            "round": self.rounds,
            "loss": sum(h["loss"] for h in last) / len(last),
            "top1_agreement": sum(h["top1_agreement"] for h in last) / len(last),
            "tv_loss": sum(h["tv_loss"] for h in last) / len(last),
            "first_loss": history[0]["loss"],
            **{key: sum(h[key] for h in last) / len(last) for key in last[0] if key.startswith("top1_agreement_step")},
            "lr": history[-1]["lr"],
            "samples_used": len(samples),
            "pairs": int(sum(b.num_loss_pairs for b in batches)),
            "seconds": time.perf_counter() - start,
            "policy_version": self.buffer.current_step,
            "buffer_samples": len(self.buffer),
            "buffer_bytes": self.buffer.nbytes,
            "received": self.received,
            "head_updates": self.head_updates,
            **peak_memory(self.trainer.device),
            **({"gap_wait_s": self.gate.waited_s} if self.gate is not None else {}),
        }
        if self.swap_check is not None:
            metrics["swap_check"] = {"round": self.rounds, **self.swap_check.decide(self.trainer, held)}
            if not metrics["swap_check"]["swapped"]:
                return None, metrics
        weights = sglang_weights(self.trainer.model, dtype=dtype_from_name(self.config.serve_dtype))
        return weights, metrics


def peak_memory(device: torch.device) -> dict:
    """The training process's peak memory so far: resident host bytes, and on a CUDA device the
    bytes torch allocated there (None elsewhere). Printed in the statistics, where a long run
    shows whether they stay bounded."""
    on_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"trainer_peak_rss_bytes": _peak_rss(), "trainer_peak_device_bytes": on_device}


def _peak_rss() -> int:
    """This process's peak resident bytes. Linux's VmHWM, not getrusage's maxrss: a spawned
    process's maxrss starts at the size of the process it was forked from (the server's)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# how often an idle co-training process checks that the server that started it still runs
PARENT_CHECK_SECONDS = 2.0


def _drain(inbox: Any, first: Any) -> list:
    items = [first]
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items


def cotrain_main(config: CotrainConfig, inbox: Any, outbox: Any, idle: Any = None) -> None:
    """Process entry point (``idle``: the server's idle Event, for ``train_in_gaps``). The inbox
    brings `Sample`, `TargetHead` and `Stop`; the outbox takes `Ready`, `Round`, `Held` and
    `Error` (drafter/messages.py)."""
    _name_process("sglang-rl::drafter-cotrain")
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    try:
        gate = None
        if config.train_in_gaps and idle is not None:
            gate = IdleGate(idle, config.gap_max_wait_s, config.gap_busy_share)
        loop = CotrainLoop(config, gate)
    except Exception:  # noqa: BLE001 - reported to the server, which logs it and keeps serving
        outbox.put(Error(traceback.format_exc()))
        return
    outbox.put(Ready())
    parent = os.getppid()
    while True:
        try:
            first = inbox.get(timeout=PARENT_CHECK_SECONDS)
        except queue.Empty:
            if os.getppid() != parent:  # the server was killed (e.g. its Ray actor): nothing will come
                return
            continue
        for message in _drain(inbox, first):
            match message:
                case Stop():
                    return
                case TargetHead(embed, head):
                    loop.receive_target_head(from_wire(embed), None if head is None else from_wire(head))
                case Sample():
                    try:
                        loop.add(message.rollout())
                    except ValueError as exc:
                        outbox.put(Error(f"sample dropped: {exc}"))
        if loop.due():
            try:
                weights, metrics = loop.train_round()
            except Exception:  # noqa: BLE001 - a failed round is reported; the next one may work
                outbox.put(Error(traceback.format_exc()))
                loop.fresh = 0
                continue
            if weights is None:  # the swap check kept the served drafter
                outbox.put(Held(metrics))
            else:
                outbox.put(Round([(name, to_wire(t)) for name, t in weights], metrics))


def _name_process(title: str) -> None:
    """Name the process as ps and top show it, as sglang names its own (where setproctitle exists)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def inbox_size(config: CotrainConfig) -> int:
    """Bound of a trainer's inbox: when training falls behind the rollouts, new samples are
    skipped (and counted) instead of piling up in memory."""
    return max(2 * config.samples_per_round, 64)


def start_cotrain_process(config: CotrainConfig, name: str, idle: Any = None) -> tuple[Any, Any, Any]:
    """The co-training process (spawned) with its bounded inbox and its outbox (``idle``: a spawn
    context Event the server sets while it is idle, for ``train_in_gaps``)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(maxsize=inbox_size(config)), ctx.Queue()
    process = ctx.Process(target=cotrain_main, args=(config, inbox, outbox, idle), name=name, daemon=True)
    process.start()
    return process, inbox, outbox
