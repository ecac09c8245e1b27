"""Hidden-state rows under EAGLE speculative decoding (GPU): do they follow the committed tokens?

Writes a small Llama target and an EAGLE draft that usually guesses right (spec_models.py), so
verify steps commit runs of 1-4 tokens, then in two fresh Engines (CUDA graphs on):
* spec: EAGLE (3 steps, topk 1, 4 draft tokens); FULL rows (scope all, final row) and LAST rows
  of greedy requests;
* plain: the same requests without speculative decoding, and a prefill-only replay of each spec
  request's `input_ids + output_ids`, whose rows are the reference for every position.
Prints a table: positions, tokens, and each set of rows against the replay (cosine similarity,
max |diff|), plus a control that compares the spec rows one position off. Exits 1 on a mismatch.

GPU:  python benchmark/check_hidden_states_spec.py --tokenizer-dir <dir with tokenizer.json>
CPU smoke run of the script itself (no speculative decoding there):
      python benchmark/check_hidden_states_spec.py --tokenizer-dir <dir> --cpu --requests 2 --max-new 9
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_kwargs, print_table, random_prompts, run_in_subprocesses  # noqa: E402
from spec_models import make_eagle_pair  # noqa: E402

SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
            speculative_num_draft_tokens=4)


def run_group(args: argparse.Namespace, group: str) -> dict:
    import sglang as sgl

    work = Path(args.workdir)
    extra = {"enable_return_hidden_states": True}
    if group == "spec" and not args.cpu:
        extra.update(SPEC, speculative_draft_model_path=str(work / "draft"))
    llm = sgl.Engine(**engine_kwargs(str(work / "target"), False, not args.cpu, **extra))
    prompts = random_prompts(args.requests, args.prompt_len, seed=7)
    sp = {"max_new_tokens": args.max_new, "temperature": 0, "ignore_eos": True}
    full = llm.generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True,
                        hidden_states_format="tensor", return_final_hidden_state=True)
    last = llm.generate(input_ids=prompts, sampling_params=sp, return_hidden_states="last",
                        hidden_states_format="tensor")
    saved = {
        "output_ids": [list(o["output_ids"]) for o in full],
        "rows": [o["meta_info"]["hidden_states_rows"].float() for o in full],
        "positions": [o["meta_info"]["hidden_states_positions"] for o in full],
        "last_rows": [o["meta_info"]["hidden_states_rows"].float() for o in last],
        "last_positions": [o["meta_info"]["hidden_states_positions"] for o in last],
        "last_output_ids": [list(o["output_ids"]) for o in last],
        "verify_ct": [o["meta_info"].get("spec_verify_ct") for o in full],
        "completion": [o["meta_info"]["completion_tokens"] for o in full],
    }
    if group == "plain":
        spec = torch.load(work / "spec.pt")
        replay_ids = [p + o for p, o in zip(prompts, spec["output_ids"])]
        replay = llm.generate(input_ids=replay_ids, sampling_params={"max_new_tokens": 0},
                              return_hidden_states=True, hidden_states_format="tensor")
        saved["replay_rows"] = [o["meta_info"]["hidden_states_rows"].float() for o in replay]
        saved["replay_positions"] = [o["meta_info"]["hidden_states_positions"] for o in replay]
    llm.shutdown()
    torch.save(saved, work / f"{group}.pt")
    return {"group": group}


def _compare(name: str, rows: list[torch.Tensor], refs: list[torch.Tensor], shift: int = 0) -> dict:
    if not rows:
        return {"rows": name, "min_cosine": "n/a (no request to compare)", "max_abs_diff": ""}
    cos, diff = [], []
    for got, ref in zip(rows, refs):
        if shift:
            got, ref = got[shift:], ref[:-shift]
        n = min(got.shape[0], ref.shape[0])
        cos.append(torch.nn.functional.cosine_similarity(got[:n], ref[:n], dim=-1).min().item())
        diff.append((got[:n] - ref[:n]).abs().max().item())
    return {"rows": name, "min_cosine": round(min(cos), 4), "max_abs_diff": f"{max(diff):.3g}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-dir", required=True, help="a folder with the SmolLM2 tokenizer files")
    p.add_argument("--workdir", default="/tmp/sglang-rl-spec-check")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-new", type=int, default=61, help="odd on purpose: runs overshoot the end")
    p.add_argument("--cpu", action="store_true", help="smoke-test this script on the CPU, without speculative decoding")
    p.add_argument("--group", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.group:
        print("RESULT " + json.dumps(run_group(args, args.group)), flush=True)
        return
    make_eagle_pair(Path(args.workdir), Path(args.tokenizer_dir))
    run_in_subprocesses(__file__, sys.argv[1:], "--group", ["spec", "plain"])
    spec = torch.load(Path(args.workdir) / "spec.pt")
    plain = torch.load(Path(args.workdir) / "plain.pt")

    n_rows = args.prompt_len + args.max_new
    positions_ok = all(pos == list(range(n_rows)) for pos in spec["positions"])
    replay_ok = all(pos == list(range(n_rows)) for pos in plain["replay_positions"])
    last_ok = all(pos == [n_rows - 2] for pos in spec["last_positions"])
    same_tokens = sum(a == b for a, b in zip(spec["output_ids"], plain["output_ids"]))
    steps = sum(spec["verify_ct"]) if all(spec["verify_ct"]) else None
    tokens_per_step = round(sum(spec["completion"]) / steps, 2) if steps else "n/a"
    replay = plain["replay_rows"]
    plain_same = [i for i in range(args.requests) if plain["output_ids"][i] == spec["output_ids"][i]]
    last_same = [i for i in range(args.requests) if spec["last_output_ids"][i] == spec["output_ids"][i]]
    rows = [
        _compare("spec FULL vs replay", spec["rows"], replay),
        _compare(f"plain FULL vs replay, {len(plain_same)} requests (decode noise)",
                 [plain["rows"][i] for i in plain_same], [replay[i] for i in plain_same]),
        _compare(f"spec LAST vs replay, {len(last_same)} requests",
                 [spec["last_rows"][i] for i in last_same], [replay[i][-2:-1] for i in last_same]),
        _compare("control: spec FULL one position off", spec["rows"], replay, shift=1),
    ]
    print(f"\nEAGLE rows vs a prefill replay; {args.requests} requests x {args.prompt_len} prompt + "
          f"{args.max_new} tokens, final row on")
    print(f"positions 0..{n_rows - 1} for every spec request: {positions_ok}; replay positions: {replay_ok}; "
          f"LAST at position {n_rows - 2}: {last_ok}")
    print(f"output tokens equal to plain decoding: {same_tokens}/{args.requests}; spec tokens per verify "
          f"step: {tokens_per_step}")
    print_table(rows, ["rows", "min_cosine", "max_abs_diff"])
    ok = (positions_ok and replay_ok and last_ok and rows[0]["min_cosine"] >= 0.99 and last_same
          and rows[2]["min_cosine"] >= 0.99 and rows[3]["min_cosine"] < 0.5)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
