"""Measure the termination check on a running server: how often a forced early stop is caught.

    python -m sglang.launch_server --model-path MODEL --toploc-verification --port 30000 &
    python toploc-scripts/forced_stop_table.py --server http://127.0.0.1:30000 --model-path MODEL

For each GSM8K prompt and temperature: the honest answer is verified (with its max_new_tokens),
then a cheat's version of it, cut at a random point before its end with EOS appended, and
fingerprinted by a prefill of its own (transformers rows, float32: for a float32 CPU server). A
cut counts as caught when the verdict is fail. Also printed: the share of all cut points at which
the model gives EOS at least the bound (where a cheat choosing its cut would pass).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

from table_common import post_generate, table_parser

RESULT = "toploc_verification_fingerprint_validation_result"
LIMIT = "toploc_verification_max_new_tokens"


def generate(url: str, prompt: list[int], temperature: float, max_tokens: int) -> dict:
    return post_generate(url, {"input_ids": prompt, "return_input_ids": True, "return_output_ids": True,
                       "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature}})["meta_info"]


def verify(url: str, ids: list[int], fingerprint: str, max_tokens: int) -> dict:
    out = post_generate(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                      "toploc_verification_fingerprint_to_validate": fingerprint, LIMIT: max_tokens})
    return json.loads(out["meta_info"][RESULT])


def forge(model, prompt: list[int], output: list[int]) -> tuple[str, list[float]]:
    """A fingerprint of `output` from transformers rows, and the model's log-probs at each of its
    positions."""
    import torch

    from sglang_rl.fingerprint import build_fingerprint, encode_fingerprint

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt + output[:-1]]), output_hidden_states=True)
    L, n = len(prompt), len(output)
    rows = out.hidden_states[-1][0][L - 1: L - 1 + n]
    logprobs = torch.log_softmax(out.logits[0][L - 1: L - 1 + n].float(), -1)
    return encode_fingerprint(build_fingerprint(rows.bfloat16(), topk=128, chunk_size=32)), logprobs


def main() -> int:
    parser = table_parser(__doc__, 32, 300, 192, [0.0, 1.0], "model folder (the server's model)")
    parser.add_argument("--min-eos-prob", type=float, default=0.001, help="the server's bound")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_rl.calibration.measure import gsm8k_prompts

    torch.set_grad_enabled(False)
    url = args.server.rstrip("/")
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    prompts = gsm8k_prompts(tokenizer, args.prompts, args.offset)
    rng = random.Random(args.seed)
    print("| temperature | answers (ended on EOS) | honest passed | honest EOS prob (min, median) "
          "| forced stops caught | cut points where EOS >= bound |")
    print("|---|---|---|---|---|---|")
    for temperature in args.temperatures:
        with ThreadPoolExecutor(8) as pool:
            metas = list(pool.map(lambda p: generate(url, p, temperature, args.max_tokens), prompts))
            honest = list(pool.map(lambda m: verify(url, m["input_ids"] + m["output_ids"],
                                                    m["toploc_verification_fingerprints"][-1], args.max_tokens), metas))
        jobs, open_cuts, cuts = [], 0, 0
        for meta in metas:
            out = meta["output_ids"]
            end = len(out) - 1 if out[-1] == eos else len(out)  # cut strictly before the natural end
            if end < 2:
                continue
            _, logprobs = forge(model, meta["input_ids"], out)
            p_eos = logprobs[1:end, eos].exp()
            open_cuts += int((p_eos >= args.min_eos_prob).sum())
            cuts += len(p_eos)
            k = rng.randrange(1, end)
            forced = out[:k] + [eos]
            fingerprint, _ = forge(model, meta["input_ids"], forced)
            jobs.append((meta["input_ids"] + forced, fingerprint))
        with ThreadPoolExecutor(8) as pool:
            forced_reports = list(pool.map(lambda j: verify(url, j[0], j[1], args.max_tokens), jobs))
        eos_probs = [r["eos_prob"] for r in honest if r.get("ends_on_eos")]
        caught = sum(r["verdict"] == "fail" for r in forced_reports)
        sound = sum(r.get("fingerprint_verdict") == "pass" for r in forced_reports)
        print(f"| {temperature:g} | {len(metas)} ({len(eos_probs)}) | {sum(r['verdict'] == 'pass' for r in honest)}"
              f"/{len(honest)} | {min(eos_probs, default=math.nan):.3g}, "
              f"{statistics.median(eos_probs) if eos_probs else math.nan:.3g} | {caught}/{len(forced_reports)} "
              f"(fingerprints sound: {sound}) | {open_cuts}/{cuts} ({open_cuts / max(cuts, 1):.1%}) |", flush=True)
        failed = [r["verdict_reasons"] for r in honest if r["verdict"] != "pass"]
        if failed:
            print(f"  honest answers not passed: {failed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
