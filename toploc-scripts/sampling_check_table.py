"""Measure the temperature-1 sampling test on a running server: generate GSM8K answers at
several temperatures, verify each with toploc_verification_expect_sampled, print Z per response
and the worker-level Z of each group.

    python -m sglang.launch_server --model-path MODEL --toploc-verification --port 30000 &
    python toploc-scripts/sampling_check_table.py --server http://127.0.0.1:30000 --model-path MODEL

Only temperature 1 is honest for the test; the other rows show how far colder or hotter sampling
moves Z.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

RESULT = "toploc_verification_fingerprint_validation_result"


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


def check(url: str, prompt: list[int], temperature: float, max_tokens: int) -> dict:
    meta = _post(url, {"input_ids": prompt, "return_input_ids": True, "return_output_ids": True,
                       "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature}})["meta_info"]
    out = _post(url, {"input_ids": meta["input_ids"] + meta["output_ids"], "sampling_params": {"max_new_tokens": 0},
                      "toploc_verification_fingerprint_to_validate": meta["toploc_verification_fingerprints"][-1],
                      "toploc_verification_expect_sampled": True})
    return json.loads(out["meta_info"][RESULT])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="server URL")
    parser.add_argument("--model-path", required=True, help="model folder (tokenizer and chat template)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--offset", type=int, default=200, help="first GSM8K prompt")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.0, 1.3])
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
