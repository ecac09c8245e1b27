"""The suite's small random-weight model, for end-to-end tests that need no real text.

SmolLM2's tokenizer, chat template and config, with a 2-layer body of hidden size 256 (4 query and
2 KV heads of 64, MLP 512; the tied embedding is most of its 13.8M parameters), float32 weights
drawn from a fixed seed. Its servers answer what the hidden-state, k-CBS and differential tests
compare (rows against a transformers forward, sglang alone against the plugin) at a fraction of
SmolLM2-135M's cost on the CPU: one server each, 20 sequential 5-token requests took 2.1 s against
11.2 s, and 8 concurrent 64-token requests 1.7 s against 15.0 s (2-core VM). Hidden size 256 keeps
TOPLOC's 128 top values per row meaningful.

Built once per machine beside the default model (SGLANG_RL_MODEL_DIR's parent), atomically: the
pool's start threads and the tests' fixtures may ask for it at the same time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64}
SEED = 0
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def random_model_dir() -> Path:
    from sglang_rl.default_model import model_dir

    return model_dir().parent / "SmolLM2-random-2x256"


def ensure_random_model() -> Path:
    """The model's folder, built if it is missing (seeded: the same weights on every machine). It
    is built in a fresh interpreter: building torch modules draws from torch's global generator,
    which must not move under the tests of the calling process."""
    target = random_model_dir()
    if not (target / "model.safetensors").exists():
        subprocess.run([sys.executable, __file__], check=True, timeout=600)
    return target


def build(target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sglang_rl.default_model import ensure_default_model

    source = ensure_default_model()
    config = json.loads((source / "config.json").read_text())
    config.pop("_model_name_or_path", None)
    config.update(SHAPE, dtype="float32")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    torch.manual_seed(SEED)
    LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32).save_pretrained(staging)
    for name in FILES:
        shutil.copy(source / name, staging / name)
    try:
        os.rename(staging, target)
    except OSError:  # built by another process meanwhile
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    build(random_model_dir())
