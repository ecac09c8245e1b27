"""``sglang-rl model``: the default model's folder, or that model widened into a larger Llama shape.

    sglang-rl model                                   # print SmolLM2-135M-Instruct's folder
    sglang-rl model --shape llama-8b --out DIR        # SmolLM2 widened to the Llama-3.1-8B shape
    sglang-rl model --hidden-size 1152 --num-heads 12 --num-kv-heads 4 --head-dim 128 \\
        --intermediate-size 1600 --num-layers 31 --dtype float32 --out DIR

``sglang-rl drafter widen`` (:func:`drafter_main`) maps a drafter of the small model to the wide one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from sglang_rl.arguments import ArgumentParser

__all__ = ["drafter_main", "main"]

_SIZE_FLAGS = {"hidden_size": "--hidden-size", "num_attention_heads": "--num-heads",
               "num_key_value_heads": "--num-kv-heads", "head_dim": "--head-dim",
               "intermediate_size": "--intermediate-size", "num_hidden_layers": "--num-layers"}


def _parser() -> ArgumentParser:
    from sglang_rl.widen.model import DTYPES
    from sglang_rl.widen.shape import LAYOUTS, NAMED_SHAPES

    p = ArgumentParser(prog="sglang-rl model", description=(
        "Without flags: print the default model's folder (SmolLM2-135M-Instruct), building it if needed. "
        "With --out: write that model (or --model-path) widened into a larger Llama shape that computes "
        "the same function (an 8B model's cost, the small model's answers)."))
    p.add_argument("--out", help="folder to write the widened model to")
    p.add_argument("--model-path", help="Llama model folder to widen (default: the default model)")
    p.add_argument("--shape", choices=sorted(NAMED_SHAPES), help="named wide shape (llama-8b: hidden 4096, "
                   "32 heads of 128, 8 KV heads, MLP 14336, 32 layers); the size flags change it")
    for field, flag in _SIZE_FLAGS.items():
        p.add_argument(flag, dest=field, type=int, default=None, help=f"wide {field}")
    p.add_argument("--layout", default="copies", choices=LAYOUTS,
                   help="copies (default): padded hidden dims carry scaled copies of the stream so every "
                   "RMSNorm is exact (falls back to zeros below twice the small width); zeros: zero padding, "
                   "norm weights x sqrt(h/H)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights' dtype (default: the model's)")
    p.add_argument("--shard-gib", type=float, default=2.0, help="largest safetensors shard, GiB (default 2)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglang-rl model``; returns the exit code."""
    args = _parser().parse_args(argv)
    sizes = {f: getattr(args, f) for f in _SIZE_FLAGS}
    if args.out is None:
        if args.shape or any(v is not None for v in sizes.values()) or args.model_path:
            print("sglang-rl model: error: widening needs --out DIR", file=sys.stderr)
            return 2
        from sglang_rl.default_model import ensure_default_model

        print(ensure_default_model())
        return 0
    import json

    from sglang_rl.widen.model import widen_model
    from sglang_rl.widen.shape import NAMED_SHAPES, Shape, WidenError

    try:
        if args.model_path is None:
            from sglang_rl.default_model import ensure_default_model

            src = ensure_default_model()
        else:
            src = Path(args.model_path)
        small = Shape.from_config(json.loads((src / "config.json").read_text()))
        wide = (NAMED_SHAPES[args.shape] if args.shape else small).replace(**sizes)
        if wide == small:
            raise WidenError("the wide shape equals the model's: pass --shape or size flags")
        out = widen_model(src, args.out, wide, layout=args.layout, dtype=args.dtype,
                          shard_bytes=int(args.shard_gib * 2**30), log=print)
    except (WidenError, ValueError, OSError, KeyError) as err:
        print(f"sglang-rl model: error: {err}", file=sys.stderr)
        return 2
    n = wide.num_parameters(int(json.loads((out / "config.json").read_text())["vocab_size"]))
    print(f"wrote {out} ({n / 1e9:.2f}B parameters, hidden {wide.hidden_size}, {wide.num_hidden_layers} layers)")
    return 0


def drafter_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglang-rl drafter widen``; returns the exit code."""
    from sglang_rl.widen.drafter import widen_drafter
    from sglang_rl.widen.shape import WidenError

    p = ArgumentParser(prog="sglang-rl drafter widen", description=(
        "Map an EAGLE or EAGLE3 drafter of a small model to that model widened by `sglang-rl model --out`: "
        "the same drafts, at the wide model's width."))
    p.add_argument("--drafter-path", required=True, help="drafter folder of the small model")
    p.add_argument("--model-path", required=True, help="the widened target folder")
    p.add_argument("--out", required=True, help="folder to write the wide drafter to")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights' dtype (default: the drafter's)")
    args = p.parse_args(argv)
    try:
        out, kind = widen_drafter(args.drafter_path, args.model_path, args.out, args.dtype)
    except (WidenError, ValueError, OSError, KeyError) as err:
        print(f"sglang-rl drafter widen: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {kind} drafter for {args.model_path} to {out}")
    return 0
