"""``sglang-rl drafter init``: write a freshly initialised drafter folder for a target model
(EAGLE-1/2, or EAGLE3 with ``--arch eagle3``).
``sglang-rl drafter trainer``: one co-training trainer that several servers share.
``sglang-rl drafter widen``: a small model's drafter for that model widened (sglang_rl.widen)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

from sglang_rl.arguments import ArgumentParser
from sglang_rl.drafter.checkpoint import INIT_SCHEMES, init_drafter, save_drafter
from sglang_rl.drafter.config import DTYPE_NAMES, DrafterConfig

__all__ = ["main"]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="sglang-rl drafter", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write a random-init EAGLE drafter folder for a target model")
    init.add_argument("--arch", default="eagle", choices=["eagle", "eagle3"],
                      help="eagle (default): EAGLE-1/2 (--speculative-algorithm EAGLE); "
                      "eagle3: EAGLE3 (--speculative-algorithm EAGLE3)")
    init.add_argument("--draft-vocab-size", type=int, default=None,
                      help="eagle3: rows of the draft's LM head (default: the full vocabulary)")
    init.add_argument("--token-counts", default=None,
                      help="eagle3: JSON list of one count per token id; the draft vocabulary is the "
                      "--draft-vocab-size most frequent ids (without it: the lowest ids)")
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
        "normal: N(0, initializer_range) weights (eagle3 passthrough: reads the highest aux layer "
        "through the target's final norm and head)",
    )
    _trainer_parser(sub)
    # listed for --help; `sglang-rl drafter widen` runs sglang_rl.widen.cli.drafter_main (sglang_rl.cli.ROUTES)
    sub.add_parser("widen", add_help=False,
                   help="map a drafter of a small model to the model widened by `sglang-rl model --out`")
    return parser


# CotrainConfig fields a trainer takes as flags (named as a server's --drafter-cotrain-* flags)
_OWN = {"serve_dtype": "dtype of the weights sent to the servers (their --dtype)",
        "replay_decay": "replay weight per policy version behind", "seed": "seed of the replay draws"}
_TYPES = {"int": int, "float": float, "str": str, "Optional[int]": int, "Optional[str]": str}


# the folders have flags of their own; a shared trainer cannot see its servers' idle gaps
_NOT_TRAINER_FLAGS = {"draft_path", "target_path", "train_in_gaps", "gap_max_wait_s", "gap_busy_share"}


def _trainer_parser(sub) -> None:
    from sglang_rl.drafter.cotrain import CotrainConfig
    from sglang_rl.drafter.trainer_client import AUTHKEY_ENV

    trainer = sub.add_parser("trainer", help="one drafter trainer for several --drafter-cotrain-trainer servers")
    trainer.add_argument("--listen", required=True, help="HOST:PORT to accept servers on")
    trainer.add_argument("--authkey-env", default=AUTHKEY_ENV,
                         help="environment variable holding the shared key (the servers read " + AUTHKEY_ENV + ")")
    trainer.add_argument("--model-path", required=True, help="target model folder (embedding and LM head)")
    trainer.add_argument("--drafter-path", required=True, help="drafter folder to start from (the servers' draft)")
    for f in dataclasses.fields(CotrainConfig):
        if f.name in _NOT_TRAINER_FLAGS:
            continue
        flag = f.name.replace("_", "-")
        note = _OWN.get(f.name, f"as a server's --drafter-cotrain-{flag}")
        trainer.add_argument("--" + flag, type=_TYPES[str(f.type)], default=f.default, help=f"{note} (default {f.default})")


def _trainer(args) -> int:
    import os

    from sglang_rl.drafter.cotrain import CotrainConfig
    from sglang_rl.drafter.trainer_client import DEFAULT_AUTHKEY, parse_address
    from sglang_rl.drafter.trainer_server import flush_log, is_loopback, serve

    names = {f.name for f in dataclasses.fields(CotrainConfig)} - _NOT_TRAINER_FLAGS
    try:
        config = CotrainConfig(draft_path=args.drafter_path, target_path=args.model_path,
                               **{n: getattr(args, n) for n in names})
        config.check()
        host, _ = parse_address(args.listen)
        key = os.environ.get(args.authkey_env)
        if not key and not is_loopback(host):
            raise ValueError(f"listening on {host} needs a shared key: set {args.authkey_env} here and on the servers")
        return serve(config, args.listen, key.encode() if key else DEFAULT_AUTHKEY, log=flush_log)
    except (ValueError, OSError) as err:
        print(f"sglang-rl drafter trainer: error: {err}", file=sys.stderr)
        return 2


def _init_eagle3(args) -> int:
    import json

    from sglang_rl.drafter.eagle3 import init_eagle3, save_eagle3

    try:
        counts = None
        if args.token_counts is not None:
            with open(args.token_counts) as f:
                counts = json.load(f)
            if not isinstance(counts, list) or not all(isinstance(c, (int, float)) for c in counts):
                raise ValueError(f"{args.token_counts} must hold a JSON list of numbers, one per token id")
        cfg, tensors = init_eagle3(args.model_path, args.draft_vocab_size, counts, seed=args.seed, init=args.init)
        if args.dtype != "auto":
            cfg["dtype"] = cfg["torch_dtype"] = args.dtype
        out = save_eagle3(args.out, cfg, tensors)
    except (ValueError, OSError, KeyError) as err:
        print(f"sglang-rl drafter init: error: {err}", file=sys.stderr)
        return 2
    n_params = sum(t.numel() for n, t in tensors.items() if n not in ("d2t", "t2d"))
    print(f"wrote LlamaForCausalLMEagle3 drafter ({n_params} parameters, draft vocabulary "
          f"{cfg['draft_vocab_size']}) to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "widen":  # reached only as `python -m sglang_rl.drafter widen`
        print("sglang-rl drafter widen: error: run it as `sglang-rl drafter widen`", file=sys.stderr)
        return 2
    if args.command == "trainer":
        return _trainer(args)
    if args.arch == "eagle3":
        return _init_eagle3(args)
    if args.draft_vocab_size is not None or args.token_counts is not None:
        print("sglang-rl drafter init: error: --draft-vocab-size and --token-counts need --arch eagle3",
              file=sys.stderr)
        return 2
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
