"""The co-training process's config from a server's `--drafter-cotrain-*` flags."""

from __future__ import annotations

from typing import Any

from sglang_rl.drafter.cotrain import CotrainConfig


# CotrainConfig fields set by the server flag of the same name, `--drafter-cotrain-<field>`
FLAG_FIELDS = ("buffer_bytes", "samples_per_round", "steps", "lr", "window", "samples_per_step", "soft_topk",
               "threads", "unroll_steps", "feature_noise", "replay_samples", "lr_schedule", "train_dtype", "train_in_gaps",
               "gap_max_wait_s", "gap_busy_share", "swap_check_samples", "objective", "temperature")


def config_from_args(server_args: Any) -> CotrainConfig:
    """The co-training process's config from the server flags (checked: ValueError on bad values)."""
    dtype = str(server_args.dtype)
    config = CotrainConfig(
        draft_path=server_args.speculative_draft_model_path,
        target_path=server_args.model_path,
        device=server_args.drafter_cotrain_device or _server_device(server_args),
        serve_dtype=dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16",
        **{name: getattr(server_args, f"drafter_cotrain_{name}") for name in FLAG_FIELDS},
    )
    config.check()
    return config


def _server_device(server_args: Any) -> str:
    device = str(server_args.device or "cuda")
    if device == "cuda":
        return f"cuda:{server_args.base_gpu_id}"
    return device
