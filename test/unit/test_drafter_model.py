"""The drafter's forward (sglang_rl.drafter.model) against independent references.

sglang's own ``LlamaForCausalLMEagle`` cannot run without a server, so the reference is the
structure it is built from: a transformers ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer`` with
the same weights and its ``input_layernorm`` replaced by the identity (sglang's EAGLE layer 0
drops it), fed ``fc(cat(embed(token), row))``, with the layer output returned as-is (sglang's
draft model returns ``hidden + residual`` and has no final norm). Packed batches are checked
against per-sequence forwards.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from sglang_rl.drafter import DrafterConfig, EagleDrafter, TargetHead, greedy_draft_chain, sample_from_rows
from sglang_rl.drafter.model import apply_rotary
from sglang_rl.drafter import build_eagle_batch

H, V = 32, 97


def raw_config(family: str = "llama", **over) -> dict:
    """A tiny Llama or Qwen2 target config.json dict (4 query heads, 2 KV heads of 8)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    raw = {
        "architectures": [arch], "model_type": family, "hidden_size": H, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "float32",
    }
    raw.update(over)
    return raw


def make_drafter(raw: dict, seed: int = 0) -> EagleDrafter:
    """A drafter with random weights everywhere (norm weights and biases too)."""
    gen = torch.Generator().manual_seed(seed)
    head = TargetHead(embed=torch.randn(V, H, generator=gen), lm_head=torch.randn(V, H, generator=gen))
    model = EagleDrafter(DrafterConfig.from_dict(raw), head)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for layer in model.layers:
            layer.post_attention_layernorm.weight.copy_(1.0 + 0.1 * torch.randn(H, generator=gen))
    return model


def reference_layer(model: EagleDrafter, raw: dict):
    """transformers' decoder layer with the drafter's weights and no input_layernorm."""
    family = model.config.family
    cfg_cls, layer_cls, rope_cls = (
        (LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding) if family == "llama"
        else (Qwen2Config, Qwen2DecoderLayer, Qwen2RotaryEmbedding)
    )
    hf_raw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dtype")}
    config = cfg_cls(**hf_raw, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    layer = layer_cls(config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    missing, unexpected = layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in model.state_dict().items() if k.startswith("layers.0.")},
        strict=False,
    )
    assert not unexpected and all("input_layernorm" in k for k in missing), (missing, unexpected)
    return layer.eval(), rope_cls(config)


def reference_forward(model: EagleDrafter, raw: dict, ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor):
    layer, rope = reference_layer(model, raw)
    with torch.no_grad():
        x = model.fc(torch.cat((model.embed_tokens[ids], rows), dim=-1))[None]
        cos_sin = rope(x, positions[None])
        return layer(x, position_ids=positions[None], position_embeddings=cos_sin)[0]


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("attention_bias", [False, True])
def test_llama_forward_matches_transformers_layer(rope: str, attention_bias: bool) -> None:
    raw = raw_config(rope_parameters=ROPES[rope], attention_bias=attention_bias)
    model = make_drafter(raw)
    names = set(model.state_dict())
    assert ("layers.0.self_attn.o_proj.bias" in names) == attention_bias
    gen = torch.Generator().manual_seed(1)
    n = 40
    ids = torch.randint(0, V, (n,), generator=gen)
    rows = torch.randn(n, H, generator=gen)
    positions = torch.arange(150, 150 + n)  # past original_max_position_embeddings for llama3
    with torch.no_grad():
        ours = model(ids, rows, positions)
    ref = reference_forward(model, raw, ids, rows, positions)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_qwen2_forward_matches_transformers_layer() -> None:
    raw = raw_config("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    model = make_drafter(raw)
    names = set(model.state_dict())
    assert {f"layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    assert "layers.0.self_attn.o_proj.bias" not in names
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (25,), generator=gen)
    rows = torch.randn(25, H, generator=gen)
    positions = torch.arange(25)
    with torch.no_grad():
        ours = model(ids, rows, positions)
    torch.testing.assert_close(ours, reference_forward(model, raw, ids, rows, positions), rtol=1e-5, atol=1e-5)


def test_partial_rotary_rotates_only_the_leading_dims() -> None:
    """sglang rotates ``head_dim * partial_rotary_factor`` leading dims (neox halves within
    them) and passes the rest through; transformers' Llama layer has no partial rotary to
    compare with, so the rotation is compared with the full-width one on the leading slice."""
    raw = raw_config(partial_rotary_factor=0.5)
    model = make_drafter(raw)
    assert model.config.rotary_dim == 4 and model.config.head_dim == 8
    cos, sin = model.rotary(torch.arange(5, 11))
    assert cos.shape == (6, 2)
    x = torch.randn(6, 4, 8)
    out = apply_rotary(x, cos, sin, 4)
    assert torch.equal(out[..., 4:], x[..., 4:])
    x1, x2 = x[..., :2], x[..., 2:4]
    c, s_ = cos[:, None], sin[:, None]
    torch.testing.assert_close(out[..., :4], torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), -1))
    assert not torch.allclose(out[..., :4], x[..., :4])


def test_concat_order_is_embedding_then_row() -> None:
    """With the layer's residual branches silenced the output is fc's output, so an fc that
    keeps only the first (or only the second) half shows which half holds what."""
    model = make_drafter(raw_config())
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
        model.fc.bias.zero_()
        model.fc.weight.zero_()
        model.fc.weight[:, :H] = torch.eye(H)
    ids = torch.tensor([5, 17, 3])
    rows = torch.randn(3, H)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, rows), model.embed_tokens[ids], rtol=0, atol=0)
        model.fc.weight.zero_()
        model.fc.weight[:, H:] = torch.eye(H)
        torch.testing.assert_close(model(ids, rows), rows, rtol=0, atol=0)


def test_forward_is_causal() -> None:
    model = make_drafter(raw_config())
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (10,), generator=gen)
    rows = torch.randn(10, H, generator=gen)
    changed = rows.clone()
    changed[7:] += 1.0
    with torch.no_grad():
        a, b = model(ids, rows), model(ids, changed)
    assert torch.equal(a[:7], b[:7])
    assert not torch.allclose(a[7:], b[7:])


def test_packed_batch_equals_per_sequence_forward() -> None:
    model = make_drafter(raw_config())
    gen = torch.Generator().manual_seed(5)
    lengths = [6, 1, 11, 4]
    seqs = [(torch.randint(0, V, (n,), generator=gen), torch.randn(n, H, generator=gen)) for n in lengths]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs]), cu_seqlens=cu)
        single = torch.cat([model(i, r) for i, r in seqs])
    torch.testing.assert_close(packed, single, rtol=1e-5, atol=1e-5)
    # no sequence sees another: changing the third leaves the others bit-identical
    seqs[2] = (seqs[2][0], seqs[2][1] + 3.0)
    with torch.no_grad():
        packed2 = model(torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs]), cu_seqlens=cu)
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[7:18] = False
    assert torch.equal(packed[keep], packed2[keep])


def test_build_eagle_batch_forward_equals_per_sample_pairs() -> None:
    """The verl packing path: each sample's pairs, forwarded alone, equal their packed slice."""
    model = make_drafter(raw_config())
    gen = torch.Generator().manual_seed(6)
    samples = []
    for n, start in ((9, 4), (14, 10), (5, 1)):
        samples.append(sample_from_rows(torch.randint(0, V, (n,), generator=gen), torch.randn(n, H, generator=gen), start))
    batch = build_eagle_batch(samples, window=8)
    with torch.no_grad():
        packed = model.forward_batch(batch)
        parts = []
        for s in samples:
            one = build_eagle_batch([s], window=8)
            parts.append(model(one["input_ids"], one["hidden_states"]))
    torch.testing.assert_close(packed, torch.cat(parts), rtol=1e-5, atol=1e-5)
    assert packed.shape == (int(batch["cu_seqlens"][-1]), H)


def test_bfloat16_forward_runs_in_bfloat16() -> None:
    torch.manual_seed(0)  # bf16 rounding of a random draw can exceed any fixed bound now and then
    model = make_drafter(raw_config())
    ref_model = copy.deepcopy(model)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, V, (8,))
    rows = torch.randn(8, H)
    with torch.no_grad():
        out = model(ids, rows)
        ref = ref_model(ids, rows)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)


def test_bad_inputs_are_refused() -> None:
    model = make_drafter(raw_config())
    with pytest.raises(ValueError, match="hidden_states"):
        model(torch.zeros(4, dtype=torch.long), torch.zeros(3, H))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.zeros(4, dtype=torch.long), torch.zeros(4, H), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.zeros(4, dtype=torch.long), torch.zeros(4, H), position_ids=torch.arange(3))


def incremental_reference_chain(model: EagleDrafter, raw: dict, ids: torch.Tensor, rows: torch.Tensor, k: int) -> list[int]:
    """sglang's topk=1 drafting replayed with transformers' layer and a KV cache: one extend
    over the committed pairs (positions 0..m-1), then single-position decode steps at m, m+1,
    ... fed the previous step's output row and argmax token."""
    from transformers.cache_utils import DynamicCache

    layer, rope = reference_layer(model, raw)
    cache = DynamicCache()
    m = rows.shape[0]
    head = model.head_weight
    with torch.no_grad():
        x = model.fc(torch.cat((model.embed_tokens[ids[1:]], rows), dim=-1))[None]
        pos = torch.arange(m)[None]
        g = layer(x, position_ids=pos, position_embeddings=rope(x, pos), past_key_values=cache, use_cache=True)[0, -1]
        tokens = [int((head @ g).argmax())]
        for i in range(k - 1):
            x = model.fc(torch.cat((model.embed_tokens[tokens[-1]], g)))[None, None]
            pos = torch.tensor([[m + i]])
            g = layer(x, position_ids=pos, position_embeddings=rope(x, pos), past_key_values=cache, use_cache=True)[0, -1]
            tokens.append(int((head @ g).argmax()))
    return tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_chain_matches_kv_cached_reference(seed: int) -> None:
    raw = raw_config()
    model = make_drafter(raw, seed=seed)
    gen = torch.Generator().manual_seed(10 + seed)
    ids = torch.randint(0, V, (13,), generator=gen)
    rows = torch.randn(12, H, generator=gen)
    chain = greedy_draft_chain(model, ids, rows, 5)
    assert chain.tokens.tolist() == incremental_reference_chain(model, raw, ids, rows, 5)
    assert chain.rows.shape == (5, H)
    # the first token is the teacher-forced forward's prediction at the last committed pair
    with torch.no_grad():
        last = model(ids[1:], rows)[-1]
    torch.testing.assert_close(chain.rows[0], last)
    assert int(chain.tokens[0]) == int(model.logits(last).argmax())
    # a shorter chain is a prefix of a longer one
    assert greedy_draft_chain(model, ids, rows, 2).tokens.tolist() == chain.tokens[:2].tolist()


def test_greedy_chain_refuses_bad_inputs() -> None:
    model = make_drafter(raw_config())
    with pytest.raises(ValueError, match="target rows"):
        greedy_draft_chain(model, torch.arange(5), torch.zeros(5, H), 3)
    with pytest.raises(ValueError, match="two committed tokens"):
        greedy_draft_chain(model, torch.arange(1), torch.zeros(0, H), 3)
    with pytest.raises(ValueError, match="num_steps"):
        greedy_draft_chain(model, torch.arange(3), torch.zeros(2, H), 0)
