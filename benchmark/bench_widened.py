"""The widened SmolLM2 at an 8B model's shape: does it cost what the 8B shape costs, and does it
still answer as SmolLM2 does?

Builds the widened folder of each --layouts entry from --model-path (as `sglang-rl model --shape
llama-8b --out DIR` does; kept in --work-dir and reused when built the same way), then runs one
fresh Engine per process, one after another:
1. widened (the first layout): decode tok/s at each --batch-sizes (random prompts of --prompt-len,
   --output-len new tokens, greedy, ignore_eos; median of --timed-runs after one untimed run), then
   greedy answers to --agree-prompts GSM8K chat prompts (at most --agree-tokens each);
2. dummy: the same shape and config with --load-format dummy (random weights): decode tok/s;
3. small: SmolLM2 itself: the same greedy answers;
4. widened-LAYOUT for every further layout: the greedy answers;
5. with --control, small-serial: SmolLM2 again, one request at a time: how far bf16 batching alone
   moves SmolLM2's own answers (the floor under the widened model's agreement);
6. with --drafter DIR (a drafter of SmolLM2, widened here by `sglang-rl drafter widen`): small-eagle
   and widened-eagle answer the GSM8K prompts with EAGLE (3 steps, top-1): acceptance of both pairs;
   widened-eagle is also timed, for the speedup over plain decoding of the widened model.
Prints the decode table (widened over dummy) and, per layout, the agreement with SmolLM2 (answers
identical, mean share of an answer that is a common prefix); writes everything as JSON to --out.

    python benchmark/bench_widened.py --model-path SMOLLM2_DIR --work-dir /tmp/widened --out widened.json
    python benchmark/bench_widened.py --model-path SMOLLM2_DIR --layouts copies,zeros --out widened.json
    python benchmark/bench_widened.py --cpu --out /tmp/widened-cpu.json   # small shape, float32, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EAGLE, engine_kwargs, print_table, random_prompts, run_in_subprocesses  # noqa: E402

from sglang_rl.drafter.acceptance import merge_histograms, position_accept_rates, tokens_per_step  # noqa: E402

# a small real widening of every dimension, for trying the script on a CPU
CPU_SHAPE = {"hidden_size": 768, "num_heads": 12, "num_kv_heads": 4, "head_dim": 128, "intermediate_size": 1600,
             "num_layers": 31}
SIZE_FLAGS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers")


def wide_shape(args: argparse.Namespace, small_cfg: dict):
    from sglang_rl.widen.shape import NAMED_SHAPES, Shape

    base = NAMED_SHAPES[args.shape] if args.shape else Shape.from_config(small_cfg)
    return base.replace(hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
                        num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim,
                        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers)


def build_folders(args: argparse.Namespace) -> dict:
    """The widened folder of each --layouts entry (built unless an identical one is there) and the
    dummy twin of the first (config and tokenizer only)."""
    from sglang_rl.widen.model import widen_model
    from sglang_rl.widen.writer import copy_side_files

    src, work = Path(args.model_path), Path(args.work_dir)
    small_cfg = json.loads((src / "config.json").read_text())
    shape = wide_shape(args, small_cfg)
    layouts = args.layouts.split(",")
    folders = {"small": str(src), "dummy": str(work / "dummy"), "build_s": {}}
    for n, layout in enumerate(layouts):
        wide = work / f"widened-{layout}"
        stamp = {"src": str(src.resolve()), "shape": shape.__dict__, "layout": layout, "dtype": args.dtype}
        stamp_file = work / f"widened-{layout}.stamp.json"
        t = time.perf_counter()
        if not (stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp
                and (wide / "config.json").exists()):
            work.mkdir(parents=True, exist_ok=True)
            # small shards on a CPU box: the writer holds one shard in memory
            widen_model(src, wide, shape, layout=layout, dtype=args.dtype, log=print,
                        shard_bytes=(256 if args.cpu else 2048) << 20)
            stamp_file.write_text(json.dumps(stamp))
        folders["build_s"][layout] = round(time.perf_counter() - t, 1)
        folders["widened" if n == 0 else f"widened-{layout}"] = str(wide)
    if args.drafter:
        from sglang_rl.widen.drafter import widen_drafter

        out, arch = widen_drafter(args.drafter, folders["widened"], work / "drafter-widened")
        folders.update({"drafter-small": str(Path(args.drafter).resolve()), "drafter-widened": str(out),
                        "draft_algorithm": "EAGLE3" if arch.endswith("Eagle3") else "EAGLE"})
    dummy = Path(folders["dummy"])
    shutil.rmtree(dummy, ignore_errors=True)
    dummy.mkdir(parents=True)
    shutil.copyfile(Path(folders["widened"]) / "config.json", dummy / "config.json")
    copy_side_files(Path(folders["widened"]), dummy)
    vocab = int(small_cfg["vocab_size"])
    return {**folders, "shape": shape.__dict__, "parameters": shape.num_parameters(vocab), "layouts": layouts}


def timed(llm, batch: int, args: argparse.Namespace, prompts: list[list[int]] | None = None) -> float:
    """Median output tok/s of --timed-runs batches after one untimed one (random prompts unless given)."""
    prompts = prompts or random_prompts(batch, args.prompt_len, seed=batch)
    sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    rates = []
    for n in range(args.timed_runs + 1):
        llm.flush_cache()
        t = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=sp)
        elapsed = time.perf_counter() - t
        if n:
            rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / elapsed)
    return round(statistics.median(rates), 1)


def gsm8k_prompts(model_path: str, n: int, start: int = 0) -> list[list[int]]:
    from transformers import AutoTokenizer

    from sglang_rl.datasets import gsm8k_path

    tok = AutoTokenizer.from_pretrained(model_path)
    with open(gsm8k_path()) as f:
        chats = [json.loads(line)["messages"] for line in f][start:start + n]
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for c in chats]


def one_process(args: argparse.Namespace) -> dict:
    """Run one Engine (--role widened, dummy or small) and measure what that role needs."""
    import sglang as sgl

    folders = json.loads(args.folders)
    path = folders[{"small-serial": "small", "small-eagle": "small", "widened-eagle": "widened"}.get(args.role, args.role)]
    extra = {"max_total_tokens": 4096} if args.cpu else {"cuda_graph_max_bs_decode": max(args.batch_sizes)}
    if args.role.endswith("-eagle"):  # the pair: the (widened) drafter on its target
        extra.update(EAGLE, speculative_algorithm=folders["draft_algorithm"],
                     speculative_draft_model_path=folders["drafter-" + args.role.split("-")[0]])
    t = time.perf_counter()
    llm = sgl.Engine(**engine_kwargs(path, args.role == "dummy", not args.cpu, **extra))
    result: dict = {"role": args.role, "startup_s": round(time.perf_counter() - t, 1)}
    try:
        if args.role in ("widened", "dummy"):
            result["decode_tok_s"] = {}
            for batch in args.batch_sizes:
                result["decode_tok_s"][str(batch)] = timed(llm, batch, args)
                print(f"# {args.role} batch {batch}: {result['decode_tok_s'][str(batch)]} tok/s", flush=True)
        if args.role in ("widened", "widened-eagle") and args.drafter:  # speculation pays on text, not noise
            result["gsm8k_tok_s"] = {}
            for batch in args.batch_sizes:
                prompts = gsm8k_prompts(folders["small"], batch, args.gsm8k_start)
                result["gsm8k_tok_s"][str(batch)] = timed(llm, batch, args, prompts)
                print(f"# {args.role} GSM8K batch {batch}: {result['gsm8k_tok_s'][str(batch)]} tok/s", flush=True)
        if args.role != "dummy" and args.agree_prompts:
            prompts = gsm8k_prompts(folders["small"], args.agree_prompts, args.gsm8k_start)
            sp = {"max_new_tokens": args.agree_tokens, "temperature": 0}
            if args.role == "small-serial":  # the control: the same model, one request at a time
                result["answers"] = [llm.generate(input_ids=q, sampling_params=sp)["output_ids"] for q in prompts]
            else:
                outs = llm.generate(input_ids=prompts, sampling_params=sp)
                result["answers"] = [o["output_ids"] for o in outs]
                if args.role.endswith("-eagle"):
                    result["histogram"] = merge_histograms(o["meta_info"].get("spec_correct_drafts_histogram")
                                                           for o in outs)
    finally:
        llm.shutdown()
    return result


def agreement(small: list[list[int]], wide: list[list[int]]) -> dict:
    """Answers identical, and the mean share of each answer (the longer of the two) that is common."""
    shares, same = [], 0
    for a, b in zip(small, wide):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same += a == b
        shares.append(k / max(len(a), len(b), 1))
    return {"prompts": len(small), "identical": same, "mean_common_prefix": round(sum(shares) / max(len(shares), 1), 3),
            "mean_answer_tokens": round(sum(map(len, small)) / max(len(small), 1), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="the small model (default: the converted SmolLM2)")
    p.add_argument("--work-dir", default="/tmp/widened", help="where the widened folder is built (kept)")
    p.add_argument("--shape", default=None, help="named wide shape (default llama-8b; --cpu: a tiny one)")
    for flag in SIZE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    p.add_argument("--layouts", default="copies", help="widened layouts, comma-separated (copies, zeros): the "
                   "first is timed against the dummy shape, every one is compared with the small model")
    p.add_argument("--dtype", default=None, help="widened weights' dtype (default: the model's; --cpu: float32)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 8 64 (--cpu: 1 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (--cpu: 16)")
    p.add_argument("--output-len", type=int, default=None, help="default 256 (--cpu: 8)")
    p.add_argument("--timed-runs", type=int, default=2)
    p.add_argument("--agree-prompts", type=int, default=None, help="GSM8K prompts (default 64; --cpu: 4)")
    p.add_argument("--agree-tokens", type=int, default=None, help="answer tokens at most (default 128; --cpu: 16)")
    p.add_argument("--roles", default=None, help="engines to run (default: widened, dummy, small and one per "
                   "further layout)")
    p.add_argument("--drafter", help="an EAGLE or EAGLE3 drafter folder of the small model: widened with the model, "
                   "both pairs answer the GSM8K prompts (acceptance) and the widened pair is timed (speedup)")
    p.add_argument("--gsm8k-start", type=int, default=0, help="first GSM8K prompt used (e.g. past a drafter's "
                   "training prompts, for held-out acceptance)")
    p.add_argument("--control", action="store_true", help="also answer with the small model one request at a time: "
                   "its agreement with its own batched answers is what bf16 batching alone changes")
    p.add_argument("--cpu", action="store_true", help="run on the CPU: float32, a small wide shape, short runs")
    p.add_argument("--out", help="write the results here (JSON)")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--folders", help=argparse.SUPPRESS)
    args = p.parse_args()
    cpu = args.cpu
    defaults = {"batch_sizes": [1, 2] if cpu else [1, 8, 64], "prompt_len": 16 if cpu else 128,
                "output_len": 8 if cpu else 256, "agree_prompts": 4 if cpu else 64, "agree_tokens": 16 if cpu else 128,
                "dtype": "float32" if cpu else None, "shape": None if cpu else "llama-8b"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.role:
        print("RESULT " + json.dumps(one_process(args)), flush=True)
        return

    if cpu:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # the Engine processes inherit it
        if args.shape is None and all(getattr(args, f) is None for f in SIZE_FLAGS):
            for key, value in CPU_SHAPE.items():
                setattr(args, key, value)
    if args.model_path is None:
        from sglang_rl.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    folders = build_folders(args)
    print(f"# widened folder: {folders['widened']} ({folders['parameters'] / 1e9:.2f}B parameters, "
          f"built in {folders['build_s']} s)", flush=True)
    argv = sys.argv[1:] + ["--folders", json.dumps(folders), "--model-path", args.model_path]
    roles = args.roles.split(",") if args.roles else \
        ["widened", "dummy", "small"] + [f"widened-{layout}" for layout in folders["layouts"][1:]] + \
        (["small-serial"] if args.control else []) + (["small-eagle", "widened-eagle"] if args.drafter else [])
    results = {r["role"]: r for r in run_in_subprocesses(__file__, argv, "--role", roles)}
    report: dict = {"folders": folders, "device": "cpu" if cpu else "gpu", "prompt_len": args.prompt_len,
                    "output_len": args.output_len, "timed_runs": args.timed_runs, "roles": {
                        k: {n: v for n, v in r.items() if n != "answers"} for k, r in results.items()}}
    rows = []
    if "widened" in results and "dummy" in results:
        for batch in args.batch_sizes:
            w, d = results["widened"]["decode_tok_s"][str(batch)], results["dummy"]["decode_tok_s"][str(batch)]
            rows.append({"batch": batch, "widened_tok_s": w, "dummy_tok_s": d, "widened_vs_dummy": round(w / d, 3)})
        report["decode"] = rows
    pairs = [role for role in ("small-eagle", "widened-eagle") if "histogram" in results.get(role, {})]
    if pairs:
        report["acceptance"] = {role: {"histogram": results[role]["histogram"],
                                       "tokens_per_step": tokens_per_step(results[role]["histogram"]),
                                       "accept_rates": position_accept_rates(results[role]["histogram"],
                                                                             EAGLE["speculative_num_steps"])}
                                for role in pairs}
    if "widened-eagle" in results and "widened" in results:
        plain, spec = results["widened"]["gsm8k_tok_s"], results["widened-eagle"]["gsm8k_tok_s"]
        report["speculative"] = [{"batch": b, "widened_tok_s": plain[str(b)], "widened_eagle_tok_s": spec[str(b)],
                                  "speedup": round(spec[str(b)] / plain[str(b)], 3)} for b in args.batch_sizes]
    if "small" in results and args.agree_prompts:
        report["agreement"] = {}
        for role, layout in [("widened", folders["layouts"][0])] + [(f"widened-{lo}", lo) for lo in folders["layouts"][1:]]:
            if role in results:
                report["agreement"][layout] = {**agreement(results["small"]["answers"], results[role]["answers"]),
                                               "max_tokens": args.agree_tokens}
        if "small-serial" in results:
            report["agreement"]["small, one request at a time"] = {
                **agreement(results["small"]["answers"], results["small-serial"]["answers"]), "max_tokens": args.agree_tokens}
        report["answers"] = {role: r["answers"] for role, r in results.items() if "answers" in r}
    shape = folders["shape"]
    print(f"\nwidened {Path(args.model_path).name} at hidden {shape['hidden_size']}, {shape['num_attention_heads']} "
          f"heads of {shape['head_dim']}, {shape['num_key_value_heads']} KV heads, MLP {shape['intermediate_size']}, "
          f"{shape['num_hidden_layers']} layers ({folders['parameters'] / 1e9:.2f}B parameters, layout "
          f"{folders['layouts'][0]}); decode {args.prompt_len} prompt + {args.output_len} new tokens, greedy, "
          f"median of {args.timed_runs}")
    if rows:
        print_table(rows, ["batch", "widened_tok_s", "dummy_tok_s", "widened_vs_dummy"])
    for layout, a in report.get("agreement", {}).items():
        print(f"\ngreedy agreement with {Path(args.model_path).name} (batched), {layout}, on {a['prompts']} GSM8K "
              f"prompts (at most {args.agree_tokens} tokens): {a['identical']}/{a['prompts']} answers identical, "
              f"mean common prefix {a['mean_common_prefix']:.1%} of an answer")
    for role, acc in report.get("acceptance", {}).items():
        rates = ", ".join("-" if r is None else f"{r:.2f}" for r in acc["accept_rates"])
        print(f"\n{role} ({folders['draft_algorithm']}, {EAGLE['speculative_num_steps']} steps, top-1) on the GSM8K "
              f"prompts: {acc['tokens_per_step']:.3f} tokens per verify step, accept rate per position {rates}")
    if "speculative" in report:
        print(f"\nwidened model with and without its drafter on GSM8K prompts ({args.output_len} new tokens, greedy, "
              "ignore_eos)")
        print_table(report["speculative"], ["batch", "widened_tok_s", "widened_eagle_tok_s", "speedup"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
