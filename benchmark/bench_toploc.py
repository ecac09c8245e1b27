"""TOPLOC on a real sglang Engine: decode throughput with verification off vs on, and honest
replay pass rates at several batch sizes, in one run. Prints a markdown table.

GPU (8B-shaped dummy weights):  python benchmark/bench_toploc.py --model-path /tmp/m8b --dummy
CPU smoke run (default model):   python benchmark/bench_toploc.py --cpu --num 4 --output-len 16

Each mode runs in its own process (a fresh Engine), so the two measurements share nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    engine_kwargs, model_parser, parse_with_model, print_table, random_prompts, run_in_subprocesses,
)


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    import sglang as sgl

    kw = engine_kwargs(args.model_path, args.dummy, not args.cpu, toploc_verification=(mode == "on"))
    t0 = time.time()
    llm = sgl.Engine(**kw)
    startup = time.time() - t0
    prompts = random_prompts(args.num, args.input_len)
    sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    llm.generate(input_ids=prompts[:4], sampling_params={**sp, "max_new_tokens": 8})
    best = None
    for _ in range(args.repeats):
        t = time.time()
        outs = llm.generate(input_ids=prompts, sampling_params=sp)
        dt = time.time() - t
        toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
        best = max(best or 0.0, toks / dt)
    result = {"mode": mode, "startup_s": round(startup, 1), "out_tok_per_s": round(best, 1),
              "fingerprinted": sum("toploc_verification_fingerprints" in o["meta_info"] for o in outs)}
    if mode == "on":
        result.update(replays(llm, args))
    llm.shutdown()
    return result


def replays(llm, args: argparse.Namespace) -> dict:
    """Generate at each batch size, then verify every response in its exact-token form."""
    import random

    rng = random.Random(1)
    passed = total = 0
    worst = 0
    per_bs = {}
    for bs in args.replay_batch_sizes:
        for _ in range(max(1, args.replay_total // (bs * len(args.replay_batch_sizes)))):
            prompts = [random_prompts(1, rng.randint(4, 300), seed=rng.randint(0, 10**9))[0] for _ in range(bs)]
            lens = [rng.choice([1, 7, 32, 33, 100, 200]) for _ in range(bs)]
            outs = llm.generate(
                input_ids=prompts,
                sampling_params=[{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lens],
                return_output_ids=True,
            )
            ids = [p + list(o["output_ids"]) for p, o in zip(prompts, outs)]
            fps = [o["meta_info"]["toploc_verification_fingerprints"][-1] for o in outs]
            checks = [
                llm.generate(input_ids=i, sampling_params={"max_new_tokens": 0},
                             toploc_verification_fingerprint_to_validate=fp)
                for i, fp in zip(ids, fps)
            ]
            for c in checks:
                r = json.loads(c["meta_info"]["toploc_verification_fingerprint_validation_result"])
                total += 1
                passed += bool(r["verified"])
                worst = max(worst, r.get("exp_mismatches") or 0)
                per_bs.setdefault(bs, [0, 0])
                per_bs[bs][0] += bool(r["verified"])
                per_bs[bs][1] += 1
    return {"replays_passed": f"{passed}/{total}", "worst_exp_mismatches": worst,
            "per_batch_size": json.dumps({k: f"{v[0]}/{v[1]}" for k, v in per_bs.items()})}


def main() -> None:
    p = model_parser(__doc__)
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--replay-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--replay-total", type=int, default=200)
    p.add_argument("--modes", default="off,on")
    p.add_argument("--one-mode", help=argparse.SUPPRESS)
    args = parse_with_model(p)
    if args.one_mode:
        print("RESULT " + json.dumps(run_mode(args, args.one_mode)), flush=True)
        return
    rows = run_in_subprocesses(__file__, sys.argv[1:], "--one-mode", args.modes.split(","))
    base = next((r["out_tok_per_s"] for r in rows if r["mode"] == "off"), None)
    for r in rows:
        r["vs_off"] = round(r["out_tok_per_s"] / base, 3) if base else ""
    print(f"\nTOPLOC overhead: {args.num} requests x {args.input_len} prompt -> {args.output_len} output tokens, greedy")
    print_table(rows, ["mode", "out_tok_per_s", "vs_off", "fingerprinted", "replays_passed",
                       "worst_exp_mismatches", "per_batch_size", "startup_s"])


if __name__ == "__main__":
    main()
