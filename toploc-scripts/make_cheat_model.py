"""Write a cheaper stand-in of a model, for measuring what TOPLOC catches on a real server.

    python toploc-scripts/make_cheat_model.py --model-path MODEL_DIR --noise 0.01 --out /tmp/noise1
    python toploc-scripts/make_cheat_model.py --model-path MODEL_DIR --drop-layers 2 --out /tmp/pruned

``--noise r`` adds gaussian noise of r x (each weight tensor's RMS) to every weight, as the CPU
calibration's ``noise{r}`` cheat does; ``--drop-layers n`` removes the last n decoder layers (another
model with the same tokenizer, cheaper to serve). Serve the output folder as the generator of
``sglang-rl calibrate-server --cheat``. Precision cheats need no folder: start the
generator with ``--quantization fp8``, ``--kv-cache-dtype fp8_e4m3`` or ``--dtype float16``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="the agreed model (transformers folder)")
    parser.add_argument("--out", required=True, help="folder to write the cheat model to")
    parser.add_argument("--noise", type=float, help="relative gaussian weight noise")
    parser.add_argument("--drop-layers", type=int, help="decoder layers to remove from the end")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.noise is None) == (args.drop_layers is None):
        parser.error("give exactly one of --noise and --drop-layers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_rl.calibration.measure import noisy_model

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    if args.noise is not None:
        model = noisy_model(model, args.noise, args.seed)
    else:
        layers = model.model.layers
        if not 0 < args.drop_layers < len(layers):
            parser.error(f"the model has {len(layers)} layers; --drop-layers must be in 1..{len(layers) - 1}")
        model.model.layers = layers[: len(layers) - args.drop_layers]
        model.config.num_hidden_layers = len(model.model.layers)
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[: model.config.num_hidden_layers]
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    AutoTokenizer.from_pretrained(args.model_path).save_pretrained(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
