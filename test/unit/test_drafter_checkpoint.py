"""Drafter folders (sglang_rl.drafter.checkpoint/config/cli) on tiny Llama and Qwen2 targets.

The expected names and config fields are the ones sglang 0.5.17's EAGLE draft loading needs:
``LlamaForCausalLMEagle.load_weights`` prepends ``model.`` and skips ``lm_head``; layer 0 has
no ``input_layernorm``; the worker replaces embed and head with the target's, which fails
for a draft config with ``tie_word_embeddings = true``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from sglang_rl.drafter import (
    DrafterCheckpointError,
    DrafterConfig,
    DrafterConfigError,
    init_drafter,
    load_drafter,
    load_target_head,
    read_draft_weights,
    save_drafter,
    sglang_weights,
)

H, I, V = 32, 48, 64
LAYER = "layers.0."
LLAMA_NAMES = {
    "fc.weight", "fc.bias",
    *(f"{LAYER}self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"{LAYER}mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    f"{LAYER}post_attention_layernorm.weight",
}
QWEN2_NAMES = LLAMA_NAMES | {f"{LAYER}self_attn.{p}_proj.bias" for p in "qkv"}


def write_target(folder: Path, family: str = "llama", tied: bool = True, **over) -> Path:
    """A tiny target model folder: config.json plus the two tensors the drafter reads (and a
    decoy layer weight)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = {
        "architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM"],
        "model_type": family, "hidden_size": H, "intermediate_size": I, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": V, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024, "hidden_act": "silu", "tie_word_embeddings": tied,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, "dtype": "bfloat16",
        "initializer_range": 0.02,
    }
    if family == "qwen2":
        raw["layer_types"] = ["full_attention"] * 3
        raw["max_window_layers"] = 3
    raw.update(over)
    (folder / "config.json").write_text(json.dumps(raw))
    gen = torch.Generator().manual_seed(0)
    h, v = raw["hidden_size"], raw["vocab_size"]
    tensors = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(I, h, generator=gen).to(torch.bfloat16),
    }
    if not tied:
        tensors["lm_head.weight"] = torch.randn(v, h, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def names_in(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_save_load_round_trip_is_bit_exact(tmp_path: Path, family: str, tied: bool) -> None:
    target = write_target(tmp_path / "target", family, tied)
    model = init_drafter(target, seed=3, init="normal")
    out = save_drafter(model, tmp_path / "draft", dtype="float32")
    loaded = load_drafter(out, target)
    assert set(loaded.state_dict()) == set(model.state_dict())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert names_in(out) == (LLAMA_NAMES if family == "llama" else QWEN2_NAMES)
    head = load_target_head(target)
    assert head.tied == tied and torch.equal(loaded.head_weight, head.lm_head)
    ids, rows = torch.randint(0, V, (9,)), torch.randn(9, H)
    with torch.no_grad():
        assert torch.equal(model(ids, rows), loaded(ids, rows))
    # a bfloat16 checkpoint holds exactly the bfloat16-rounded weights
    out16 = save_drafter(model, tmp_path / "draft16", dtype=torch.bfloat16)
    again = read_draft_weights(out16)
    assert all(again[k].dtype == torch.bfloat16 and torch.equal(again[k], v.to(torch.bfloat16))
               for k, v in model.state_dict().items())
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_config_is_the_targets_as_a_one_layer_untied_eagle_model(tmp_path: Path, family: str) -> None:
    target = write_target(tmp_path / "target", family, tied=True)
    out = save_drafter(init_drafter(target), tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    src = json.loads((target / "config.json").read_text())
    arch = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}[family]
    assert cfg["architectures"] == [arch]
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"  # the target's dtype by default
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "model_type"):
        assert cfg[key] == src[key], key
    if family == "qwen2":
        assert cfg["layer_types"] == ["full_attention"] and cfg["max_window_layers"] == 1
    hf = AutoConfig.from_pretrained(out)
    assert hf.num_hidden_layers == 1 and hf.architectures == [arch]
    assert DrafterConfig.from_dir(out).family == family


def test_default_init_passes_the_target_row_through(tmp_path: Path) -> None:
    target = write_target(tmp_path / "target")
    model = init_drafter(target, seed=0)
    rows = torch.randn(6, H)
    with torch.no_grad():
        assert torch.equal(model(torch.randint(0, V, (6,)), rows), rows)
    normal = init_drafter(target, seed=0, init="normal")
    assert float(normal.layers[0].self_attn.o_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.2)
    assert torch.equal(normal.fc.bias, torch.zeros(H))


def test_sglang_weights_are_the_checkpoint(tmp_path: Path) -> None:
    target = write_target(tmp_path / "target", "qwen2")
    model = init_drafter(target, init="normal")
    pushed = sglang_weights(model, torch.bfloat16)
    out = save_drafter(model, tmp_path / "draft", dtype=torch.bfloat16)
    saved = read_draft_weights(out)
    assert [n for n, _ in pushed] == list(model.state_dict())
    assert {n for n, _ in pushed} == QWEN2_NAMES == names_in(out)
    assert all(torch.equal(t, saved[n]) and t.is_contiguous() for n, t in pushed)
    # copies: later training does not change what was handed out
    with torch.no_grad():
        model.fc.weight.add_(1.0)
    assert torch.equal(dict(pushed)["fc.weight"], saved["fc.weight"])


def test_loads_a_published_style_eagle_folder(tmp_path: Path) -> None:
    """Names prefixed ``model.``, extra embed/input_layernorm weights, pytorch_model.bin."""
    target = write_target(tmp_path / "target", tied=False)
    model = init_drafter(target, init="normal", seed=5)
    folder = tmp_path / "published"
    folder.mkdir()
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(V, H)
    state["layers.0.input_layernorm.weight"] = torch.ones(H)
    torch.save(state, folder / "pytorch_model.bin")
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1)
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = load_drafter(folder, target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    # the target's embedding is used, not the folder's
    assert torch.equal(loaded.embed_tokens, load_target_head(target).embed)
    del state["model.layers.0.mlp.down_proj.weight"]
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(DrafterCheckpointError, match="down_proj"):
        load_drafter(folder, target)


def test_bad_folders_and_configs_are_refused(tmp_path: Path) -> None:
    target = write_target(tmp_path / "target")
    model = init_drafter(target)
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(DrafterCheckpointError, match="pytorch_model.bin"):
        save_drafter(model, clash)
    # weights of an H-wide drafter under a config (and target) of width 2H
    draft = save_drafter(model, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["hidden_size"] = 2 * H
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterCheckpointError, match="shape"):
        load_drafter(draft, write_target(tmp_path / "wide", hidden_size=2 * H))
    # a drafter for one target cannot use another target's head
    with pytest.raises(DrafterConfigError, match="do not match"):
        load_drafter(save_drafter(model, tmp_path / "draft2"), tmp_path / "wide")
    for bad in ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
                {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}},
                {"hidden_act": "gelu"}):
        raw = json.loads((target / "config.json").read_text())
        raw.update(bad)
        with pytest.raises(DrafterConfigError):
            DrafterConfig.from_dict(raw)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sglang_rl.drafter", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_init_writes_a_loadable_deterministic_folder(tmp_path: Path, capsys) -> None:
    from sglang_rl.drafter.cli import main

    target = write_target(tmp_path / "target", "qwen2")
    # the installed command once, as a user runs it; the other folders through its main in-process
    res = run_cli("init", "--model-path", str(target), "--out", str(tmp_path / "a"), "--seed", "1", "--init", "normal")
    assert res.returncode == 0, res.stderr
    assert "Qwen2ForCausalLMEagle" in res.stdout
    for name, seed in (("b", "1"), ("c", "2")):
        assert main(["init", "--model-path", str(target), "--out", str(tmp_path / name), "--seed", seed,
                     "--init", "normal"]) == 0
        assert "Qwen2ForCausalLMEagle" in capsys.readouterr().out
    a, b, c = (read_draft_weights(tmp_path / n) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert a["fc.weight"].dtype == torch.bfloat16
    loaded = load_drafter(tmp_path / "a", target)
    assert torch.equal(loaded.state_dict()["fc.weight"], a["fc.weight"].float())
    assert main(["init", "--model-path", str(target), "--out", str(tmp_path / "d"), "--dtype", "float32"]) == 0
    assert read_draft_weights(tmp_path / "d")["fc.weight"].dtype == torch.float32
    res = run_cli("init", "--model-path", str(tmp_path / "missing"), "--out", str(tmp_path / "e"))
    assert res.returncode == 2 and "error:" in res.stderr and "config.json" in res.stderr


def test_the_drafter_package_does_not_import_sglang() -> None:
    code = "import sys, sglang_rl.drafter; print(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
