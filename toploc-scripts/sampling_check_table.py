"""Measure the temperature-1 sampling test on a running server: generate GSM8K answers at
several temperatures, verify each with toploc_verification_expect_sampled, print Z per response
and the worker-level Z of each group.

    python -m sglang.launch_server --model-path MODEL --toploc-verification --port 30000 &
    python toploc-scripts/sampling_check_table.py --server http://127.0.0.1:30000 --model-path MODEL

Only temperature 1 is honest for the test; the other rows show how far colder or hotter sampling
moves Z.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

from table_common import post_generate, table_parser

RESULT = "toploc_verification_fingerprint_validation_result"


def check(url: str, prompt: list[int], temperature: float, max_tokens: int) -> dict:
    meta = post_generate(url, {"input_ids": prompt, "return_input_ids": True, "return_output_ids": True,
                       "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature}})["meta_info"]
    out = post_generate(url, {"input_ids": meta["input_ids"] + meta["output_ids"], "sampling_params": {"max_new_tokens": 0},
                      "toploc_verification_fingerprint_to_validate": meta["toploc_verification_fingerprints"][-1],
                      "toploc_verification_expect_sampled": True})
    return json.loads(out["meta_info"][RESULT])


def main() -> int:
    parser = table_parser(__doc__, 24, 200, 96, [1.0, 0.7, 0.0, 1.3], "model folder (tokenizer and chat template)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from sglang_rl.calibration.measure import gsm8k_prompts
    from sglang_rl.fingerprint.sampling import combined_z

    prompts = gsm8k_prompts(AutoTokenizer.from_pretrained(args.model_path), args.prompts, args.offset)
    print("| temperature | responses | Z per response (min .. max) | rejected per response | worker Z |")
    print("|---|---|---|---|---|")
    for temperature in args.temperatures:
        with ThreadPoolExecutor(8) as pool:
            reports = list(pool.map(lambda p: check(args.server.rstrip("/"), p, temperature, args.max_tokens), prompts))
        zs = [r["sampling_z"] for r in reports]
        worker = combined_z(zs, [r["sampling_checked"] for r in reports])
        rejected = sum(not r["sampling_consistent"] for r in reports)
        print(f"| {temperature:g} | {len(reports)} | {min(zs):.2f} .. {max(zs):.2f} | {rejected}/{len(reports)} | {worker:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
