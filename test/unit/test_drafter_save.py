"""Saving the served drafter (sglang_rl.drafter.saved_folder and adapters/drafter_save): request
parsing, which destinations are refused, the folder layout and metadata, atomic writes, and the
scheduler handler on a stand-in scheduler (the real server is covered by
test/e2e/test_save_draft_weights.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from sglang_rl.drafter import init_drafter, load_drafter, save_drafter, sglang_weights
from sglang_rl.drafter.saved_folder import (
    METADATA_FILE,
    DraftSaveError,
    check_destination,
    is_previous_save,
    parse_save_request,
    read_save_metadata,
    write_drafter_folder,
)
from test_drafter_checkpoint import write_target


@pytest.fixture()
def drafter(tmp_path: Path):
    """A tiny target and a drafter for it: (target folder, model, its config.json content)."""
    target = write_target(tmp_path / "target")
    model = init_drafter(target, seed=3, init="normal")
    return target, model, model.config.with_dtype("float32").to_json_dict()


def leftovers(parent: Path) -> list[str]:
    """Temporary folders a save left beside its destination."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# --- request ---------------------------------------------------------------------------------


def test_parse_save_request_takes_a_path_and_overwrite(tmp_path: Path, monkeypatch) -> None:
    assert parse_save_request({"path": str(tmp_path / "d")}) == (str(tmp_path / "d"), False)
    assert parse_save_request({"path": str(tmp_path), "overwrite": True}) == (str(tmp_path), True)
    monkeypatch.chdir(tmp_path)
    assert parse_save_request({"path": "rel/d"}) == (str(tmp_path / "rel" / "d"), False)


@pytest.mark.parametrize("body,reason", [
    ({}, "path must be a non-empty string"),
    ({"path": None}, "got nothing"),
    ({"path": 5}, "got 5"),
    ({"path": "  "}, "non-empty string"),
    ({"path": ["/tmp/x"]}, "non-empty string"),
    ({"path": "/tmp/x", "overwrite": "yes"}, "overwrite must be true or false"),
    ({"path": "/tmp/x", "overwrit": True}, "unknown fields ['overwrit']"),
    ([1, 2], "must be a JSON object"),
    ("/tmp/x", "must be a JSON object"),
])
def test_parse_save_request_refuses_bad_bodies(body, reason: str) -> None:
    with pytest.raises(DraftSaveError) as err:
        parse_save_request(body)
    assert reason in str(err.value)


# --- destinations ----------------------------------------------------------------------------


def test_check_destination(tmp_path: Path, drafter) -> None:
    _, model, _ = drafter
    assert check_destination(tmp_path / "new" / "deeper", overwrite=False) is False
    (tmp_path / "empty").mkdir()
    assert check_destination(tmp_path / "empty", overwrite=False) is False
    (tmp_path / "file").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(DraftSaveError, match="exists and is not a folder"):
            check_destination(tmp_path / "file", overwrite)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    for overwrite in (False, True):  # never deleted, even when asked to overwrite
        with pytest.raises(DraftSaveError, match="not empty and not a drafter folder"):
            check_destination(other, overwrite)
    init_dir = save_drafter(model, tmp_path / "init")  # `sglang-rl drafter init`'s layout
    with pytest.raises(DraftSaveError, match='holds a drafter folder; pass "overwrite": true'):
        check_destination(init_dir, overwrite=False)
    assert check_destination(init_dir, overwrite=True) is True
    with pytest.raises(DraftSaveError, match="must be absolute"):
        check_destination("relative/path", overwrite=False)


# --- writing ---------------------------------------------------------------------------------


def test_write_drafter_folder_layout_and_metadata(tmp_path: Path, drafter) -> None:
    target, model, config = drafter
    tensors = dict(sglang_weights(model))
    dest = tmp_path / "saves" / "round-3"
    out = write_drafter_folder(dest, config, tensors, {"policy_version": 2, "round": 3})
    assert out == dest
    assert sorted(p.name for p in dest.iterdir()) == sorted(["config.json", "model.safetensors", METADATA_FILE])
    assert oct(dest.stat().st_mode & 0o777) == oct(0o755)
    meta = read_save_metadata(dest)
    assert meta["policy_version"] == 2 and meta["round"] == 3 and meta["saved_at"] > 0
    assert is_previous_save(dest) and not is_previous_save(tmp_path)
    saved = load_file(str(dest / "model.safetensors"))
    assert saved.keys() == tensors.keys() and all(torch.equal(saved[n], tensors[n]) for n in tensors)
    # the plugin's loader reads it back as the same drafter
    loaded = load_drafter(dest, target)
    assert all(torch.equal(t, tensors[n]) for n, t in loaded.state_dict().items())
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert leftovers(dest.parent) == []


def test_overwrite_replaces_a_previous_save_only_when_asked(tmp_path: Path, drafter) -> None:
    _, model, config = drafter
    dest = tmp_path / "save"
    first = dict(sglang_weights(model))
    write_drafter_folder(dest, config, first, {"round": 1})
    second = {n: t + 1 for n, t in first.items()}
    with pytest.raises(DraftSaveError, match="holds a previous save"):
        write_drafter_folder(dest, config, second, {"round": 2})
    assert read_save_metadata(dest)["round"] == 1
    write_drafter_folder(dest, config, second, {"round": 2}, overwrite=True)
    assert read_save_metadata(dest)["round"] == 2
    assert torch.equal(load_file(str(dest / "model.safetensors"))["fc.bias"], second["fc.bias"])
    assert leftovers(tmp_path) == []


def test_a_failed_write_leaves_nothing(tmp_path: Path, drafter, monkeypatch) -> None:
    from sglang_rl.drafter import saved_folder

    _, model, config = drafter
    tensors = dict(sglang_weights(model))
    write_drafter_folder(tmp_path / "kept", config, tensors, {"round": 1})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saved_folder, "save_file", disk_full)
    with pytest.raises(DraftSaveError, match="No space left on device"):
        write_drafter_folder(tmp_path / "new", config, tensors, {"round": 2})
    assert not (tmp_path / "new").exists()
    with pytest.raises(DraftSaveError, match="No space left on device"):
        write_drafter_folder(tmp_path / "kept", config, tensors, {"round": 2}, overwrite=True)
    assert read_save_metadata(tmp_path / "kept")["round"] == 1  # the previous save is untouched
    assert leftovers(tmp_path) == []
    with pytest.raises(DraftSaveError, match="no draft tensors"):
        write_drafter_folder(tmp_path / "none", config, {}, {})


def test_an_unwritable_path_is_refused(tmp_path: Path, drafter) -> None:
    _, model, config = drafter
    tensors = dict(sglang_weights(model))
    (tmp_path / "file").write_text("x")
    with pytest.raises(DraftSaveError, match="cannot write to"):
        write_drafter_folder(tmp_path / "file" / "below", config, tensors, {})
    readonly = tmp_path / "ro"
    readonly.mkdir()
    os.chmod(readonly, 0o555)
    try:
        if os.access(readonly, os.W_OK):  # root ignores the mode; sysfs refuses everyone
            readonly = Path("/sys/sglang-rl-save-test")
        with pytest.raises(DraftSaveError, match="cannot write to"):
            write_drafter_folder(readonly / "d", config, tensors, {})
    finally:
        os.chmod(tmp_path / "ro", 0o755)


# --- the scheduler handler -------------------------------------------------------------------


class FakeRuntime:
    """What the save reads of a co-training runtime."""

    def __init__(self) -> None:
        self.policy_version, self.rounds, self.saved, self.polled = 4, [{"policy_version": 3}] * 2, None, 0

    @property
    def draft_round(self) -> int:
        return len(self.rounds)

    def poll(self, scheduler) -> None:
        self.polled += 1


def fake_eagle(drafter_dir: Path, model) -> tuple[SimpleNamespace, tuple]:
    """A stand-in EAGLE worker whose draft holds ``model``'s tensors as sglang does: q/k/v and
    gate/up fused into one parameter each, names without ``model.``."""
    from sglang_rl.draft_weight_check import DraftWeightSpec, ParamInfo

    weights = dict(sglang_weights(model))
    params, infos = {}, []
    for fused, pieces in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                          ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
        group = fused.split(".")[0]
        parts = [weights.pop(f"layers.0.{group}.{p}.weight") for p in pieces]
        name = f"layers.0.{fused}.weight"
        params[name] = torch.nn.Parameter(torch.cat(parts))
        sizes = tuple(p.shape[0] for p in parts)
        infos.append(ParamInfo(name, tuple(params[name].shape), sizes, sizes))
    for name, tensor in weights.items():
        params[name] = torch.nn.Parameter(tensor.clone())
        infos.append(ParamInfo(name, tuple(tensor.shape)))
    params["embed_tokens.weight"] = torch.nn.Parameter(torch.zeros(2, 2))
    spec = DraftWeightSpec.from_params(infos, {"embed_tokens.weight": "the target's"})
    runner = SimpleNamespace(model_config=SimpleNamespace(model_path=str(drafter_dir)))
    return SimpleNamespace(draft_runner=runner), (spec, params)


def test_handler_saves_the_served_draft_and_records_the_version(tmp_path: Path, drafter, monkeypatch) -> None:
    from sglang_rl.adapters import cotrain, drafter_save

    target, model, _ = drafter
    source = save_drafter(model, tmp_path / "source", dtype="bfloat16")
    eagle, spec_params = fake_eagle(source, model)
    monkeypatch.setattr(drafter_save, "find_eagle_draft", lambda worker: (eagle, ""))
    monkeypatch.setattr(drafter_save, "draft_spec", lambda e: spec_params)
    runtime = FakeRuntime()
    scheduler = SimpleNamespace(draft_worker=object(), server_args=SimpleNamespace(tp_size=1, dp_size=1))
    setattr(scheduler, cotrain.ATTR, runtime)
    req = drafter_save.SaveDraftWeightsReqInput(name=drafter_save.SAVE_NAME, path=str(tmp_path / "out"))
    reply = drafter_save.save_request(scheduler, req).parameter
    assert reply["success"], reply
    saved = reply["saved"]
    assert saved["path"] == str(tmp_path / "out") and saved["round"] == 2 and saved["policy_version"] == 4
    assert runtime.saved == saved and runtime.polled == 1
    meta = read_save_metadata(tmp_path / "out")
    assert meta["round_policy_version"] == 3 and meta["source"] == str(source) and meta["dtype"] == "float32"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32"  # the served tensors' dtype
    loaded = load_drafter(tmp_path / "out", target)
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in loaded.state_dict().items())
    assert "co-training round 2, policy version 4" in drafter_save.saved_message(saved)
    # the same path again: refused with the reason, as a 400
    again = drafter_save.save_request(scheduler, req).parameter
    assert again["status"] == 400 and "holds a previous save" in again["message"]


def test_handler_refusals(tmp_path: Path, monkeypatch) -> None:
    from sglang_rl.adapters import drafter_save

    req = drafter_save.SaveDraftWeightsReqInput(name=drafter_save.SAVE_NAME, path=str(tmp_path / "out"))
    reply = drafter_save.save_request(SimpleNamespace(draft_worker=None), req).parameter
    assert reply["status"] == 400 and "this server has no draft model" in reply["message"]
    monkeypatch.setattr(drafter_save, "find_eagle_draft", lambda worker: (object(), ""))
    sharded = SimpleNamespace(draft_worker=object(), server_args=SimpleNamespace(tp_size=2, dp_size=1))
    reply = drafter_save.save_request(sharded, req).parameter
    assert reply["status"] == 400 and "--tp-size 2" in reply["message"]
    assert not (tmp_path / "out").exists()
