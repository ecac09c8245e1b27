"""k-CBS on a real sglang Engine, one run, three ways of getting the same candidates or work:

  in-scheduler  sglang-rl: k beams per request decode as ordinary batch rows, forked in place
  re-prefill    the reference approach: every step, every live beam is sent again as a full
                prompt (max_new_tokens=0, top-k log-probs) and the selection runs client-side;
                its Engine has the radix cache off, so each beam is re-prefilled every step
  re-prefill (radix on)  the same client on an Engine configured like ours: the radix cache
                serves each beam's prefix, so only its newest token is computed
  plain decode  no search: each request decodes k*T tokens (the work a k-CBS run scores)

GPU (8B-shaped dummy weights):  python benchmark/bench_kcbs.py --model-path /tmp/m8b --dummy
CPU smoke run:                   python benchmark/bench_kcbs.py --cpu --num 2 --k 2 --steps 3
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


def reprefill_search(llm, prompts: list[list[int]], k: int, steps: int) -> list:
    """Client-side k-CBS with one prefill per live beam per step (scores kept in float64)."""
    import torch

    from sglang_rl.kcbs import kcbs_step

    beams = [[([], 0.0, 0.0, False)] for _ in prompts]
    for step in range(steps):
        live = [(r, b) for r, bs in enumerate(beams) for b, beam in enumerate(bs) if not beam[3]]
        if not live:
            break
        outs = llm.generate(
            input_ids=[prompts[r] + beams[r][b][0] for r, b in live],
            sampling_params={"max_new_tokens": 0, "temperature": 1.0},
            return_logprob=True, top_logprobs_num=k,
        )
        flat = [(r, b) for r, bs in enumerate(beams) for b in range(len(bs))]
        row = {rb: i for i, rb in enumerate(flat)}
        vocab = 1 + max(t[1] for o in outs for t in o["meta_info"]["output_top_logprobs"][0])
        dense = torch.full((len(flat), max(vocab, 49152)), float("-inf"), dtype=torch.float64)
        for (r, b), o in zip(live, outs):
            top = o["meta_info"]["output_top_logprobs"][0]
            dense[row[(r, b)], torch.tensor([t[1] for t in top])] = torch.tensor([t[0] for t in top], dtype=torch.float64)
        sel = kcbs_step(
            dense,
            torch.tensor([r for r, _ in flat]),
            torch.tensor([beams[r][b][1] for r, b in flat], dtype=torch.float64),
            torch.tensor([beams[r][b][2] for r, b in flat], dtype=torch.float64),
            torch.tensor([beams[r][b][3] for r, b in flat]),
            torch.full((len(prompts),), k),
            torch.full((len(prompts),), False),
        )
        new = [[] for _ in prompts]
        for req, parent, token, score, raw, fin in zip(sel.request.tolist(), sel.parent_beam.tolist(), sel.token.tolist(),
                                                       sel.score.tolist(), sel.raw.tolist(), sel.finished.tolist()):
            r, b = flat[parent]
            toks = beams[r][b][0] if fin else beams[r][b][0] + [token]
            new[req].append((toks, score, raw, fin or token == 2))
        beams = new
    return beams


def run(args: argparse.Namespace, mode: str) -> dict:
    import sglang as sgl

    extra = {"disable_radix_cache": True} if mode == "re-prefill" else {}
    reprefill = mode.startswith("re-prefill")
    llm = sgl.Engine(**engine_kwargs(args.model_path, args.dummy, not args.cpu, **extra))
    prompts = random_prompts(args.num, args.input_len, seed=3)
    # an untimed full-size run on other prompts first (kernel JIT and autotuning of the batch
    # shapes; different prompts so that nothing timed is served from the radix cache)
    warm = random_prompts(args.num, args.input_len, seed=4)
    if mode == "in-scheduler":
        call = lambda ps: llm.generate(input_ids=ps, sampling_params={"max_new_tokens": args.steps},
                                       kcbs_enabled=True, kcbs_beam_width=args.k, kcbs_steps=args.steps)
    elif reprefill:
        call = lambda ps: reprefill_search(llm, ps, args.k, args.steps)
    else:
        call = lambda ps: llm.generate(input_ids=ps, sampling_params={
            "max_new_tokens": args.k * args.steps, "temperature": 0, "ignore_eos": True})
    call(warm)
    t = time.time()
    out = call(prompts)
    dt = time.time() - t
    result = {"mode": mode, "seconds": round(dt, 3)}
    if mode == "in-scheduler":
        result["candidates_per_req"] = len(out[0]["meta_info"]["kcbs_candidates"])
        result["best"] = [o["meta_info"]["kcbs_candidates"][0]["token_ids"] for o in out]
    elif reprefill:
        result["candidates_per_req"] = len(out[0])
        result["best"] = [max(bs, key=lambda b: b[1])[0] for bs in out]
    llm.shutdown()
    return result


def main() -> None:
    p = model_parser(__doc__)
    p.add_argument("--num", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = parse_with_model(p)
    if args.mode:
        print("RESULT " + json.dumps(run(args, args.mode)), flush=True)
        return
    rows = run_in_subprocesses(__file__, sys.argv[1:], "--mode", ["in-scheduler", "re-prefill", "re-prefill (radix on)", "plain decode"])
    ours, ours_best = rows[0]["seconds"], rows[0]["best"]
    for r in rows:
        r["vs_in_scheduler"] = round(r["seconds"] / ours, 2)
        best = r.pop("best", None)
        if best is not None:  # same best candidate as the in-scheduler search, per request
            r["same_best"] = f"{sum(a == b for a, b in zip(best, ours_best))}/{len(best)}"
    print(f"\nk-CBS: {args.num} requests x {args.input_len} prompt tokens, k={args.k}, T={args.steps}")
    print_table(rows, ["mode", "seconds", "vs_in_scheduler", "candidates_per_req", "same_best"])


if __name__ == "__main__":
    main()
