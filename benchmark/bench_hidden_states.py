"""Hidden-state delivery on a real sglang Engine: output tok/s of plain decoding vs upstream's
list path vs sglang-rl's binary path, in one run. Prints a markdown table.

GPU (8B-shaped dummy weights):  python benchmark/bench_hidden_states.py --model-path /tmp/m8b --dummy
CPU smoke run (default model):   python benchmark/bench_hidden_states.py --cpu --shapes 4x16x16
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    engine_kwargs, model_parser, parse_with_model, print_table, random_prompts, run_in_subprocesses,
)

# mode -> extra generate() arguments (None: the plain baseline Engine, flag off)
MODES = {
    "plain": None,
    "last (upstream)": {"return_hidden_states": "last"},
    "last (sglang-rl)": {"return_hidden_states": "last", "hidden_states_format": "list"},
    "full-list (upstream)": {"return_hidden_states": True},
    "full-binary (sglang-rl)": {"return_hidden_states": True, "hidden_states_format": "base64"},
    "full-tensor (sglang-rl)": {"return_hidden_states": True, "hidden_states_format": "tensor"},
    "response-scope (sglang-rl)": {"return_hidden_states": True, "hidden_states_format": "base64",
                                   "hidden_states_scope": "response"},
}


def _rows_field(meta: dict):
    """The plugin's rows field, or upstream's when the request took upstream's path."""
    return meta.get("hidden_states_rows", meta.get("hidden_states"))


def payload_bytes(meta: dict) -> int:
    hs = _rows_field(meta)
    if isinstance(hs, dict):
        return len(hs.get("data", ""))
    if hs is None:
        return 0
    if hasattr(hs, "element_size"):
        return hs.numel() * hs.element_size()
    return len(json.dumps(hs))


def rows_of(meta: dict):
    """The delivered rows of one request as a float32 tensor (any format), or None."""
    import torch

    from sglang_rl.hidden_states import decode_rows

    hs = _rows_field(meta)
    if hs is None:
        return None
    if isinstance(hs, dict):
        return decode_rows(hs)[0].float()
    if isinstance(hs, torch.Tensor):
        return hs.float()
    # upstream: one element per forward, a prefill's [rows, H] nested list or a decode step's row
    if hs and not isinstance(hs[0], list):
        return torch.tensor(hs, dtype=torch.float32).unsqueeze(0)  # LAST: one flat row
    parts = [torch.tensor(e, dtype=torch.float32) for e in hs]
    hidden = parts[-1].shape[-1]
    return torch.cat([t.reshape(-1, hidden) for t in parts])


def run_group(args: argparse.Namespace, group: str) -> list[dict]:
    import sglang as sgl

    names = ["plain"] if group == "plain" else [m for m in MODES if m != "plain" and m in args.modes]
    if group == "plain":
        extra = {}
    elif args.server_mode == "last":
        extra = {"return_hidden_states_mode": "last"}
    else:
        extra = {"enable_return_hidden_states": True}
    llm = sgl.Engine(**engine_kwargs(args.model_path, args.dummy, not args.cpu, **extra))
    rows = []
    reference = None  # upstream's FULL list rows of the first request: every FULL format must match
    for shape in args.shapes:
        n, lin, lout = (int(x) for x in shape.split("x"))
        prompts = random_prompts(n, lin, seed=lin)
        sp = {"max_new_tokens": lout, "temperature": 0, "ignore_eos": True}
        # one untimed run of the full shape first, as the first mode: the first batch of a shape
        # pays kernel JIT and autotuning (a 10-35% penalty on whichever mode ran first, v3 and v4
        # in docs/results/)
        llm.generate(input_ids=prompts, sampling_params=sp, **(MODES[names[0]] or {}))
        outs = None
        for name in names:
            kw = MODES[name] or {}
            llm.generate(input_ids=prompts[:2], sampling_params={**sp, "max_new_tokens": 4}, **kw)
            # free the previous mode's outputs before the clock starts: releasing upstream's list
            # rows (tens of millions of Python floats) took ~0.5-1.5 s and was charged to the
            # mode timed after it (full-binary) in v2/v3
            rates = []
            for _ in range(args.repeats):
                outs = None
                gc.collect()
                # every mode prefills its prompts: without this, plain and LAST found the warm-up's
                # prompts in the radix cache while FULL scope "all" recomputes them for their rows,
                # so v1-v5 charged FULL with a prefill the baseline skipped
                flushed = llm.flush_cache()
                assert getattr(flushed, "success", True), f"flush_cache failed: {flushed}"
                t = time.time()
                outs = llm.generate(input_ids=prompts, sampling_params=sp, **kw)
                dt = time.time() - t
                rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / dt)
            rates.sort()
            row = {"shape": shape, "mode": name, "out_tok_per_s": round(rates[len(rates) // 2], 1),
                   "spread": f"{rates[0]:.0f}-{rates[-1]:.0f}",
                   "payload_MB_per_req": round(payload_bytes(outs[0]["meta_info"]) / 2**20, 2)}
            got = rows_of(outs[0]["meta_info"])
            if name == "full-list (upstream)":
                reference = got
            elif got is not None and reference is not None and "scope" not in " ".join(kw):
                # upstream drops the prompt rows of a radix-cached prefix: compare the rows it has
                n = min(got.shape[0], reference.shape[0])
                diff = (got[-n:] - reference[-n:]).abs().max().item()
                row["rows_vs_list"] = f"{got.shape[0]} rows (list {reference.shape[0]}), max|diff| {diff:.1e}"
            rows.append(row)
        reference = None
    llm.shutdown()
    return rows


def main() -> None:
    p = model_parser(__doc__)
    p.add_argument("--shapes", nargs="+", default=["64x128x128", "64x512x512"],
                   help="requests x prompt tokens x output tokens")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                   help="modes to time besides plain (default: all)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per mode and shape; the table shows their median (runs of 64x128 last ~1 s)")
    p.add_argument("--server-mode", choices=["full", "last"], default="full",
                   help="the hidden-state Engine's capture: --enable-return-hidden-states (full) or "
                        "--return-hidden-states-mode last (LAST modes only)")
    p.add_argument("--group", help=argparse.SUPPRESS)
    args = parse_with_model(p)
    if args.group:
        print("RESULT " + json.dumps(run_group(args, args.group)), flush=True)
        return
    rows = [r for group in run_in_subprocesses(__file__, sys.argv[1:], "--group", ["plain", "hidden"])
            for r in group]
    base = {r["shape"]: r["out_tok_per_s"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        r["vs_plain"] = round(r["out_tok_per_s"] / base[r["shape"]], 3)
    rows.sort(key=lambda r: (r["shape"], list(MODES).index(r["mode"])))
    print(f"\nHidden-state delivery, greedy, ignore_eos; shape = requests x prompt x output tokens; "
          f"out_tok_per_s = median of {args.repeats} runs (spread: slowest-fastest)")
    print_table(rows, ["shape", "mode", "out_tok_per_s", "spread", "vs_plain", "payload_MB_per_req", "rows_vs_list"])


if __name__ == "__main__":
    main()
