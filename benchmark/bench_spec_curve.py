"""What an acceptance buys: EAGLE against plain decoding at set acceptances and batch sizes, and
sglang's adaptive speculation configured from that curve.

The pair is `spec_models.make_eagle_pair` (default: the 8B shape, 32 layers of 4096). The draft's
acceptance is set without restarting the server: its `fc` (which passes the token embedding
through) gets Gaussian noise of a chosen scale, pushed with `Engine.update_draft_weights_from_tensor`;
more noise, more wrong drafts. For each wanted acceptance (tokens committed per verify step) the
noise scale is found by bisection on a short batch, then every batch size is timed.

Three processes, one after another, on one GPU:
1. plain: the target alone;
2. eagle: the target with the draft (3 steps, top-1, 4 draft tokens), at each acceptance;
3. adaptive: the same with `--speculative-adaptive` and a config written from 1 and 2: at each
   batch-size slot drafting is on (3 steps) while the running acceptance is above the slot's
   break-even (where EAGLE's line crosses plain), off (0 steps) below it;
4. switch: the same pair with sglang-rl's `--speculative-switch` (docs/speculation.md), with the
   break-even table measured by 1 and 2 (`--switch-table PATH` writes it), or the shipped one
   when this run has no eagle results.

    python benchmark/bench_spec_curve.py --tokenizer-dir TOK --work-dir /tmp/spec-curve

prints one table (output tokens/s per cell, EAGLE, adaptive and switch over plain) and the
adaptive config. Switched against plain alone, with known draft noises (no calibration):

    python benchmark/bench_spec_curve.py --tokenizer-dir TOK --modes plain,switch --accept 1.5 3.0 \
        --noises '{"1.5": 0.375, "3.0": 0.09375}' --batch-sizes 1 8 32 64 128 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EAGLE, engine_kwargs, print_table, random_prompts, run_in_subprocesses  # noqa: E402

CALIBRATION_BATCH = 16


def draft_fc(hidden: int, noise: float, seed: int = 1) -> torch.Tensor:
    """The draft's `fc.weight`: the embedding half passed through plus noise, the row half dropped."""
    gen = torch.Generator().manual_seed(seed)
    eye = torch.eye(hidden) + noise * torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
    return torch.cat([eye, torch.zeros(hidden, hidden)], dim=1).to(torch.bfloat16)


def set_noise(llm, hidden: int, noise: float) -> None:
    ok, message = llm.update_draft_weights_from_tensor([("fc.weight", draft_fc(hidden, noise))])
    if not ok:
        raise SystemExit(f"draft update failed: {message}")


def timed(llm, batch: int, args: argparse.Namespace, runs: int) -> dict:
    """Median output tok/s of `runs` batches (after one untimed) and tokens per verify step."""
    prompts = random_prompts(batch, args.prompt_len, seed=batch)
    sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    rates, tokens, steps = [], 0, 0
    for n in range(runs + 1):
        llm.flush_cache()
        t = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=sp)
        elapsed = time.perf_counter() - t
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        if n:
            rates.append(tokens / elapsed)
    return {"tok_s": round(statistics.median(rates), 1) if rates else None,
            "tokens_per_step": round(tokens / steps, 2) if steps else None}


def calibrate(llm, hidden: int, wanted: float, args: argparse.Namespace) -> tuple[float, float]:
    """The noise scale whose acceptance (tokens per step) is closest to `wanted`, by bisection;
    (0, the noiseless acceptance) when even that is below `wanted`."""
    low, high, best = 0.0, args.max_noise, None
    for noise in [0.0] + [None] * args.bisection_steps:
        noise = (low + high) / 2 if noise is None else noise
        set_noise(llm, hidden, noise)
        got = timed(llm, CALIBRATION_BATCH, args, 0)["tokens_per_step"]
        if best is None or abs(got - wanted) < abs(best[1] - wanted):
            best = (noise, got)
        if abs(got - wanted) <= 0.04 or (noise == 0.0 and got < wanted):
            break
        low, high = (noise, high) if got > wanted else (low, noise)
    return best


def one_process(args: argparse.Namespace) -> dict:
    import sglang as sgl

    from spec_models import make_eagle_pair

    root = Path(args.work_dir) / f"h{args.hidden}-l{args.layers}-s{args.layer_scale}"
    target, draft = make_eagle_pair(root, Path(args.tokenizer_dir), hidden=args.hidden, layers=args.layers,
                                    layer_scale=args.layer_scale)
    extra = {} if args.cpu else {"cuda_graph_max_bs_decode": max(args.batch_sizes)}
    if args.mode != "plain":
        extra.update(EAGLE, speculative_draft_model_path=str(draft))
    if args.mode in ("adaptive", "off"):
        extra.update(speculative_adaptive=True, speculative_adaptive_config=args.adaptive_config)
    if args.mode == "switch":
        extra.update(speculative_switch=True, speculative_switch_table=args.switch_table_file)
    if args.skip_zero_step_draft_extend:
        os.environ["SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"] = "1"
    t = time.perf_counter()
    llm = sgl.Engine(**engine_kwargs(str(target), False, not args.cpu, **extra))
    result = {"mode": args.mode, "startup_s": round(time.perf_counter() - t, 1), "cells": []}
    try:
        levels = [None] if args.mode in ("plain", "off") else args.accept  # off: the draft is unused
        noises = json.loads(args.noises) if args.noises else {}
        for wanted in levels:
            if wanted is not None:
                if str(wanted) not in noises:
                    noises[str(wanted)] = calibrate(llm, args.hidden, wanted, args)[0]
                set_noise(llm, args.hidden, noises[str(wanted)])
            for batch in args.batch_sizes:
                before = switch_steps(llm) if args.mode == "switch" else None
                cell = timed(llm, batch, args, args.timed_runs)
                if before is not None:  # drafting and plain steps of this cell (warm-up run included)
                    after = switch_steps(llm)
                    cell.update({k: after[k] - before[k] for k in ("steps_on", "steps_off", "plain_steps_in_graph")})
                    if after.get("error"):  # plain steps failed: the server drafted instead (see its log)
                        cell["switch_error"] = after["error"]
                result["cells"].append({"accept": wanted, "batch": batch, **cell})
                print(f"# {args.mode} accept {wanted} batch {batch}: {cell}", flush=True)
        result["noises"] = noises
    finally:
        llm.shutdown()
    return result


def switch_steps(llm) -> dict:
    """The speculation switch's state (`/get_server_info`'s `speculation_switch`)."""
    return llm.get_server_info()["internal_states"][0]["speculation_switch"]


def switch_table(plain: dict[int, float], eagle: list[dict], batch_sizes: list[int]) -> dict:
    """The speculation switch's table file: per timed batch size the break-even tokens per step,
    null where EAGLE never pays (or would need more tokens than a step can commit)."""
    steps = EAGLE["speculative_num_steps"]
    entries = {}
    for batch in batch_sizes:
        even = break_even(plain, eagle, batch)
        entries[str(batch)] = None if even is None or even > steps + 1 else round(even, 3)
    return {"description": f"EAGLE ({steps} steps, top-1) against plain decoding, bench_spec_curve.py on "
                           f"{gpu_name()}", "break_even_tokens_per_step": entries}


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"


def break_even(plain: dict[int, float], eagle: list[dict], batch: int) -> float | None:
    """Tokens per step where EAGLE's tok/s crosses plain's at `batch` (linear between measured
    acceptances); None if EAGLE never pays there."""
    points = sorted((c["tokens_per_step"], c["tok_s"] / plain[batch]) for c in eagle if c["batch"] == batch)
    for (a0, r0), (a1, r1) in zip(points, points[1:]):
        if r0 < 1.0 <= r1:
            return a0 + (1.0 - r0) * (a1 - a0) / (r1 - r0)
    return points[0][0] if points and points[0][1] >= 1.0 else None


def adaptive_config(plain: dict[int, float], eagle: list[dict], batch_sizes: list[int]) -> dict:
    """sglang's adaptive config: per batch-size slot, 3 draft steps or none, switching at the
    break-even (sglang compares the running mean of accepted drafts, i.e. tokens per step - 1,
    with 0.5 + down_hysteresis when it may drop to 0 steps)."""
    config = {}
    steps = EAGLE["speculative_num_steps"]
    for batch in batch_sizes:
        even = break_even(plain, eagle, batch)
        if even is None or even > steps + 1:
            config[str(batch)] = {"candidate_steps": [0]}  # never pays: never probe
        else:
            config[str(batch)] = {"candidate_steps": [0, steps], "warmup_batches": 4, "update_interval": 4,
                                  "down_hysteresis": round(even - 1 - 0.5, 3),
                                  "break_even_tokens_per_step": round(even, 3)}
    return with_drafting_slot(config, batch_sizes)


def with_drafting_slot(config: dict, batch_sizes: list[int]) -> dict:
    """sglang needs --speculative-num-steps among the config's steps: a slot above every timed
    batch size holds it if no timed slot drafts."""
    steps = EAGLE["speculative_num_steps"]
    if not any(steps in slot["candidate_steps"] for slot in config.values()):
        config[str(2 * max(batch_sizes))] = {"candidate_steps": [0, steps]}
    return config


def plot(results: dict, png: str) -> None:
    """EAGLE over plain against tokens per step, one line per batch size; drafting off dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain = {c["batch"]: c["tok_s"] for c in results["plain"]["cells"]}
    off = {c["batch"]: c["tok_s"] for c in results.get("off", {}).get("cells", [])}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted(plain):
        cells = sorted((c for c in results["eagle"]["cells"] if c["batch"] == batch), key=lambda c: c["tokens_per_step"])
        line, = ax.plot([c["tokens_per_step"] for c in cells], [c["tok_s"] / plain[batch] for c in cells], "o-",
                        label=f"EAGLE, batch {batch}")
        if batch in off:
            ax.axhline(off[batch] / plain[batch], color=line.get_color(), ls=":", lw=1,
                       label=f"drafting off (0 steps), batch {batch}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("accepted tokens per verify step")
    ax.set_ylabel("output tokens/s over plain decoding")
    ax.set_title("8B-shaped Llama (32 x 4096), EAGLE 3 steps top-1, H200")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-dir", required=True, help="tokenizer files copied into the written target")
    p.add_argument("--work-dir", default="/tmp/spec-curve", help="where the pair is written (kept)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer-scale", type=float, default=0.006,
                   help="the target's context part (smaller: the noiseless draft is accepted more often)")
    p.add_argument("--accept", type=float, nargs="+", default=[1.5, 2.0, 2.5, 3.0, 3.5],
                   help="tokens per verify step to set")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--timed-runs", type=int, default=2)
    p.add_argument("--bisection-steps", type=int, default=8)
    p.add_argument("--max-noise", type=float, default=4.0, help="upper end of the noise bisection")
    p.add_argument("--modes", default="plain,eagle,off,adaptive",
                   help="off: adaptive speculation held at 0 draft steps (what drafting switched off costs)")
    p.add_argument("--skip-zero-step-draft-extend", action="store_true",
                   help="sglang's SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND: at 0 steps the draft's KV cache is "
                   "not extended")
    p.add_argument("--reuse", help="a previous --out file: take its plain and eagle results instead of "
                   "running those modes again")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (float32; a small --hidden to try it)")
    p.add_argument("--out", help="write every process's result here (JSON)")
    p.add_argument("--plot", metavar="PNG", help="only draw the curve of --reuse's results into PNG")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--noises", help="JSON {acceptance: draft fc noise} from an earlier run's eagle results: "
                                     "skips the calibration of those acceptances")
    p.add_argument("--adaptive-config", help=argparse.SUPPRESS)
    p.add_argument("--switch-table", metavar="PATH",
                   help="write the speculation switch's break-even table measured by the plain and eagle modes here "
                        "(give it to a server with --speculative-switch-table PATH)")
    p.add_argument("--switch-table-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(one_process(args)), flush=True)
        return

    if args.plot:
        plot(json.loads(Path(args.reuse).read_text()), args.plot)
        return
    modes = args.modes.split(",")
    argv = list(sys.argv[1:])
    results = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    first = [m for m in modes if m in ("plain", "eagle") and m not in results]
    results.update({r["mode"]: r for r in run_in_subprocesses(__file__, argv, "--mode", first)})
    plain = {c["batch"]: c["tok_s"] for c in results["plain"]["cells"]}
    rows = [{"accept_set": "plain", "batch": b, "plain_tok_s": s} for b, s in plain.items()]
    if "switch" in modes:
        table_argv = []
        if "eagle" in results:
            table = switch_table(plain, results["eagle"]["cells"], args.batch_sizes)
            path = Path(args.switch_table or Path(args.work_dir) / "switch_table.json")
            path.write_text(json.dumps(table, indent=1) + "\n")
            print(f"switch table ({path}): {json.dumps(table['break_even_tokens_per_step'])}")
            table_argv = ["--switch-table-file", str(path)]
        noise_argv = [] if args.noises or "eagle" not in results else \
            ["--noises", json.dumps(results["eagle"]["noises"])]
        results.update({r["mode"]: r for r in run_in_subprocesses(__file__, argv + table_argv + noise_argv, "--mode",
                                                                   ["switch"])})
        if "eagle" not in results:
            rows = [{"accept_set": c["accept"], "batch": c["batch"], "plain_tok_s": plain[c["batch"]],
                     "switch_tok_s": c["tok_s"], "switch_vs_plain": round(c["tok_s"] / plain[c["batch"]], 3),
                     "switch_tokens_per_step": c["tokens_per_step"], "switch_steps_on": c.get("steps_on"),
                     "switch_steps_off": c.get("steps_off"),
                     "switch_off_steps_in_graph": c.get("plain_steps_in_graph")} for c in results["switch"]["cells"]]
    if "eagle" in results:
        eagle = results["eagle"]["cells"]
        config = adaptive_config(plain, eagle, args.batch_sizes)
        noises = ["--noises", json.dumps(results["eagle"]["noises"])]
        for mode, mode_config in (("off", with_drafting_slot({"1": {"candidate_steps": [0]}}, args.batch_sizes)),
                                  ("adaptive", config)):
            if mode in modes:
                path = Path(args.work_dir) / f"{mode}_config.json"
                path.write_text(json.dumps(mode_config, indent=1))
                extra = argv + noises + ["--adaptive-config", str(path)]
                results.update({r["mode"]: r for r in run_in_subprocesses(__file__, extra, "--mode", [mode])})
        by_mode = {m: {(c["accept"], c["batch"]): c for c in results.get(m, {}).get("cells", [])}
                   for m in ("off", "adaptive", "switch")}
        rows = []
        for c in eagle:
            row = {"accept_set": c["accept"], "batch": c["batch"], "tokens_per_step": c["tokens_per_step"],
                   "plain_tok_s": plain[c["batch"]], "eagle_tok_s": c["tok_s"],
                   "eagle_vs_plain": round(c["tok_s"] / plain[c["batch"]], 3)}
            for m, cells in by_mode.items():
                got = cells.get((None if m == "off" else c["accept"], c["batch"]))
                if got:
                    row.update({f"{m}_tok_s": got["tok_s"], f"{m}_vs_plain": round(got["tok_s"] / plain[c["batch"]], 3),
                                f"{m}_tokens_per_step": got["tokens_per_step"]})
            rows.append(row)
        print("\nadaptive config (break-even tokens per step per batch-size slot):")
        print(json.dumps(config))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nEAGLE (3 steps, top-1) vs plain decoding, h{args.hidden} x {args.layers} layers, greedy, "
          f"{args.prompt_len} prompt + {args.output_len} output tokens, median of {args.timed_runs} timed runs")
    print_table(rows, [c for c in ["accept_set", "batch", "tokens_per_step", "plain_tok_s", "eagle_tok_s", "eagle_vs_plain",
                       "off_tok_s", "off_vs_plain", "adaptive_tok_s", "adaptive_vs_plain", "adaptive_tokens_per_step",
                       "switch_tok_s", "switch_vs_plain", "switch_tokens_per_step", "switch_steps_on",
                       "switch_steps_off", "switch_off_steps_in_graph"] if any(c in r for r in rows)])


if __name__ == "__main__":
    main()
