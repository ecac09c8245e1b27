"""TOPLOC on a real sglang Engine: decode throughput with verification off vs on, and honest
replay pass rates, in one run. Prints a markdown table.

GPU (8B-shaped dummy weights):
    python benchmark/bench_toploc.py --model-path /tmp/m8b --dummy
GPU, the same with EAGLE (a Llama target + an EAGLE draft built to be accepted, spec_models.py):
    python benchmark/bench_toploc.py --eagle --tokenizer-dir /tmp/tok --disable-cuda-graph
CPU smoke run (default model):
    python benchmark/bench_toploc.py --cpu --shapes 4x16x16 --replay-total 4

Each mode runs in its own process (a fresh Engine), so the modes share nothing. Every shape is
timed `--timed-runs` times after one untimed run; the table gives the median and the spread
(min..max) of output tokens per second, and on/off as the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    engine_kwargs, model_parser, parse_with_model, print_table, random_prompts, run_in_subprocesses,
)

EAGLE = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
             speculative_num_draft_tokens=4)


def parse_shape(text: str) -> tuple[int, int, int]:
    """'64x128x128' -> (requests, prompt tokens, output tokens)."""
    num, prompt, output = (int(v) for v in text.lower().split("x"))
    return num, prompt, output


def engine_for(args: argparse.Namespace, toploc: bool):
    import sglang as sgl

    if args.eagle:
        from spec_models import make_eagle_pair

        target, draft = make_eagle_pair(Path(args.work_dir), Path(args.tokenizer_dir))
        kw = engine_kwargs(str(target), False, not args.cpu, speculative_draft_model_path=str(draft), **EAGLE)
    else:
        kw = engine_kwargs(args.model_path, args.dummy, not args.cpu)
    if args.disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    return sgl.Engine(**kw, toploc_verification=toploc)


def timed_shape(llm, shape: tuple[int, int, int], runs: int) -> dict:
    """Median and spread of output tok/s over `runs` timed batches of one shape."""
    num, prompt_len, output_len = shape
    prompts = random_prompts(num, prompt_len, seed=prompt_len * 7 + num)
    sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    llm.generate(input_ids=prompts, sampling_params=sp)  # untimed: graphs, allocator, caches
    rates, spec_steps = [], 0
    for _ in range(runs):
        llm.flush_cache()
        t = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=sp)
        rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t))
        spec_steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "median": round(statistics.median(rates), 1),
        "spread": f"{min(rates):.0f}..{max(rates):.0f}",
        "fingerprinted": sum("toploc_verification_fingerprints" in o["meta_info"] for o in outs),
        "tokens_per_step": round(tokens / spec_steps, 2) if spec_steps else "",
    }


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    t0 = time.time()
    llm = engine_for(args, toploc=(mode == "on"))
    result = {"mode": mode, "startup_s": round(time.time() - t0, 1), "shapes": {}}
    for text in args.shapes:
        result["shapes"][text] = timed_shape(llm, parse_shape(text), args.timed_runs)
    if mode == "on" and args.replay_total:
        result.update(replays(llm, args))
    llm.shutdown()
    return result


def replays(llm, args: argparse.Namespace) -> dict:
    """Generate at each batch size, then verify every response in its exact-token form."""
    import random

    rng = random.Random(1)
    passed = total = worst = 0
    per_bs: dict[int, list[int]] = {}
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
            checks = llm.generate(input_ids=ids, sampling_params=[
                {"max_new_tokens": 0, "toploc_verification_fingerprint_to_validate": fp} for fp in fps])
            for c in checks:
                r = json.loads(c["meta_info"]["toploc_verification_fingerprint_validation_result"])
                total += 1
                passed += bool(r["verified"])
                worst = max(worst, r.get("worst_exp_mismatches") or 0)
                counts = per_bs.setdefault(bs, [0, 0])
                counts[0] += bool(r["verified"])
                counts[1] += 1
    return {"replays_passed": f"{passed}/{total}", "worst_exp_mismatches": worst,
            "per_batch_size": json.dumps({k: f"{v[0]}/{v[1]}" for k, v in per_bs.items()})}


def table(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """One line per (shape, mode), with on/off from the medians."""
    base = {text: r["shapes"][text]["median"] for r in rows if r["mode"] == "off" for text in r["shapes"]}
    lines = []
    for text in args.shapes:
        for r in rows:
            cell = r["shapes"][text]
            lines.append({"shape": text, "mode": r["mode"], "median_tok_per_s": cell["median"],
                          "spread": cell["spread"],
                          "vs_off": round(cell["median"] / base[text], 3) if text in base else "",
                          "tokens_per_step": cell["tokens_per_step"], "fingerprinted": cell["fingerprinted"],
                          "startup_s": r["startup_s"]})
    return lines


def main() -> None:
    p = model_parser(__doc__)
    p.add_argument("--shapes", nargs="+", default=["64x128x128", "64x512x512", "8x128x128"],
                   help="requests x prompt tokens x output tokens")
    p.add_argument("--timed-runs", type=int, default=3)
    p.add_argument("--replay-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--replay-total", type=int, default=200)
    p.add_argument("--modes", default="off,on")
    p.add_argument("--eagle", action="store_true", help="EAGLE target + draft from spec_models.py")
    p.add_argument("--tokenizer-dir", default="/tmp/tok", help="tokenizer files for --eagle")
    p.add_argument("--work-dir", default="/tmp/bench-toploc-eagle", help="where --eagle writes its models")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="both modes without CUDA graphs (the GPU kit lacks deep_gemm, which EAGLE's draft "
                        "graph capture imports)")
    p.add_argument("--one-mode", help=argparse.SUPPRESS)
    args = p.parse_args() if "--eagle" in sys.argv else parse_with_model(p)
    if args.one_mode:
        print("RESULT " + json.dumps(run_mode(args, args.one_mode)), flush=True)
        return
    rows = run_in_subprocesses(__file__, sys.argv[1:], "--one-mode", args.modes.split(","))
    what = "EAGLE target + draft (spec_models.py)" if args.eagle else args.model_path
    print(f"\nTOPLOC on vs off: {what}, greedy, ignore_eos, {args.timed_runs} timed runs per shape")
    print_table(table(rows, args), ["shape", "mode", "median_tok_per_s", "spread", "vs_off", "tokens_per_step",
                                    "fingerprinted", "startup_s"])
    replay = [r for r in rows if "replays_passed" in r]
    if replay:
        print()
        print_table(replay, ["mode", "replays_passed", "worst_exp_mismatches", "per_batch_size"])


if __name__ == "__main__":
    main()
