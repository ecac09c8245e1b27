"""Collect calibration records from running servers (the way to feed GPU measurements in).

    sglang-rl calibrate-server --generator URL --verifier URL --model-path MODEL_DIR \\
        --config fp8_weights --cheat --out fp8.jsonl [--save-rollouts fp8_rollouts.jsonl.gz]
    sglang-rl calibrate-server --verify-rollouts fp8_rollouts.jsonl.gz --verifier URL --out fp8_x.jsonl
    sglang-rl calibrate --model-path MODEL_DIR --out cal.json --stats fp8.jsonl --stats honest.jsonl

The generator server (``--toploc-verification``, any configuration: CUDA graphs, batch size,
TP, attention backend, or a cheat such as ``--quantization fp8``) answers GSM8K prompts greedily;
the verifier server (the agreed model, ``--toploc-verification``) checks each fingerprint in the
exact-token form. Every result becomes one record of ``sglang_rl.calibration.measure`` (the server's
result fields plus ``config``, ``honest``, ``prompt`` and which generator and verifier, on which
GPU, made it). Every other pair of prompts asks for 33..63 tokens instead of ``--max-tokens``, so
that short final chunks are measured too. ``--save-rollouts`` also writes the responses
(``sglang_rl.calibration.rollouts``), and ``--verify-rollouts`` checks such saved responses on a
verifier of another host (another GPU type) without a generator. Needs the standard library and
the model's tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence

from sglang_rl.arguments import ArgumentParser
from sglang_rl.calibration.measure import gsm8k_prompts, write_records
from sglang_rl.calibration.rollouts import gpu_name, read_rollouts, rollout_files, verify_saved, write_rollouts
from sglang_rl_client import Rollout, Transport, VerifierClient


def token_budget(index: int, max_tokens: int) -> int:
    """``max_tokens`` for prompts 0, 1, 4, 5, ...; 33..63 (a short final chunk) for 2, 3, 6, 7, ..."""
    if index % 4 < 2 or max_tokens <= 33:
        return max_tokens
    return 33 + (index * 7) % min(31, max_tokens - 33)


def collect(
    generator: str, verifier: str, prompts: Sequence[list[int]], config: str, honest: bool,
    max_tokens: int = 64, batch: int = 16, timeout: float = 1800.0, rollouts: list[dict] | None = None,
    generator_gpu: str = "unknown", verifier_config: str = "verifier", verifier_gpu: str = "unknown",
) -> list[dict]:
    """Generate on ``generator``, verify on ``verifier`` (``batch`` requests in flight, so the
    servers batch them), return one record per response; each response is also appended to
    ``rollouts`` when given (in prompt order)."""
    source = Transport(generator, timeout=timeout)
    check = VerifierClient(verifier, timeout=timeout)

    def one(i: int) -> tuple[dict, dict]:
        budget = token_budget(i, max_tokens)
        meta = source.post("/generate", {
            "input_ids": prompts[i],
            "sampling_params": {"max_new_tokens": budget, "temperature": 0.0},
            "return_input_ids": True, "return_output_ids": True,
        })["meta_info"]
        fingerprint = meta["toploc_verification_fingerprints"][-1]
        report = check.verify(Rollout(meta["input_ids"], meta["output_ids"], fingerprint))
        saved = {"config": config, "honest": honest, "prompt": i, "input_ids": meta["input_ids"],
                 "output_ids": meta["output_ids"], "fingerprint": fingerprint, "max_tokens": budget,
                 "generator_gpu": generator_gpu}
        record = {"config": config, "honest": honest, "prompt": i, "generator_config": config,
                  "generator_gpu": generator_gpu, "verifier_config": verifier_config,
                  "verifier_gpu": verifier_gpu, **report}
        return record, saved

    with ThreadPoolExecutor(batch) as pool:
        pairs = list(pool.map(one, range(len(prompts))))
    if rollouts is not None:
        rollouts.extend(saved for _, saved in pairs)
    return [record for record, _ in pairs]


def _report(records: list[dict], out: str) -> None:
    failed = sum(not r.get("verified") for r in records)
    print(f"{len(records)} records ({failed} not verified at the server's bounds) -> {out}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(description="Collect calibration records from a generator and a verifier server.")
    parser.add_argument("--generator", help="generator server URL (not with --verify-rollouts)")
    parser.add_argument("--verifier", required=True, help="verifier server URL (the agreed model)")
    parser.add_argument("--model-path", help="model folder (for the tokenizer and chat template; "
                                             "not needed with --verify-rollouts)")
    parser.add_argument("--config", help="name of the generator's configuration")
    parser.add_argument("--cheat", action="store_true", help="the generator is a cheat (default: honest)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--offset", type=int, default=0, help="first GSM8K prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="requests in flight")
    parser.add_argument("--out", required=True, help="JSON-lines file of records to write")
    parser.add_argument("--save-rollouts", help="also write the responses (JSON lines, gzip for .gz) "
                                                "for --verify-rollouts on another host")
    parser.add_argument("--verify-rollouts", action="append", default=[],
                        help="verify saved responses (a file or a folder of them; repeatable) instead "
                             "of generating")
    parser.add_argument("--verifier-config", default="verifier", help="name of the verifier's configuration")
    parser.add_argument("--generator-gpu", help="the generator's GPU name (default: this host's first GPU, or cpu)")
    parser.add_argument("--verifier-gpu", help="the verifier's GPU name (default: this host's first GPU, or cpu)")
    args = parser.parse_args(argv)
    if args.verify_rollouts:
        if args.generator or args.save_rollouts:
            parser.error("--verify-rollouts takes no --generator and no --save-rollouts")
        try:
            rows = [row for path in rollout_files(args.verify_rollouts) for row in read_rollouts(path)]
        except (OSError, ValueError) as exc:
            parser.error(f"--verify-rollouts: {exc}")
        records = verify_saved(args.verifier.rstrip("/"), rows, args.verifier_config,
                               args.verifier_gpu or gpu_name(), args.batch)
        write_records(records, args.out)
        _report(records, args.out)
        return 0
    if not args.generator or not args.config or not args.model_path:
        parser.error("--generator, --config and --model-path are needed (or --verify-rollouts)")
    if not (Path(args.model_path) / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: not a model folder (no config.json)")
    from transformers import AutoTokenizer

    prompts = gsm8k_prompts(AutoTokenizer.from_pretrained(args.model_path), args.prompts, args.offset)
    saved: list[dict] = []
    records = collect(args.generator.rstrip("/"), args.verifier.rstrip("/"), prompts, args.config,
                      not args.cheat, args.max_tokens, args.batch, rollouts=saved,
                      generator_gpu=args.generator_gpu or gpu_name(), verifier_config=args.verifier_config,
                      verifier_gpu=args.verifier_gpu or gpu_name())
    write_records(records, args.out)
    if args.save_rollouts:
        write_rollouts(saved, args.save_rollouts)
    _report(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
