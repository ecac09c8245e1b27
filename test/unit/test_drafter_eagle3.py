"""EAGLE3 drafter folders (sglang_rl.drafter.eagle3 and `drafter init --arch eagle3`) on tiny targets.

The layout is what sglang 0.5.17's ``LlamaForCausalLMEagle3`` loads: SpecForge's tensor names
(``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), q/k/v over ``2H`` inputs,
``fc`` over the concatenated aux rows, and a draft vocabulary whose draft id ``i`` is target id
``i + d2t[i]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang_rl.drafter import DrafterConfigError, load_drafter, load_target_head
from sglang_rl.drafter.checkpoint import DrafterCheckpointError
from sglang_rl.drafter.cli import main
from sglang_rl.drafter.eagle3 import draft_vocab, init_eagle3, read_eagle3, save_eagle3
from test_drafter_checkpoint import H, I, V, write_target

LAYERS = 8
M = "midlayer."
NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"{M}{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    *(f"{M}self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"{M}mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


def target(tmp_path: Path, family: str = "llama", tied: bool = True) -> Path:
    folder = write_target(tmp_path / "target", family, tied, num_hidden_layers=LAYERS)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = torch.linspace(0.5, 1.5, H).to(torch.bfloat16)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def hot_ids(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.shape[0]) + d2t


def test_full_vocabulary_is_the_identity_mapping() -> None:
    d2t, t2d = draft_vocab(V)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert torch.equal(d2t, torch.zeros(V, dtype=torch.int64)) and bool(t2d.all())


def test_most_frequent_ids_in_ascending_order_and_the_mapping_round_trips() -> None:
    counts = [0] * V
    for tid, c in {50: 9, 3: 7, 60: 7, 10: 5, 63: 5, 20: 1}.items():
        counts[tid] = c
    d2t, t2d = draft_vocab(V, 4, counts)
    assert hot_ids(d2t).tolist() == [3, 10, 50, 60]  # ties (10 vs 63) keep the lower id
    assert d2t.tolist() == [3, 9, 48, 57]
    assert t2d.nonzero().reshape(-1).tolist() == [3, 10, 50, 60]
    # target -> draft -> target
    draft_of = torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(hot_ids(d2t)[draft_of[t2d]], t2d.nonzero().reshape(-1))
    d2t, t2d = draft_vocab(V, 5)  # no counts: the lowest ids
    assert hot_ids(d2t).tolist() == [0, 1, 2, 3, 4] and int(t2d.sum()) == 5


@pytest.mark.parametrize("size,counts,match", [
    (0, None, r"\[1, 64\]"), (V + 1, None, r"\[1, 64\]"),
    (4, [1.0] * (V - 1), "63 entries"), (4, [-1.0] + [0.0] * (V - 1), "non-negative"),
])
def test_bad_vocabularies_are_refused(size: int, counts, match: str) -> None:
    with pytest.raises(DrafterCheckpointError, match=match):
        draft_vocab(V, size, counts)


@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_folder_layout_and_round_trip(tmp_path: Path, family: str, tied: bool) -> None:
    folder = target(tmp_path, family, tied)
    counts = torch.arange(V, dtype=torch.float64).flip(0) * (torch.arange(V) % 3 == 0)
    cfg, tensors = init_eagle3(folder, 16, counts.tolist(), seed=1)
    out = save_eagle3(tmp_path / "draft", cfg, tensors)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == NAMES
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"] and written["model_type"] == "llama"
    assert written["num_hidden_layers"] == 1 and written["tie_word_embeddings"] is False
    assert written["draft_vocab_size"] == 16 and written["vocab_size"] == V
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, LAYERS // 2 - 1, LAYERS - 4]
    assert written["bias"] is False and written["attention_bias"] is False and written["dtype"] == "bfloat16"
    assert "layer_types" not in written and "max_window_layers" not in written

    cfg2, got = read_eagle3(out)
    assert cfg2 == written
    q, kv = 4 * (H // 4), 2 * (H // 4)
    assert got["fc.weight"].shape == (H, 3 * H)
    assert got[M + "self_attn.q_proj.weight"].shape == (q, 2 * H)
    assert got[M + "self_attn.k_proj.weight"].shape == (kv, 2 * H)
    assert got[M + "mlp.down_proj.weight"].shape == (H, I)
    assert got["lm_head.weight"].shape == (16, H) and got["t2d"].shape == (V,)
    assert got["d2t"].dtype == torch.int64 and got["t2d"].dtype == torch.bool
    assert hot_ids(got["d2t"]).tolist() == list(range(0, 46, 3))  # the 16 most frequent ids
    for name, tensor in tensors.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(got[name], want), name
    # the draft's head is the target's head, restricted to the draft vocabulary
    head = load_target_head(folder).lm_head
    assert torch.equal(got["lm_head.weight"], head[hot_ids(got["d2t"])].to(torch.bfloat16))


def test_passthrough_reads_the_high_aux_row_through_the_targets_final_norm(tmp_path: Path) -> None:
    folder = target(tmp_path)
    _, t = init_eagle3(folder)
    assert torch.equal(t["fc.weight"], torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], dim=1))
    assert not t[M + "self_attn.o_proj.weight"].any() and not t[M + "mlp.down_proj.weight"].any()
    assert t[M + "self_attn.q_proj.weight"].std() > 0
    assert torch.equal(t["norm.weight"], torch.linspace(0.5, 1.5, H).to(torch.bfloat16).float())
    _, n = init_eagle3(folder, init="normal")
    assert n["fc.weight"].std() > 0 and n[M + "mlp.down_proj.weight"].std() > 0
    assert torch.equal(n["norm.weight"], torch.ones(H))


def test_read_refuses_a_broken_mapping_or_a_missing_tensor(tmp_path: Path) -> None:
    cfg, tensors = init_eagle3(target(tmp_path), 8)
    bad = dict(tensors, d2t=tensors["d2t"].clone())
    bad["d2t"][1] = -1  # draft ids 0 and 1 both map to target id 0
    with pytest.raises(DrafterCheckpointError, match="two to one"):
        read_eagle3(save_eagle3(tmp_path / "a", cfg, bad))
    bad = dict(tensors, t2d=tensors["t2d"].clone())
    bad["t2d"][V - 1] = True
    with pytest.raises(DrafterCheckpointError, match="t2d does not mark"):
        read_eagle3(save_eagle3(tmp_path / "b", cfg, bad))
    with pytest.raises(DrafterCheckpointError, match="lacks norm.weight"):
        read_eagle3(save_eagle3(tmp_path / "c", cfg, {k: v for k, v in tensors.items() if k != "norm.weight"}))


def test_loading_an_eagle3_folder_gives_the_eagle3_drafter_and_eagle1_refuses_its_config(tmp_path: Path) -> None:
    from sglang_rl.drafter import DrafterConfig, EagleDrafter
    from sglang_rl.drafter.eagle3_model import Eagle3Drafter

    folder = target(tmp_path)
    out = save_eagle3(tmp_path / "draft", *init_eagle3(folder, 8))
    model = load_drafter(out, folder)
    assert isinstance(model, Eagle3Drafter) and model.draft_vocab_size == 8
    head = load_target_head(folder)
    with pytest.raises(DrafterConfigError, match="EAGLE3 drafter config"):
        EagleDrafter(DrafterConfig.from_dir(out), head)


def test_cli_init_eagle3(tmp_path: Path, capsys) -> None:
    folder = target(tmp_path)
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps([int(i % 7 == 0) for i in range(V)]))
    out = tmp_path / "draft"
    assert main(["init", "--arch", "eagle3", "--model-path", str(folder), "--out", str(out),
                 "--draft-vocab-size", "11", "--token-counts", str(counts), "--dtype", "float32"]) == 0
    assert "draft vocabulary 11" in capsys.readouterr().out
    cfg, got = read_eagle3(out)
    assert cfg["dtype"] == "float32" and got["fc.weight"].dtype == torch.float32
    assert hot_ids(got["d2t"]).tolist() == sorted([*range(0, 64, 7), 1])  # ties: the lower id
    # the default architecture is still EAGLE-1/2
    assert main(["init", "--model-path", str(folder), "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert main(["init", "--model-path", str(folder), "--out", str(tmp_path / "f"), "--draft-vocab-size", "8"]) == 2
    assert "need --arch eagle3" in capsys.readouterr().err
    assert main(["init", "--arch", "eagle3", "--model-path", str(folder), "--out", str(tmp_path / "g"),
                 "--draft-vocab-size", str(V + 1)]) == 2
    assert main(["init", "--arch", "eagle3", "--model-path", str(folder), "--out", str(tmp_path / "h"),
                 "--token-counts", str(tmp_path / "missing.json")]) == 2
