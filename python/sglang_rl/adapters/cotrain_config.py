"""The co-training process's config from a server's `--drafter-cotrain-*` flags."""

from __future__ import annotations

from typing import Any

from sglang_rl.drafter.cotrain import CotrainConfig


def config_from_args(server_args: Any) -> CotrainConfig:
    """The co-training process's config from the server flags (checked: ValueError on bad values)."""
    dtype = str(server_args.dtype)
    config = CotrainConfig(
        draft_path=server_args.speculative_draft_model_path,
        target_path=server_args.model_path,
        device=server_args.drafter_cotrain_device or _server_device(server_args),
        buffer_bytes=server_args.drafter_cotrain_buffer_bytes,
        samples_per_round=server_args.drafter_cotrain_samples_per_round,
        steps=server_args.drafter_cotrain_steps,
        lr=server_args.drafter_cotrain_lr,
        window=server_args.drafter_cotrain_window,
        samples_per_step=server_args.drafter_cotrain_samples_per_step,
        soft_topk=server_args.drafter_cotrain_soft_topk,
        serve_dtype=dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16",
        threads=server_args.drafter_cotrain_threads,
        unroll_steps=server_args.drafter_cotrain_unroll_steps,
        replay_samples=server_args.drafter_cotrain_replay_samples,
        lr_schedule=server_args.drafter_cotrain_lr_schedule,
        train_dtype=server_args.drafter_cotrain_train_dtype,
        train_in_gaps=server_args.drafter_cotrain_train_in_gaps,
        gap_max_wait_s=server_args.drafter_cotrain_gap_max_wait_s,
    )
    config.check()
    return config


def _server_device(server_args: Any) -> str:
    device = str(server_args.device or "cuda")
    if device == "cuda":
        return f"cuda:{server_args.base_gpu_id}"
    return device
