"""A Llama target and an EAGLE draft, written with weights chosen so that the draft usually
guesses right: speculative decoding then commits runs of several tokens per step, which a random
(`--load-format dummy`) draft never does.

Construction (hidden size H, every embedding a vector of +-1, so its RMS norm is itself):
* target: every layer's output projections (`o_proj`, `down_proj`) are scaled by `layer_scale`,
  so a position's last-layer row is its token's embedding plus a small context-dependent part,
  and greedy decoding mostly follows the context-free map t -> argmax(lm_head @ embed(t));
* draft (`LlamaForCausalLMEagle`, one layer): `fc` passes the embedding half of its input
  through and drops the target-row half, and its layer adds nothing (zero output projections),
  so it proposes exactly that map. The target disagrees where the context part flips its
  greedy token: those drafts are rejected, so accepted runs vary in length.

The draft shares the target's embedding and lm_head (sglang's EAGLE worker sets them), so its
file holds only `fc` and its layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _config(hidden: int, layers: int, vocab: int, arch: str) -> dict:
    return {
        "architectures": [arch], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4, "num_attention_heads": hidden // 64,
        "num_hidden_layers": layers, "num_key_value_heads": max(1, hidden // 256),
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


def _layer(prefix: str, cfg: dict, out_scale: float, gen: torch.Generator, input_norm: bool) -> dict:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])

    def randn(rows: int, cols: int, scale: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (scale / cols ** 0.5)

    w = {
        f"{prefix}.self_attn.q_proj.weight": randn(h, h, 1.0),
        f"{prefix}.self_attn.k_proj.weight": randn(kv, h, 1.0),
        f"{prefix}.self_attn.v_proj.weight": randn(kv, h, 1.0),
        f"{prefix}.self_attn.o_proj.weight": randn(h, h, out_scale),
        f"{prefix}.mlp.gate_proj.weight": randn(i, h, 1.0),
        f"{prefix}.mlp.up_proj.weight": randn(i, h, 1.0),
        f"{prefix}.mlp.down_proj.weight": randn(h, i, out_scale),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
    }
    if input_norm:
        w[f"{prefix}.input_layernorm.weight"] = torch.ones(h)
    return w


def _save(folder: Path, cfg: dict, weights: dict, tokenizer_dir: Path | None) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
              str(folder / "model.safetensors"))
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        src = tokenizer_dir / name
        if src.exists():
            (folder / name).write_bytes(src.read_bytes())


def make_eagle_pair(root: Path, tokenizer_dir: Path | None, hidden: int = 1024, layers: int = 4,
                    vocab: int = 49152, layer_scale: float = 0.03, seed: int = 0) -> tuple[Path, Path]:
    """Write `root/target` and `root/draft` (kept if both are already there: a wide target takes a
    while to draw); returns their paths."""
    if all((root / name / "model.safetensors").exists() for name in ("target", "draft")):
        return root / "target", root / "draft"
    gen = torch.Generator().manual_seed(seed)
    cfg = _config(hidden, layers, vocab, "LlamaForCausalLM")
    target = {
        "model.embed_tokens.weight": torch.randint(0, 2, (vocab, hidden), generator=gen).float() * 2 - 1,
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5,
        "model.norm.weight": torch.ones(hidden),
    }
    for n in range(layers):
        target.update(_layer(f"model.layers.{n}", cfg, layer_scale, gen, input_norm=True))
    _save(root / "target", cfg, target, tokenizer_dir)

    draft_cfg = _config(hidden, 1, vocab, "LlamaForCausalLMEagle")
    draft = {
        "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
        "fc.bias": torch.zeros(hidden),
    }
    draft.update(_layer("layers.0", draft_cfg, 0.0, gen, input_norm=False))
    _save(root / "draft", draft_cfg, draft, None)
    return root / "target", root / "draft"
