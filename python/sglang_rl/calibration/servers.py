"""Collect calibration records from running servers (the way to feed GPU measurements in).

    sglang-rl calibrate-server --generator URL --verifier URL --model-path MODEL_DIR \\
        --config fp8_weights --cheat --out fp8.jsonl
    sglang-rl calibrate --model-path MODEL_DIR --out cal.json --stats fp8.jsonl --stats honest.jsonl

The generator server (``--toploc-verification``, any configuration: CUDA graphs, batch size,
TP, attention backend, or a cheat such as ``--quantization fp8``) answers GSM8K prompts greedily;
the verifier server (the agreed model, ``--toploc-verification``) checks each fingerprint in the
exact-token form. Every result becomes one record of ``sglang_rl.calibration.measure`` (the server's
result fields plus ``config``, ``honest`` and ``prompt``). Every other pair of prompts asks for
33..63 tokens instead of ``--max-tokens``, so that short final chunks are measured too. Needs the
standard library and the model's tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence

from sglang_rl.cli import ArgumentParser
from sglang_rl.calibration.measure import gsm8k_prompts, write_records
from sglang_rl_client import Rollout, Transport, VerifierClient

def token_budget(index: int, max_tokens: int) -> int:
    """``max_tokens`` for prompts 0, 1, 4, 5, ...; 33..63 (a short final chunk) for 2, 3, 6, 7, ..."""
    if index % 4 < 2 or max_tokens <= 33:
        return max_tokens
    return 33 + (index * 7) % min(31, max_tokens - 33)


def collect(
    generator: str, verifier: str, prompts: Sequence[list[int]], config: str, honest: bool,
    max_tokens: int = 64, batch: int = 16, timeout: float = 1800.0,
) -> list[dict]:
    """Generate on ``generator``, verify on ``verifier`` (``batch`` requests in flight, so the
    servers batch them), return one record per response."""
    source = Transport(generator, timeout=timeout)
    check = VerifierClient(verifier, timeout=timeout)

    def one(i: int) -> dict:
        meta = source.post("/generate", {
            "input_ids": prompts[i],
            "sampling_params": {"max_new_tokens": token_budget(i, max_tokens), "temperature": 0.0},
            "return_input_ids": True, "return_output_ids": True,
        })["meta_info"]
        report = check.verify(Rollout(meta["input_ids"], meta["output_ids"],
                                      meta["toploc_verification_fingerprints"][-1]))
        return {"config": config, "honest": honest, "prompt": i, **report}

    with ThreadPoolExecutor(batch) as pool:
        return list(pool.map(one, range(len(prompts))))


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(description="Collect calibration records from a generator and a verifier server.")
    parser.add_argument("--generator", required=True, help="generator server URL")
    parser.add_argument("--verifier", required=True, help="verifier server URL (the agreed model)")
    parser.add_argument("--model-path", required=True, help="model folder (for the tokenizer and chat template)")
    parser.add_argument("--config", required=True, help="name of the generator's configuration")
    parser.add_argument("--cheat", action="store_true", help="the generator is a cheat (default: honest)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--offset", type=int, default=0, help="first GSM8K prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="requests in flight")
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    args = parser.parse_args(argv)
    if not (Path(args.model_path) / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: not a model folder (no config.json)")
    from transformers import AutoTokenizer

    prompts = gsm8k_prompts(AutoTokenizer.from_pretrained(args.model_path), args.prompts, args.offset)
    records = collect(args.generator.rstrip("/"), args.verifier.rstrip("/"), prompts, args.config,
                      not args.cheat, args.max_tokens, args.batch)
    write_records(records, args.out)
    failed = sum(not r.get("verified") for r in records)
    print(f"{len(records)} records ({failed} not verified at the server's bounds) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
