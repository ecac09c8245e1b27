"""Checks of draft-only weight updates, before anything is loaded (sglang_rl.draft_weight_check).

The spec below describes a one-layer EAGLE drafter the way the sglang adapter does for the live
draft model: fused q/k/v (8 query heads, 2 KV heads of size 4, hidden 32) and gate/up (64).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sglang_rl.draft_weight_check import (
    DraftWeightError,
    DraftWeightSpec,
    ParamInfo,
    TensorInfo,
    check_update,
    checkpoint_entries,
    expand_param,
    plan_checkpoint_load,
)

H, Q, KV, I = 32, 32, 8, 64
SHARED = {"embed_tokens.weight": "shared with the target", "lm_head.weight": "shared with the target"}
PARAMS = [
    ParamInfo("fc.weight", (H, 2 * H)),
    ParamInfo("fc.bias", (H,)),
    ParamInfo("layers.0.self_attn.qkv_proj.weight", (Q + 2 * KV, H), (Q, KV, KV), (Q, KV, KV)),
    ParamInfo("layers.0.self_attn.o_proj.weight", (H, Q)),
    ParamInfo("layers.0.mlp.gate_up_proj.weight", (2 * I, H), (I, I), (I, I)),
    ParamInfo("layers.0.mlp.down_proj.weight", (H, I)),
    ParamInfo("layers.0.post_attention_layernorm.weight", (H,)),
    ParamInfo("embed_tokens.weight", (100, H)),
    ParamInfo("lm_head.weight", (100, H)),
]
CHECKPOINT = {
    "fc.weight": (H, 2 * H), "fc.bias": (H,),
    "layers.0.self_attn.q_proj.weight": (Q, H), "layers.0.self_attn.k_proj.weight": (KV, H),
    "layers.0.self_attn.v_proj.weight": (KV, H), "layers.0.self_attn.o_proj.weight": (H, Q),
    "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
    "layers.0.mlp.down_proj.weight": (H, I), "layers.0.post_attention_layernorm.weight": (H,),
}


@pytest.fixture
def spec() -> DraftWeightSpec:
    return DraftWeightSpec.from_params(PARAMS, SHARED)


def infos(shapes: dict) -> list[TensorInfo]:
    return [TensorInfo(name, shape) for name, shape in shapes.items()]


def test_spec_unfuses_stacked_params_and_leaves_out_shared(spec: DraftWeightSpec) -> None:
    assert {n: s.shape for n, s in spec.slots.items()} == CHECKPOINT
    assert spec.slots["layers.0.self_attn.k_proj.weight"].rows == (Q, Q + KV)
    assert spec.slots["layers.0.self_attn.v_proj.weight"].rows == (Q + KV, Q + 2 * KV)
    assert spec.slots["layers.0.mlp.up_proj.weight"].param == "layers.0.mlp.gate_up_proj.weight"
    assert spec.slots["fc.weight"].rows is None


def test_tensor_parallel_rows_use_local_sizes() -> None:
    slots = expand_param(ParamInfo("layers.0.self_attn.qkv_proj.bias", (48,), (32, 8, 8), (16, 4, 4)))
    assert slots["layers.0.self_attn.q_proj.bias"].shape == (32,)
    assert slots["layers.0.self_attn.k_proj.bias"].rows == (16, 20)


def test_full_and_partial_updates_pass(spec: DraftWeightSpec) -> None:
    check_update(spec, infos(CHECKPOINT), require_all=True)
    check_update(spec, infos({"fc.weight": (H, 2 * H)}))


@pytest.mark.parametrize(
    "update, reason",
    [
        ({}, "holds no tensors"),
        ({"embed_tokens.weight": (100, H)}, "shares with the target"),
        ({"lm_head.weight": (100, H)}, "shares with the target"),
        ({"model.fc.weight": (H, 2 * H)}, "does not have: model.fc.weight"),
        ({"layers.0.self_attn.qkv_proj.weight": (48, H)}, "does not have"),
        ({"fc.weight": (2 * H, H)}, r"wrong shapes: fc.weight \[64, 32\] \(expected \[32, 64\]\)"),
        ({"layers.0.self_attn.k_proj.weight": (Q, H)}, "wrong shapes: layers.0.self_attn.k_proj.weight"),
    ],
)
def test_bad_updates_are_refused_with_the_reason(spec: DraftWeightSpec, update: dict, reason: str) -> None:
    with pytest.raises(DraftWeightError, match=reason):
        check_update(spec, infos(update))


def test_every_problem_is_reported_at_once(spec: DraftWeightSpec) -> None:
    update = [TensorInfo("fc.weight", (H, 2 * H)), TensorInfo("fc.weight", (H, 2 * H)),
              TensorInfo("fc.bias", (H,), is_floating=False), TensorInfo("nope", (1,))]
    with pytest.raises(DraftWeightError) as err:
        check_update(spec, update, require_all=True)
    message = str(err.value)
    for part in ("more than once: fc.weight", "does not have: nope", "not floating point: fc.bias",
                 "missing draft weights: layers.0.mlp.down_proj.weight"):
        assert part in message


def save(folder: Path, shapes: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()}, str(folder / "model.safetensors"))
    return folder


def test_checkpoint_plan_skips_shared_and_unknown_names(spec: DraftWeightSpec, tmp_path: Path) -> None:
    folder = save(tmp_path / "d", {**CHECKPOINT, "embed_tokens.weight": (100, H),
                                   "layers.0.input_layernorm.weight": (H,)})
    load, skipped = plan_checkpoint_load(spec, checkpoint_entries(folder))
    assert sorted(e.name for e in load) == sorted(CHECKPOINT)
    assert skipped == ["embed_tokens.weight", "layers.0.input_layernorm.weight"]
    assert {e.dtype for e in load} == {"BF16"}


def test_checkpoint_of_the_target_is_refused(spec: DraftWeightSpec, tmp_path: Path) -> None:
    folder = save(tmp_path / "t", {f"model.{n}": s for n, s in CHECKPOINT.items()})
    with pytest.raises(DraftWeightError, match="missing draft weights.*the folder's other names: model.fc"):
        plan_checkpoint_load(spec, checkpoint_entries(folder))


def test_checkpoint_with_a_wrong_shape_or_a_missing_weight(spec: DraftWeightSpec, tmp_path: Path) -> None:
    wrong = save(tmp_path / "w", {**CHECKPOINT, "fc.bias": (H + 1,)})
    with pytest.raises(DraftWeightError, match=r"fc.bias \[33\]"):
        plan_checkpoint_load(spec, checkpoint_entries(wrong))
    partial = save(tmp_path / "p", {n: s for n, s in CHECKPOINT.items() if n != "fc.weight"})
    with pytest.raises(DraftWeightError, match="missing draft weights: fc.weight"):
        plan_checkpoint_load(spec, checkpoint_entries(partial))
    ints = save(tmp_path / "i", CHECKPOINT, dtype=torch.int32)
    with pytest.raises(DraftWeightError, match="not floating point"):
        plan_checkpoint_load(spec, checkpoint_entries(ints))


def test_unreadable_folders(tmp_path: Path) -> None:
    with pytest.raises(DraftWeightError, match="is not a directory"):
        checkpoint_entries(tmp_path / "absent")
    with pytest.raises(DraftWeightError, match="no \\*.safetensors"):
        checkpoint_entries(tmp_path)
    (tmp_path / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(DraftWeightError, match="not a readable safetensors file"):
        checkpoint_entries(tmp_path)
