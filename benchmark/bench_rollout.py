"""One RL step's rollouts, timed: N GSM8K prompts x G samples submitted together (as verl does,
G copies of each prompt), sampled at each --temperatures, up to --max-new-tokens each.

For every arm (a server) and temperature it runs --steps RL steps back to back (each step its own
prompts, the same prompts for every arm) and reports per step: the wall time, the tail (from the
moment 90% of the responses were done to the last one), output tok/s, acceptance (tokens per verify
step, from the responses' meta_info) and each arm's speedup over `plain` on the same prompts.

Arms:
  plain           no speculation
  eagle           EAGLE with a fixed drafter (3 steps, top-1, 4 draft tokens)
  switch          EAGLE with the speculation switch (--speculative-switch)
  switch-cotrain  EAGLE with the switch and co-training (--drafter-cotrain); between steps the
                  bench waits (not timed, up to --gap-s) for the rounds of the step's rollouts,
                  as the rollout server idles while an RL trainer updates the policy

Each arm is a running server (--server ARM=URL) or started here, one at a time, from --model-path
and --drafter (`python -m sglang.launch_server` with benchmark/common.py's settings). A started arm
whose flag the server does not know ends the run with a one-line message.

Prompts: the measured steps take the last --pool prompts of GSM8K (default 512), step by step;
the drafter for the target is trained on the others (benchmark/gpu_rollout.sh: bench_cotrain.py
train on the first 807, then `sglang-rl drafter widen` for the widened 8B model).

  python benchmark/bench_rollout.py --model-path MODEL --drafter DRAFTER --out rollout.json
  python benchmark/bench_rollout.py --model-path MODEL --drafter D --arms plain,eagle --prompts 32 --samples 8 \
      --max-new-tokens 1024 --temperatures 0.7 --out a.json
  python benchmark/bench_rollout.py --report a.json b.json     # one table from several runs
  python benchmark/bench_rollout.py --server plain=http://127.0.0.1:30000 --server eagle=http://127.0.0.1:30001 \
      --prompts 2 --samples 2 --max-new-tokens 16 --temperatures 1.0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EAGLE, engine_kwargs, print_table  # noqa: E402
from rollout_server import Launched, check_server, cli_flags  # noqa: E402

ARMS = ("plain", "eagle", "switch", "switch-cotrain")
GSM8K_PROMPTS = 1319
COTRAIN_DEFAULT = ("--drafter-cotrain --drafter-cotrain-samples-per-round 256 --drafter-cotrain-steps 50 "
                   "--drafter-cotrain-lr 1e-4 --drafter-cotrain-train-in-gaps")
COLUMNS = ["arm", "temp", "step", "responses", "wall_s", "tail_s", "tok_s", "accept", "speedup", "tail_speedup"]


# --- prompts -------------------------------------------------------------------------------------


def step_prompts(model_path: str, n: int, pool: int, count: int) -> list[tuple[int, list[list[int]]]]:
    """The n chat prompts (token ids) of each of `count` measured steps: consecutive prompts of the
    last `pool` GSM8K prompts, wrapping around within them; with each step's first GSM8K index."""
    from transformers import AutoTokenizer

    from sglang_rl.datasets import gsm8k_path

    with open(gsm8k_path()) as f:
        chats = [json.loads(line)["messages"] for line in f]
    tok = AutoTokenizer.from_pretrained(model_path)
    start, steps = len(chats) - pool, []
    for index in range(count):
        picked = [start + (index * n + i) % pool for i in range(n)]
        steps.append((picked[0], [tok(tok.apply_chat_template(chats[k], tokenize=False, add_generation_prompt=True),
                                      add_special_tokens=False)["input_ids"] for k in picked]))
    return steps


# --- servers -------------------------------------------------------------------------------------


def draft_algorithm(drafter: str) -> str:
    arch = json.loads((Path(drafter) / "config.json").read_text())["architectures"][0]
    return "EAGLE3" if arch.endswith("Eagle3") else "EAGLE"


def arm_flags(arm: str, args: argparse.Namespace) -> list[str]:
    """launch_server flags of a started arm."""
    extra: dict[str, Any] = {"max_running_requests": args.prompts * args.samples} if not args.cpu else \
        {"sleep_on_idle": True}
    if arm != "plain":
        if not args.drafter:
            raise SystemExit(f"arm {arm}: give --drafter DIR (or --server {arm}=URL)")
        extra.update(EAGLE, speculative_algorithm=draft_algorithm(args.drafter),
                     speculative_draft_model_path=args.drafter)
    flags = cli_flags(engine_kwargs(args.model_path, False, not args.cpu, **extra))
    if arm.startswith("switch"):
        flags.append("--speculative-switch")
    if arm == "switch-cotrain":
        flags += args.cotrain_flags.split()
    return flags + args.server_flags.split()


# --- one RL step ---------------------------------------------------------------------------------


async def _rollouts(url: str, prompts: list[list[int]], samples: int, sampling: dict, timeout: float,
                    label: str) -> tuple[float, list[dict]]:
    """Every prompt `samples` times, all at once; (start, results with each one's done time)."""
    import aiohttp
    from tqdm import tqdm

    results: list[dict] = []
    bar = tqdm(total=len(prompts) * samples, desc=label, unit="req", file=sys.stderr, mininterval=1.0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def one(p: int, ids: list[int]) -> None:
            async with session.post(url + "/generate", json={"input_ids": ids, "sampling_params": sampling}) as r:
                body = await r.json(content_type=None)
                if r.status != 200:
                    raise SystemExit(f"{label}: HTTP {r.status}: {str(body)[:500]}")
            meta = body["meta_info"]
            results.append({"prompt": p, "done": time.perf_counter(), "tokens": meta["completion_tokens"],
                            "verify": int(meta.get("spec_verify_ct") or 0), "finish": meta.get("finish_reason"),
                            "histogram": meta.get("spec_correct_drafts_histogram"), "text": body["text"]})
            bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(one(p, ids) for p, ids in enumerate(prompts) for _ in range(samples)))
    bar.close()
    return start, results


def step_metrics(start: float, results: list[dict]) -> dict:
    """Wall time, tail, tok/s and acceptance of one step's responses."""
    from sglang_rl.drafter.acceptance import merge_histograms, position_accept_rates

    done = sorted(r["done"] - start for r in results)
    tokens, verify = sum(r["tokens"] for r in results), sum(r["verify"] for r in results)
    wall = done[-1]
    hist = merge_histograms(r["histogram"] for r in results)
    rates = position_accept_rates(hist, EAGLE["speculative_num_steps"]) if hist else []
    lengths = sorted(r["tokens"] for r in results)
    return {"responses": len(results), "wall_s": round(wall, 3),
            "tail_s": round(wall - done[math.ceil(0.9 * len(done)) - 1], 3),
            "tokens": tokens, "tok_s": round(tokens / wall, 1), "verify_steps": verify,
            "accept": round(tokens / verify, 3) if verify else None, "accept_histogram": hist,
            "position_accept": [None if r is None else round(r, 3) for r in rates],
            "length_median": lengths[len(lengths) // 2], "length_max": lengths[-1],
            "finished_by_length": sum(r["finish"] is not None and r["finish"].get("type") == "length" for r in results),
            "done_s": [round(d, 3) for d in done]}


def cotrain_stats(url: str) -> Optional[dict]:
    import requests

    r = requests.get(url + "/drafter_cotrain_stats", timeout=60)
    return r.json() if r.status_code == 200 else None


def posted(stats: dict) -> int:
    """Finished rollouts the server handed to co-training (trained on, too short, or skipped)."""
    return stats["samples"] + stats.get("samples_dropped", 0) + stats.get("samples_skipped_busy", 0)


def wait_for_rounds(url: str, info: dict, responses: int, gap_s: float) -> dict:
    """Between two steps: until the server handed the `responses` rollouts so far to co-training
    and trained their rounds, or gap_s passed (asking for the statistics also lets the scheduler
    load a finished round)."""
    per_round = int(info.get("drafter_cotrain_samples_per_round") or 1)
    deadline = time.time() + gap_s
    stats = cotrain_stats(url) or {}
    while stats and time.time() < deadline and not stats["errors"]:
        if posted(stats) >= responses and stats["rounds"] + stats.get("rounds_held", 0) >= stats["samples"] // per_round:
            break
        time.sleep(0.5)
        stats = cotrain_stats(url) or {}
    return stats


def cotrain_row(stats: dict) -> dict:
    counters = ("rounds", "rounds_held", "samples", "samples_dropped", "samples_skipped_busy")
    return {**{k: stats.get(k, 0) for k in counters}, "acceptance_length": stats.get("acceptance_length")}


def run_arm(arm: str, url: str, info: dict, args: argparse.Namespace, deadline: float, steps: list[dict]) -> None:
    """The arm's steps at every temperature: each step's metrics (and co-training state) appended
    to `steps` as it ends."""
    import requests

    responses = 0
    sampling_base = {"max_new_tokens": args.max_new_tokens}
    # warm-up, untimed: a short request through the whole path (kept out of co-training)
    opt_out = {"drafter_cotrain": False} if arm.endswith("cotrain") else {}
    requests.post(url + "/generate", json={"input_ids": args.step_ids[0][1][0], "sampling_params": {"max_new_tokens": 4},
                                           **opt_out}, timeout=args.timeout).raise_for_status()
    for ti, temp in enumerate(args.temperatures):
        for k in range(args.steps):
            if time.time() > deadline:
                print(f"# {arm}: --budget-s reached, temperature {temp} step {k + 1} not run", flush=True)
                return
            first, prompts = args.step_ids[ti * args.steps + k]
            requests.post(url + "/flush_cache", timeout=60)
            label = f"{arm} T={temp} step {k + 1}/{args.steps}"
            start, results = asyncio.run(_rollouts(url, prompts, args.samples, {**sampling_base, "temperature": temp},
                                                   args.timeout, label))
            row = {"arm": arm, "temp": temp, "step": k + 1, "first_prompt": first, **step_metrics(start, results)}
            if temp == 0:
                row["texts"] = [r["text"] for r in sorted(results, key=lambda r: r["prompt"])]
            responses += len(results)
            if arm.endswith("cotrain"):  # the state at the step's end, and after the untimed gap
                row["cotrain"] = {"at_end": cotrain_row(cotrain_stats(url) or {})}
                if k + 1 < args.steps or ti + 1 < len(args.temperatures):
                    t = time.perf_counter()
                    row["cotrain"]["after_gap"] = cotrain_row(wait_for_rounds(url, info, responses, args.gap_s))
                    row["cotrain"]["gap_s"] = round(time.perf_counter() - t, 1)
            trained = (f", co-training rounds {row['cotrain']['at_end']['rounds']} at the end, "
                       f"{row['cotrain'].get('after_gap', {}).get('rounds')} after the gap") if "cotrain" in row else ""
            print(f"# {label}: {row['wall_s']} s, tail {row['tail_s']} s, {row['tok_s']} tok/s, accept {row['accept']}"
                  + trained, flush=True)
            steps.append(row)


# --- report --------------------------------------------------------------------------------------


def table_rows(arms: dict) -> list[dict]:
    """One row per arm, temperature and step, with the speedup over plain's step on the same prompts."""
    plain = {(r["temp"], r["step"]): r for r in arms.get("plain", {}).get("steps", [])}
    rows = []
    for arm, data in arms.items():
        for r in data["steps"]:
            base = plain.get((r["temp"], r["step"]))
            row = {c: r.get(c) for c in COLUMNS}
            row["accept"] = "-" if r.get("accept") is None else r["accept"]
            if "cotrain" in r:  # rounds trained by the step's end
                row["rounds"] = r["cotrain"]["at_end"]["rounds"]
            row["speedup"] = round(base["wall_s"] / r["wall_s"], 3) if base else "-"
            row["tail_speedup"] = round(base["tail_s"] / r["tail_s"], 3) if base and r["tail_s"] else "-"
            if r["temp"] == 0 and base and "texts" in r:  # greedy: the target decides every token
                row["same_as_plain"] = f"{sum(a == b for a, b in zip(r['texts'], base['texts']))}/{len(r['texts'])}"
            rows.append(row)
    return rows


def print_report(report: dict) -> list[dict]:
    c = report["config"]
    print(f"\nRL-step rollouts: {c['prompts']} GSM8K prompts x {c['samples']} samples, up to {c['max_new_tokens']} "
          f"new tokens, {c['steps']} step(s) per temperature; model {c['model']}")
    rows = table_rows(report["arms"])
    columns = COLUMNS + [c for c in ("rounds", "same_as_plain") if any(c in r for r in rows)]
    print_table(rows, columns)
    return rows


def merge_reports(files: list[str]) -> dict:
    merged: dict = {}
    for f in files:
        data = json.loads(Path(f).read_text())
        if not merged:
            merged = data
        else:
            merged["arms"].update(data["arms"])
    return merged


# --- main ----------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="target model folder (default: the converted SmolLM2); its tokenizer "
                   "makes the prompts also for --server arms")
    p.add_argument("--drafter", help="EAGLE/EAGLE3 drafter folder of the target, for the started speculative arms")
    p.add_argument("--server", action="append", default=[], metavar="ARM=URL", help="a running server for an arm")
    p.add_argument("--arms", help=f"arms to run, in order (default: the --server arms, else {','.join(ARMS)})")
    p.add_argument("--prompts", type=int, default=64, help="N: prompts per RL step")
    p.add_argument("--samples", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--steps", type=int, default=1, help="RL steps per temperature, back to back")
    p.add_argument("--pool", type=int, default=512, help="the measured prompts: the last this many of GSM8K")
    p.add_argument("--gap-s", type=float, default=60.0,
                   help="co-training arms: longest untimed wait between steps for the rounds of the step's rollouts")
    p.add_argument("--cotrain-flags", default=COTRAIN_DEFAULT, help="launch flags of a started switch-cotrain arm")
    p.add_argument("--server-flags", default="", help="further launch flags of every started arm")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no step after this many seconds")
    p.add_argument("--timeout", type=float, default=1800.0, help="HTTP timeout of a step's requests")
    p.add_argument("--cpu", action="store_true", help="start the arms on the CPU (float32)")
    p.add_argument("--log-dir", default=os.environ.get("SGLANG_RL_TEST_LOGS", "/tmp/bench-rollout-logs"))
    p.add_argument("--out", help="write the raw results here (JSON)")
    p.add_argument("--report", nargs="+", metavar="JSON", help="print one table from earlier --out files")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.report:
        print_report(merge_reports(args.report))
        return
    servers = dict(s.split("=", 1) for s in args.server)
    arms = args.arms.split(",") if args.arms else (list(servers) or list(ARMS))
    unknown = [a for a in arms + list(servers) if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm {unknown[0]} (arms: {', '.join(ARMS)})")
    if args.model_path is None:
        from sglang_rl.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    if args.pool > GSM8K_PROMPTS:
        raise SystemExit(f"--pool is at most {GSM8K_PROMPTS}")
    deadline = time.time() + args.budget_s
    infos = {arm: check_server(arm, url) for arm, url in servers.items() if arm in arms}  # fail before any work
    # a time limit's SIGTERM ends the run through the finally below, which stops a started server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_rollout: stopped by SIGTERM"))
    args.step_ids = step_prompts(args.model_path, args.prompts, args.pool, len(args.temperatures) * args.steps)
    report = {"config": {"model": args.model_path, "drafter": args.drafter, "prompts": args.prompts,
                         "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                         "temperatures": args.temperatures, "steps": args.steps, "pool": args.pool,
                         "device": "cpu" if args.cpu else "gpu", "eagle": EAGLE}, "arms": {}}
    for arm in arms:
        launched = None
        if arm in servers:
            url = servers[arm]
        else:
            print(f"# starting {arm}", flush=True)
            launched = Launched(arm, arm_flags(arm, args), Path(args.log_dir), args.cpu)
            url = launched.url
        report["arms"][arm] = {"server": url if launched is None else "started",
                               "startup_s": launched.startup_s if launched else None, "steps": []}
        try:
            run_arm(arm, url, infos.get(arm) or check_server(arm, url), args, deadline, report["arms"][arm]["steps"])
        finally:
            if launched is not None:
                launched.stop()
            if args.out:  # after every arm, and when stopped: a run cut short keeps the steps it measured
                Path(args.out).write_text(json.dumps(report, indent=1))
    print_report(report)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
