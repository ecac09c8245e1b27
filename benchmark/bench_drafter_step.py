"""Cost of one drafter training step by unroll depth, compute dtype and soft-loss vocabulary.

Plain torch, no server: a drafter of SmolLM2-135M's shape (random weights, random rows) trained
on packed batches as co-training packs them (``--samples`` windows of ``--length`` pairs). Prints
milliseconds per optimizer step and peak memory for every combination; checks that each step
is finite and that the weights stay float32 under bf16 autocast.

  python benchmark/bench_drafter_step.py --device cuda --unroll 1 2 3 --dtype float32 bfloat16 --soft-topk 0 64
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from sglang_rl.drafter import DrafterConfig, DrafterTrainer, EagleDrafter, EagleLossConfig, TargetHead
from sglang_rl.drafter.config import dtype_from_name

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "hidden_act": "silu", "rope_theta": 100000.0, "tie_word_embeddings": True,
}


def batch(samples: int, length: int, hidden: int, vocab: int, gen: torch.Generator) -> dict:
    n = samples * length
    return {
        "input_ids": torch.randint(0, vocab, (1, n), generator=gen),
        "hidden_states": torch.randn(1, n, hidden, generator=gen).to(torch.bfloat16),
        "target": torch.randn(1, n, hidden, generator=gen).to(torch.bfloat16),
        "loss_mask": torch.ones(1, n),
        "position_ids": torch.arange(length).repeat(samples).unsqueeze(0),
        "cu_seqlens": torch.arange(0, n + 1, length, dtype=torch.int32),
    }


def time_steps(args: argparse.Namespace, unroll: int, dtype: str, topk: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    config = DrafterConfig.from_dict(SMOLLM2_135M)
    embed = torch.randn(config.vocab_size, config.hidden_size, generator=gen) * 0.02
    model = EagleDrafter(config, TargetHead(embed=embed, lm_head=embed)).to(args.device)
    trainer = DrafterTrainer(model, lr=1e-4, unroll_steps=unroll, autocast_dtype=dtype_from_name(dtype),
                             loss=EagleLossConfig(soft_topk=topk or None), full_vocab_metrics=False)
    prepared = trainer.as_batches(batch(args.samples, args.length, config.hidden_size, config.vocab_size, gen))
    trainer.train_steps(prepared, args.warmup)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    history = trainer.train_steps(prepared, args.steps)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / args.steps * 1e3
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
    return {"unroll": unroll, "dtype": dtype, "soft_topk": topk or "full", "ms_per_step": round(ms, 2),
            "peak_gib": None if peak is None else round(peak, 2), "loss": round(history[-1]["loss"], 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--unroll", type=int, nargs="+", default=[1, 3])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--soft-topk", type=int, nargs="+", default=[0, 64], help="0: full vocabulary")
    p.add_argument("--samples", type=int, default=16, help="windows per step (samples_per_step)")
    p.add_argument("--length", type=int, default=512, help="pairs per window")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    for unroll, dtype, topk in itertools.product(args.unroll, args.dtype, args.soft_topk):
        print(json.dumps(time_steps(args, unroll, dtype, topk)), flush=True)


if __name__ == "__main__":
    main()
