"""Widening (sglang_rl.widen) on tiny random Llama models: the wide model and its drafters compute the
small ones' function, checked in float64 against transformers forwards of both; the rotary claim
behind the head mapping; the layouts' exact scalings; the CLI's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_rl.drafter import init_drafter, load_drafter, save_drafter
from sglang_rl.drafter.config import DrafterConfig
from sglang_rl.drafter.eagle3 import init_eagle3, save_eagle3
from sglang_rl.drafter.model import rotary_inv_freq
from sglang_rl.drafter.unroll import unrolled_predictions
from sglang_rl.widen import HeadMap, HiddenLayout, Shape, WidenError, widen_drafter, widen_model
from sglang_rl.widen.cli import drafter_main, main
from sglang_rl.widen.replay import target_features

SMALL = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=96,
             num_hidden_layers=4)
# every dimension wider: 3x hidden (copies: two exact blocks), 3 -> 4 heads per group, head dim x2
WIDE = Shape(hidden_size=288, num_attention_heads=12, num_key_value_heads=3, head_dim=32, intermediate_size=128,
             num_hidden_layers=6)
VOCAB = 97


def tiny_llama(folder: Path, tied: bool = True, seed: int = 0) -> Path:
    """A random Llama folder (float32) with random norm weights, so norm scaling matters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**SMALL, vocab_size=VOCAB, tie_word_embeddings=tied, rms_norm_eps=1e-5,
                      max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("layout,hidden,tied", [("copies", 288, True), ("zeros", 240, True), ("copies", 288, False)])
def test_widened_model_computes_the_small_ones_logits(tmp_path: Path, layout: str, hidden: int, tied: bool) -> None:
    small = tiny_llama(tmp_path / "small", tied=tied)
    wide = widen_model(small, tmp_path / "wide", WIDE.replace(hidden_size=hidden), layout=layout,
                       dtype="float32", shard_bytes=1 << 20, progress=False)
    assert len(list(wide.glob("model-*-of-*.safetensors"))) > 1  # streamed into several shards
    cfg = json.loads((wide / "config.json").read_text())
    assert cfg["sglang_rl_widened"]["layout"] == layout
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    want, got = logits(small, ids), logits(wide, ids)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() < 1e-4  # float32 weights (scales rounded once), float64 forward


def test_rotate_half_pair_i_lands_on_pair_ki_with_the_same_frequency() -> None:
    """Pair i of a d-dim head has inverse frequency theta^(-2i/d); pair 2i of a 2d-dim head
    theta^(-4i/2d): the same number, bit for bit in float32 (both exponents are exact dyadics),
    for SmolLM2's theta (100000), Llama-3's (500000) and the default; a rotation of the embedded
    head is the embedded rotation."""
    small = Shape(576, 9, 3, 64, 1536, 30)
    heads = HeadMap(small, Shape(4096, 32, 8, 128, 14336, 32))
    dims = heads.head_dims()
    assert dims[:3].tolist() == [0, 2, 4] and dims[32:35].tolist() == [64, 66, 68]
    for theta in (10000.0, 100000.0, 500000.0):
        raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_attention_heads": 9,
               "intermediate_size": 1536, "vocab_size": 10, "rope_theta": theta}
        f_small = rotary_inv_freq(DrafterConfig.from_dict(raw))
        f_wide = rotary_inv_freq(DrafterConfig.from_dict({**raw, "head_dim": 128}))
        assert torch.equal(f_wide[::2], f_small)
        pos = torch.tensor([0.0, 1.0, 77.0, 4095.0], dtype=torch.float64)
        x = torch.randn(4, 64, dtype=torch.float64)
        big = torch.zeros(4, 128, dtype=torch.float64)
        big[:, dims] = x
        assert torch.allclose(rotate(big, pos, f_wide.double())[:, dims], rotate(x, pos, f_small.double()))
        assert rotate(big, pos, f_wide.double()).abs()[:, 1::2].max() == 0  # odd pairs stay empty


def rotate(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    ang = pos[:, None] * inv[None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), dim=-1)


def test_query_heads_keep_their_kv_group_and_the_softmax_scale() -> None:
    heads = HeadMap(Shape(576, 9, 3, 64, 1536, 30), Shape(4096, 32, 8, 128, 14336, 32))
    assert heads.q_heads().tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert heads.q_scale**2 * 128**-1 == pytest.approx(64**-1)  # (sqrt2 q).k / sqrt(128) = q.k / 8


def test_copies_carry_the_missing_mass_with_powers_of_two() -> None:
    layout = HiddenLayout.make(576, 4096, "copies")
    *exact, last = layout.copies
    assert all(math.log2(c).is_integer() for c in exact) and len(layout.copies) <= (4096 - 576) // 576
    assert 1 + sum(c * c for c in layout.copies) == pytest.approx(4096 / 576, rel=1e-12)
    assert layout.exact_mass and layout.norm_scale == 1.0 and layout.eps_scale == 1.0
    assert HiddenLayout.make(576, 1152, "copies").copies == (1.0,)
    narrow = HiddenLayout.make(576, 1024, "copies")  # no room for a copy: zeros with scaled norms
    assert narrow.name == "zeros" and narrow.norm_scale == pytest.approx(0.75)


def test_bf16_weights_are_the_small_ones_where_the_scale_is_a_power_of_two(tmp_path: Path) -> None:
    small = tiny_llama(tmp_path / "small")
    wide = widen_model(small, tmp_path / "wide", WIDE, layout="copies", dtype="bfloat16", progress=False)
    s = {n: t.to(torch.bfloat16) for n, t in load_file(str(small / "model.safetensors")).items()}
    w = load_file(str(wide / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    assert torch.equal(emb[:, :96], s["model.embed_tokens.weight"]) and torch.equal(emb[:, 96:192], emb[:, :96])
    norm = w["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm[:96], s["model.layers.0.input_layernorm.weight"]) and norm[96:].abs().max() == 0
    heads = HeadMap(Shape(**SMALL), WIDE)
    k = w["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(k[heads.kv_rows()][:, :96], s["model.layers.0.self_attn.k_proj.weight"])
    q32 = load_file(str(small / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q[heads.q_rows()][:, :96], (q32.double() * math.sqrt(2)).to(torch.bfloat16))  # rounded once
    assert w["model.layers.5.mlp.down_proj.weight"].abs().max() == 0  # an added layer passes through


def test_drafters_widen_to_the_same_drafts(tmp_path: Path) -> None:
    """EAGLE-1/2 and EAGLE3 drafters of the small target, widened: three chained draft steps give
    the same logits (float64) on the wide target's features as on the small one's."""
    small = tiny_llama(tmp_path / "small")
    wide = widen_model(small, tmp_path / "wide", WIDE, dtype="float32", progress=False)
    gen = torch.Generator().manual_seed(3)
    eagle = init_drafter(small, seed=1, init="normal")
    with torch.no_grad():
        for p in eagle.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    save_drafter(eagle, tmp_path / "eagle", "float32")
    cfg, tensors = init_eagle3(small, 40, torch.rand(VOCAB, generator=gen).tolist(), seed=1, init="normal")
    tensors = {n: t + 0.3 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else t
               for n, t in tensors.items()}
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    save_eagle3(tmp_path / "eagle3", cfg, tensors)
    assert drafter_main(["--drafter-path", str(tmp_path / "eagle"), "--model-path", str(wide),
                         "--out", str(tmp_path / "eagle-wide")]) == 0
    assert widen_drafter(tmp_path / "eagle3", wide, tmp_path / "eagle3-wide")[1] == "LlamaForCausalLMEagle3"
    from transformers import AutoModelForCausalLM

    targets = {f: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float64).eval() for f in (small, wide)}
    ids = torch.randint(0, VOCAB, (30,), generator=gen)
    n = ids.numel() - 1
    for name, aux in (("eagle", None), ("eagle3", cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])):
        out = []
        for folder, target in ((tmp_path / name, small), (tmp_path / f"{name}-wide", wide)):
            drafter = load_drafter(folder, target, dtype=torch.float64)
            feats = target_features(targets[target], ids, aux)
            with torch.no_grad():
                preds = unrolled_predictions(drafter, ids[1:], feats[:n], torch.arange(n), torch.tensor([0, n]), 3)
                out.append(torch.stack([drafter.logits(p) for p in preds]))
        scale = out[0].abs().max()
        assert scale > 0.5
        assert (out[1] - out[0]).abs().max() < 1e-5 * scale, name  # float32 weights, float64 forward


def test_the_shape_must_hold_the_small_model() -> None:
    small = Shape(**SMALL)
    for bad, why in ((dict(hidden_size=32), "hidden_size"), (dict(head_dim=24), "multiple"),
                     (dict(num_attention_heads=6, num_key_value_heads=3), "per KV group")):
        with pytest.raises(WidenError, match=why):
            WIDE.replace(**bad).check_holds(small)


def test_cli_refuses_what_it_cannot_build(tmp_path: Path, capsys) -> None:
    assert main(["--shape", "llama-8b"]) == 2
    assert "needs --out" in capsys.readouterr().err
    small = tiny_llama(tmp_path / "small")
    assert main(["--model-path", str(small), "--out", str(tmp_path / "w"), "--hidden-size", "32"]) == 2
    assert "cannot hold" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    assert main(["--model-path", str(small), "--out", str(tmp_path / "taken"), "--num-layers", "5"]) == 2
    assert (tmp_path / "taken" / "notes.txt").exists()
    from safetensors.torch import save_file

    tensors = load_file(str(small / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(small / "model.safetensors"))
    assert main(["--model-path", str(small), "--out", str(tmp_path / "w"), "--num-layers", "5"]) == 2
    assert "up_proj" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small", "taken"]  # a failed build leaves nothing
