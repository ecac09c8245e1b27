"""TOPLOC on a real sglang Engine: decode throughput with verification off vs on, and honest
replay pass rates, in one run. Prints a markdown table.

GPU (8B-shaped dummy weights):
    python benchmark/bench_toploc.py --model-path /tmp/m8b --dummy
GPU, the same with EAGLE (a Llama target + an EAGLE draft built to be accepted, spec_models.py);
32 layers at width 4096 is the 8B shape (~6.2B parameters, written in about a minute):
    python benchmark/bench_toploc.py --eagle --tokenizer-dir /tmp/tok --eagle-hidden 4096 --eagle-layers 32
CPU smoke run (default model):
    python benchmark/bench_toploc.py --cpu --shapes 4x16x16 --replay-total 4
Verifier cost against a plain prefill of the same sequences (8B shape on a GPU; on the CPU
with the default model, small shapes such as `--verify-cost-shapes 8x64x64`):
    python benchmark/bench_toploc.py --model-path /tmp/m8b --dummy --modes on --replay-total 0 \
        --cuda-graph-max-bs 64 --shapes 8x128x128 --timed-runs 1 \
        --verify-cost-shapes 64x512x512 64x128x1024 16x256x4096 --verify-cost-runs 3
A verifier under load (verify_load.py): one --toploc-verification server answers GSM8K prompts,
then `sglang-rl-verify`'s client verifies them at each client concurrency and batch size, beside a
plain prefill of the same sequences (the ceiling):
    python benchmark/bench_toploc.py --model-path /data/smollm2-8b --verify-load 1 2 4 8 \
        --verify-load-batch-sizes 1 8 32 --verify-load-rollouts 256 --verify-load-tokens 512

Each mode runs in its own process (a fresh Engine), so the modes share nothing. Every shape is
timed `--timed-runs` times after one untimed run; the table gives the median and the spread
(min..max) of output tokens per second, and on/off as the ratio of the medians. A shape's output
length may be a range (`64x128x64-512`): the requests then finish a few at a time, as a
rollout's do.

A host-bound setup (the small EAGLE pair) varies more between engine processes than between
modes: one process of a mode ran 16k tok/s and the next 23k on the same H100. `--rounds R` runs
the modes R times, alternating (off, on, off, on, ...); the table then pools each mode's timed
runs over its R processes, and `round_ratios` gives on/off of each adjacent pair and their
geometric mean.

`--paired` runs one TOPLOC process instead, whose timed runs alternate (off, on, off, on, ...):
in an "off" run no request gets a fingerprint builder (the benchmark-only plugin in
`toploc_paired/`, which this script puts on its Engine's path; the server-wide capture mode stays,
which the ablation in docs/design.md, section 6, found costs nothing measurable). Drift between
processes then cancels, and each shape's line gives on/off of every adjacent pair and their median:

    python benchmark/bench_toploc.py --eagle --paired ...

With `--paired`, `--compare-clone` adds a third run to each pair (on, with each step's kept rows
cloned rather than copied into the row ring), and `--profile-dir DIR` traces one more off and on
run per shape with sglang's torch profiler (DIR/S-off and DIR/S-on, for a trace viewer such as
Perfetto).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    EAGLE, engine_kwargs, model_parser, parse_with_model, print_table, random_prompts, run_in_subprocesses,
)
import verify_load  # noqa: E402

def parse_shape(text: str) -> tuple[int, int, int | tuple[int, int]]:
    """'64x128x128' -> (requests, prompt tokens, output tokens); '64x128x64-512' gives the
    requests output lengths spread evenly over 64..512, so they finish a few at a time, as a
    rollout's do."""
    num, prompt, output = text.lower().split("x")
    low, _, high = output.partition("-")
    return int(num), int(prompt), (int(low), int(high)) if high else int(low)


def output_lengths(num: int, output: int | tuple[int, int]) -> list[int]:
    """Each request's max_new_tokens: one length, or `num` lengths spread evenly over a range
    (interleaved, so that long and short requests share every batch)."""
    if isinstance(output, int):
        return [output] * num
    low, high = output
    spread = [low + (high - low) * i // max(num - 1, 1) for i in range(num)]
    return spread[::2] + spread[1::2]


def engine_for(args: argparse.Namespace, toploc: bool):
    import sglang as sgl

    if args.eagle:
        from spec_models import make_eagle_pair

        root = Path(args.work_dir) / f"h{args.eagle_hidden}-l{args.eagle_layers}"
        target, draft = make_eagle_pair(root, Path(args.tokenizer_dir), hidden=args.eagle_hidden,
                                        layers=args.eagle_layers)
        kw = engine_kwargs(str(target), False, not args.cpu, speculative_draft_model_path=str(draft), **EAGLE)
    else:
        kw = engine_kwargs(args.model_path, args.dummy, not args.cpu)
    if args.disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.cuda_graph_max_bs:
        kw["cuda_graph_max_bs_decode"] = args.cuda_graph_max_bs
    return sgl.Engine(**kw, toploc_verification=toploc)


def timed_shape(llm, shape: tuple[int, int, int | tuple[int, int]], runs: int, warm_up: bool = True) -> dict:
    """Output tok/s of `runs` timed batches of one shape, after an untimed one (`warm_up`)."""
    num, prompt_len, output = shape
    prompts = random_prompts(num, prompt_len, seed=prompt_len * 7 + num)
    sp = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in output_lengths(num, output)]
    if warm_up:
        outs = llm.generate(input_ids=prompts, sampling_params=sp)  # untimed: graphs, allocator, caches
    rates, spec_steps = [], 0
    for _ in range(runs):
        llm.flush_cache()
        t = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=sp)
        rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t))
        spec_steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "rates": [round(r, 1) for r in rates],
        "fingerprinted": sum("toploc_verification_fingerprints" in o["meta_info"] for o in outs),
        "tokens_per_step": round(tokens / spec_steps, 2) if spec_steps else "",
    }


PAIRED_FLAG = "/tmp/sglang-rl-bench-toploc-paired-off"
PAIRED_PLUGIN = Path(__file__).resolve().parent / "toploc_paired"


def _builders_on(on: bool) -> None:
    """Switch the paired process's requests to get fingerprint builders (on) or none (off: the
    flag file exists)."""
    if not on:
        Path(PAIRED_FLAG).touch()
    else:
        Path(PAIRED_FLAG).unlink(missing_ok=True)


def paired_shape(llm, text: str, pairs: int, profile_dir: str | None = None, clone: bool = False) -> dict:
    """`pairs` adjacent (off, on) timed runs of one shape (`parse_shape`'s text) in one TOPLOC
    process: off while the flag file exists (no request gets a builder). Checks that the switch
    took: off runs carry no fingerprint, on runs one per request. With `profile_dir`, one more
    off run and on run follow, each under sglang's torch profiler (CPU ops, CUDA runtime calls
    and kernels; no Python stacks, which would slow every call), traced into
    `<profile_dir>/<shape>-<mode>/`. With `clone`, each pair gets a third run, "clone": on,
    with each step's kept rows cloned instead of copied into the row ring (the `.clone` flag
    of `toploc_paired/`)."""
    shape = parse_shape(text)
    timed_shape(llm, shape, 0)  # untimed, as every mode's first batch
    modes = ("off", "on", "clone") if clone else ("off", "on")
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    clone_flag = Path(PAIRED_FLAG + ".clone")
    try:
        for _ in range(pairs):
            for mode in modes:
                _builders_on(mode != "off")
                if mode == "clone":
                    clone_flag.touch()
                cell = timed_shape(llm, shape, 1, warm_up=False)
                if mode == "clone":
                    clone_flag.unlink()
                want = 0 if mode == "off" else shape[0]
                if cell["fingerprinted"] != want:
                    raise SystemExit(f"--paired: a {mode} run fingerprinted {cell['fingerprinted']} of {shape[0]} "
                                     "requests (did the toploc_paired plugin load?)")
                rates[mode] += cell["rates"]
        for mode in ("off", "on") if profile_dir else ():
            _builders_on(mode == "on")
            llm.start_profile(output_dir=f"{profile_dir}/{text}-{mode}", with_stack=False,
                              record_shapes=False, activities=["CPU", "GPU"], profile_id=mode)
            timed_shape(llm, shape, 1, warm_up=False)
            llm.stop_profile()
    finally:
        _builders_on(True)
        clone_flag.unlink(missing_ok=True)
    return {**rates, "tokens_per_step": cell["tokens_per_step"]}


def run_paired(args: argparse.Namespace) -> list[dict]:
    """One TOPLOC process, its timed runs alternating between off and on (`paired_shape`). The
    `toploc_paired/` plugin is found through sys.path (which the Engine's spawned processes
    inherit) and PYTHONPATH (for any process started afresh)."""
    sys.path.insert(0, str(PAIRED_PLUGIN))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PAIRED_PLUGIN), os.environ.get("PYTHONPATH")]))
    os.environ["SGLANG_RL_TOPLOC_PAIRED_FLAG"] = PAIRED_FLAG
    if args.compare_clone:
        os.environ["SGLANG_RL_TOPLOC_PAIRED_CLONE"] = "1"
    llm = engine_for(args, toploc=True)
    lines = []
    for text in args.shapes:
        cell = paired_shape(llm, text, args.timed_runs, args.profile_dir, args.compare_clone)
        ratios = [on / off for off, on in zip(cell["off"], cell["on"])]
        line = {"shape": text, "off_median": round(statistics.median(cell["off"]), 1),
                "on_median": round(statistics.median(cell["on"]), 1),
                "pair_ratios": " ".join(f"{r:.3f}" for r in ratios),
                "median_pair_ratio": round(statistics.median(ratios), 3),
                "tokens_per_step": cell["tokens_per_step"]}
        if args.compare_clone:
            clones = [c / off for off, c in zip(cell["off"], cell["clone"])]
            line["clone_median_pair_ratio"] = round(statistics.median(clones), 3)
            line["clone_pair_ratios"] = " ".join(f"{r:.3f}" for r in clones)
        lines.append(line)
    llm.shutdown()
    return lines


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    t0 = time.time()
    llm = engine_for(args, toploc=(mode == "on"))
    result = {"mode": mode, "startup_s": round(time.time() - t0, 1), "shapes": {}}
    for text in args.shapes:
        result["shapes"][text] = timed_shape(llm, parse_shape(text), args.timed_runs)
    if mode == "on" and args.replay_total:
        result.update(replays(llm, args))
    if mode == "on":
        result["verify_cost"] = [verifier_cost(llm, text, args.verify_cost_runs) for text in args.verify_cost_shapes]
    llm.shutdown()
    return result


def verify_outputs(llm, prompts: list[list[int]], outs: list[dict]) -> list[dict]:
    """Each response verified in its exact-token form (one batch): the verification reports."""
    ids = [p + list(o["output_ids"]) for p, o in zip(prompts, outs)]
    checks = [{"max_new_tokens": 0, "toploc_verification_fingerprint_to_validate":
               o["meta_info"]["toploc_verification_fingerprints"][-1]} for o in outs]
    return [json.loads(r["meta_info"]["toploc_verification_fingerprint_validation_result"])
            for r in llm.generate(input_ids=ids, sampling_params=checks)]


def verifier_cost(llm, text: str, runs: int = 1) -> dict:
    """One batch of a shape generated, then all its responses verified in one batch with the cache
    flushed first (a verifier holds none of the generator's KV): the verifier's share of the time.
    Beside it, the floor: a plain prefill of the same prompt + response sequences
    (max_new_tokens 1, no verification) on the same server, cache flushed too. Verify and prefill
    alternate `runs` times after an untimed round; the medians are reported."""
    num, prompt_len, output = parse_shape(text)
    prompts = random_prompts(num, prompt_len, seed=prompt_len * 11 + num)
    sp = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in output_lengths(num, output)]

    def timed(call) -> tuple[float, object]:
        llm.flush_cache()
        t = time.perf_counter()
        result = call()
        return time.perf_counter() - t, result

    def plain_prefill(sequences: list[list[int]]) -> list[dict]:
        return llm.generate(input_ids=sequences, sampling_params=[{"max_new_tokens": 1, "temperature": 0}] * num)

    gen_s, outs = timed(lambda: llm.generate(input_ids=prompts, sampling_params=sp, return_output_ids=True))
    sequences = [p + list(o["output_ids"]) for p, o in zip(prompts, outs)]
    verify_outputs(llm, prompts, outs)  # untimed: graphs, allocator, the first long prefills
    plain_prefill(sequences)
    gen_s, outs = timed(lambda: llm.generate(input_ids=prompts, sampling_params=sp, return_output_ids=True))
    verify_times, prefill_times = [], []
    for _ in range(runs):
        verify_s, reports = timed(lambda: verify_outputs(llm, prompts, outs))
        prefill_s, _ = timed(lambda: plain_prefill(sequences))
        verify_times.append(verify_s)
        prefill_times.append(prefill_s)
    verify_s, prefill_s = statistics.median(verify_times), statistics.median(prefill_times)
    tokens = sum(len(o["output_ids"]) for o in outs)
    passed = sum(bool(r["verified"]) for r in reports)
    return {"shape": text, "generated_tok_per_s": round(tokens / gen_s, 1), "verified_tok_per_s": round(tokens / verify_s, 1),
            "generate_s": round(gen_s, 2), "verify_s": round(verify_s, 2), "prefill_s": round(prefill_s, 2),
            "prefill_tok_per_s": round(sum(map(len, sequences)) / prefill_s, 1),
            "verify_over_prefill": round(verify_s / prefill_s, 3),
            "verify_over_generate": round(verify_s / gen_s, 4), "verified": f"{passed}/{num}"}


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
            for r in verify_outputs(llm, prompts, outs):
                total += 1
                passed += bool(r["verified"])
                worst = max(worst, r.get("worst_exp_mismatches") or 0)
                counts = per_bs.setdefault(bs, [0, 0])
                counts[0] += bool(r["verified"])
                counts[1] += 1
    return {"replays_passed": f"{passed}/{total}", "worst_exp_mismatches": worst,
            "per_batch_size": json.dumps({k: f"{v[0]}/{v[1]}" for k, v in per_bs.items()})}


def pooled(rows: list[dict]) -> list[dict]:
    """One row per mode: each shape's timed rates over all of that mode's processes."""
    by_mode: dict[str, dict] = {}
    for r in rows:
        mode = by_mode.setdefault(r["mode"], {"mode": r["mode"], "startup_s": [], "shapes": {}})
        mode["startup_s"].append(r["startup_s"])
        for text, cell in r["shapes"].items():
            into = mode["shapes"].setdefault(text, {**cell, "rates": [], "medians": []})
            into["rates"] += cell["rates"]
            into["medians"].append(statistics.median(cell["rates"]))
    return list(by_mode.values())


def round_ratios(off: list[float], on: list[float]) -> str:
    """on/off of each adjacent (off, on) pair of processes, by their medians (in the order they
    ran), and their geometric mean (the estimate that process-to-process drift affects least)."""
    ratios = [b / a for a, b in zip(off, on)]
    if len(ratios) < 2:
        return ""
    return " ".join(f"{v:.3f}" for v in ratios) + f" (geomean {statistics.geometric_mean(ratios):.3f})"


def table(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """One line per (shape, mode), with on/off from the pooled medians."""
    modes = pooled(rows)
    median = {(m["mode"], text): statistics.median(c["rates"]) for m in modes for text, c in m["shapes"].items()}
    lines = []
    for text in args.shapes:
        base = median.get(("off", text))
        off = next((o["shapes"][text]["medians"] for o in modes if o["mode"] == "off"), [])
        for m in modes:
            cell = m["shapes"][text]
            lines.append({"shape": text, "mode": m["mode"], "median_tok_per_s": round(median[(m["mode"], text)], 1),
                          "spread": f"{min(cell['rates']):.0f}..{max(cell['rates']):.0f}",
                          "process_medians": " ".join(f"{v:.0f}" for v in cell["medians"]),
                          "vs_off": round(median[(m["mode"], text)] / base, 3) if base else "",
                          "round_ratios": round_ratios(off, cell["medians"]) if m["mode"] == "on" else "",
                          "tokens_per_step": cell["tokens_per_step"], "fingerprinted": cell["fingerprinted"],
                          "startup_s": " ".join(str(v) for v in m["startup_s"])})
    return lines


def main() -> None:
    p = model_parser(__doc__)
    p.add_argument("--shapes", nargs="+", default=["64x128x128", "64x512x512", "8x128x128"],
                   help="requests x prompt tokens x output tokens (a range such as 64-512 spreads "
                   "the requests' output lengths over it)")
    p.add_argument("--timed-runs", type=int, default=3)
    p.add_argument("--replay-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--replay-total", type=int, default=200)
    p.add_argument("--modes", default="off,on")
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, alternating")
    p.add_argument("--cuda-graph-max-bs", type=int, help="capture CUDA graphs up to this batch size only "
                   "(a shorter start-up; the shapes' batch sizes must fit under it)")
    p.add_argument("--eagle", action="store_true", help="EAGLE target + draft from spec_models.py")
    p.add_argument("--tokenizer-dir", default="/tmp/tok", help="tokenizer files for --eagle")
    p.add_argument("--work-dir", default="/tmp/bench-toploc-eagle", help="where --eagle writes its models")
    p.add_argument("--eagle-hidden", type=int, default=1024, help="--eagle target width (4096 with 32 "
                   "layers: the 8B shape)")
    p.add_argument("--eagle-layers", type=int, default=4, help="--eagle target layers (at width 4096, 8 "
                   "layers leave a step bound by the scheduler's host work; 32, the 8B shape, by the GPU)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="both modes without CUDA graphs (the GPU kit lacks deep_gemm, which EAGLE's draft "
                        "graph capture imports)")
    p.add_argument("--paired", action="store_true",
                   help="one TOPLOC process whose timed runs alternate off/on (--timed-runs pairs per shape)")
    p.add_argument("--profile-dir", help="--paired: after each shape's pairs, trace one off and one on run "
                   "with sglang's torch profiler into this folder")
    p.add_argument("--compare-clone", action="store_true", help="--paired: a third run per pair, on with "
                   "each step's kept rows cloned instead of copied into the row ring")
    p.add_argument("--attention-backend", help="sglang's attention backend on a GPU (default: triton)")
    p.add_argument("--verify-cost-shapes", nargs="*", default=[],
                   help="on mode: per shape, generate one batch, then verify all of it and prefill the same "
                   "sequences plainly (max_new_tokens 1); prints generated, verified and prefilled tokens/s "
                   "(the verifier's share of the time, and its cost over a plain prefill)")
    p.add_argument("--verify-cost-runs", type=int, default=1,
                   help="--verify-cost-shapes: timed (verify, prefill) rounds per shape (medians)")
    p.add_argument("--one-mode", help=argparse.SUPPRESS)
    verify_load.add_arguments(p)
    args = p.parse_args() if "--eagle" in sys.argv else parse_with_model(p)
    if args.verify_load:
        error = verify_load.check_arguments(p, args)
        if error:
            p.error(error)
        verify_load.run_verify_load(args)
        return
    if args.paired:
        lines = run_paired(args)
        print(f"\nTOPLOC on vs off in one process, {args.timed_runs} adjacent (off, on) pairs per shape")
        print_table(lines, ["shape", "off_median", "on_median", "median_pair_ratio", "pair_ratios",
                            "tokens_per_step"] + (["clone_median_pair_ratio", "clone_pair_ratios"]
                                                  if args.compare_clone else []))
        return
    if args.one_mode:
        print("RESULT " + json.dumps(run_mode(args, args.one_mode)), flush=True)
        return
    rows = run_in_subprocesses(__file__, sys.argv[1:], "--one-mode", args.modes.split(",") * args.rounds)
    what = "EAGLE target + draft (spec_models.py)" if args.eagle else args.model_path
    print(f"\nTOPLOC on vs off: {what}, greedy, ignore_eos, {args.timed_runs} timed runs per shape "
          f"in each of {args.rounds} process(es) per mode")
    print_table(table(rows, args), ["shape", "mode", "median_tok_per_s", "spread", "process_medians", "vs_off",
                                    "round_ratios", "tokens_per_step", "fingerprinted", "startup_s"])
    replay = [r for r in rows if "replays_passed" in r]
    if replay:
        print()
        print_table(replay, ["mode", "replays_passed", "worst_exp_mismatches", "per_batch_size"])
    cost = [line for r in rows for line in r.get("verify_cost", [])]
    if cost:
        print("\nVerifier cost: one batch generated, then verified and plainly prefilled (max_new_tokens 1), "
              "each with the cache flushed")
        print_table(cost, ["shape", "generated_tok_per_s", "verified_tok_per_s", "prefill_tok_per_s", "generate_s",
                           "verify_s", "prefill_s", "verify_over_prefill", "verify_over_generate", "verified"])


if __name__ == "__main__":
    main()
