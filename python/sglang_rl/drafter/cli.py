"""``sglang-rl drafter init``: write a freshly initialised drafter folder for a target model."""

from __future__ import annotations

import sys
from typing import Sequence

from sglang_rl.cli import ArgumentParser
from sglang_rl.drafter.checkpoint import INIT_SCHEMES, init_drafter, save_drafter
from sglang_rl.drafter.config import DTYPE_NAMES, DrafterConfig

__all__ = ["main"]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="sglang-rl drafter", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write a random-init EAGLE drafter folder for a target model")
    init.add_argument("--model-path", required=True, help="target model folder (config.json + safetensors)")
    init.add_argument("--out", required=True, help="folder to write config.json and model.safetensors to")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
        help="dtype of the saved weights (auto: the target's)",
    )
    init.add_argument(
        "--init", default="passthrough", choices=INIT_SCHEMES,
        help="passthrough (default): starts as h_{t+1} = h_t, so it drafts the last token again; "
        "normal: N(0, initializer_range) weights",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        target_dtype = DrafterConfig.from_dir(args.model_path).dtype
        model = init_drafter(args.model_path, seed=args.seed, init=args.init)
        out = save_drafter(model, args.out, target_dtype if args.dtype == "auto" else args.dtype)
    except (ValueError, OSError, KeyError) as err:  # config/checkpoint errors are ValueErrors
        print(f"sglang-rl drafter {args.command}: error: {err}", file=sys.stderr)
        return 2
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {model.config.draft_architecture} drafter ({n_params} trainable parameters) to {out}")
    return 0
