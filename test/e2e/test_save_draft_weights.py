"""Saving the served drafter (`POST /save_draft_weights`) on a real CPU server with EAGLE.

The server starts with one random drafter; a draft-only update replaces it with another, so the
drafter being served differs from every folder on disk. The save must write that one: its tensors
equal what was pushed and what the server reads back (`/get_draft_weights_by_name`), the plugin's
loader (`load_drafter`) reads the folder as the same drafter, and the server's own draft model
takes it back through its weight loader (`/update_draft_weights_from_disk`, which loads by the
checkpoint names sglang's EAGLE loader reads at start). Bad requests get a 400 with the reason,
nothing is left half-written, and the server keeps answering; a server without a draft refuses.
`Engine.save_draft_weights` is checked by test_draft_weight_update's Engine (`test_engine_methods`).
"""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from e2e_servers import POOL, Server, ServerHandle, server_fixture
from sglang_rl.drafter import init_drafter, load_drafter, sglang_weights
from sglang_rl.drafter.saved_folder import METADATA_FILE, read_save_metadata
from test_draft_weight_update import EAGLE as DRAFT_WEIGHTS

TIMEOUT = 300

# the server of test_draft_weight_update (same flags; the suite starts it once): its tests put its
# weights back, and the start-up drafter's folder is the one a save is compared with
eagle = server_fixture(DRAFT_WEIGHTS, scope="module", doc="EAGLE with test_draft_weight_update's start-up drafter.")


@pytest.fixture(scope="module")
def start_dir() -> Path:
    return POOL.prepared_data(DRAFT_WEIGHTS.key)["folders"]["start"]


@pytest.fixture(scope="module")
def saved_dirs() -> dict:
    """Folders the tests save to, for the later tests that read them."""
    return {}


@pytest.fixture(scope="module")
def pushed(model_path: str) -> dict[str, torch.Tensor]:
    """Another drafter (seed 1, and a bias, which the init leaves at zero): what the draft-only
    update makes the server serve."""
    weights = dict(sglang_weights(init_drafter(model_path, seed=1, init="normal")))
    weights["fc.bias"] = torch.randn(weights["fc.bias"].shape, generator=torch.Generator().manual_seed(1))
    return weights


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT)


def save(url: str, body: dict) -> requests.Response:
    return post(url, "/save_draft_weights", body)


def draft_rows(url: str, name: str, rows: int) -> torch.Tensor:
    r = post(url, "/get_draft_weights_by_name", {"name": name, "truncate_size": rows})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def assert_refused(r: requests.Response, reason: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and reason in body["message"], body


def assert_serves(url: str) -> None:
    r = post(url, "/generate", {"text": "hello hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text


def test_save_writes_the_served_drafter(eagle: ServerHandle, start_dir: Path, pushed: dict, model_path: str,
                                        tmp_path: Path, saved_dirs: dict) -> None:
    url = eagle.url
    body = {"serialized_named_tensors": [base64.b64encode(pickle.dumps(list(pushed.items()))).decode()]}
    r = post(url, "/update_draft_weights_from_tensor", body)
    assert r.status_code == 200 and r.json()["success"], r.text
    start = load_file(str(start_dir / "model.safetensors"))
    assert not any(torch.equal(start[n], pushed[n]) for n in ("fc.weight", "fc.bias")), "the same drafter"

    r = save(url, {"path": str(tmp_path / "saved")})
    assert r.status_code == 200, r.text
    saved = r.json()["saved"]
    folder = Path(saved["path"])
    assert folder == tmp_path / "saved" and saved["tensors"] == len(pushed)
    assert saved["round"] is None and saved["policy_version"] is None  # no --drafter-cotrain
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", "model.safetensors", METADATA_FILE])

    # the tensors are the pushed ones, which the server reads back too
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors.keys() == pushed.keys()
    assert all(torch.equal(tensors[n], pushed[n]) for n in pushed)
    assert torch.equal(draft_rows(url, "fc.bias", 10**6), tensors["fc.bias"])
    for name in ("layers.0.self_attn.k_proj.weight", "layers.0.mlp.up_proj.weight", "fc.weight"):
        assert torch.equal(draft_rows(url, name, 2), tensors[name][:2]), name

    # config.json: the start folder's, with the served dtype; metadata names the version and source
    config, start_config = (json.loads((d / "config.json").read_text()) for d in (folder, start_dir))
    assert config == start_config and config["architectures"] == ["LlamaForCausalLMEagle"]
    meta = read_save_metadata(folder)
    assert meta["source"] == str(start_dir) and meta["dtype"] == "float32" and meta["round"] is None

    # the plugin's loader reads it as the pushed drafter
    loaded = load_drafter(folder, model_path)
    assert all(torch.equal(t, pushed[n]) for n, t in loaded.state_dict().items())

    # and the server's draft model loads it back, every name taken, after going back to the start
    for source in (start_dir, folder):
        r = post(url, "/update_draft_weights_from_disk", {"model_path": str(source)})
        assert r.status_code == 200 and f"loaded {len(pushed)} draft tensors" in r.json()["message"], r.text
        assert "skipped" not in r.json()["message"]
    assert torch.equal(draft_rows(url, "fc.bias", 10**6), pushed["fc.bias"])
    assert_serves(url)
    saved_dirs["http"] = folder


def test_refusals_leave_nothing_and_the_server_keeps_serving(eagle: ServerHandle, tmp_path: Path) -> None:
    url = eagle.url
    assert_refused(save(url, {}), "path must be a non-empty string")
    assert_refused(save(url, {"path": 7}), "got 7")
    assert_refused(save(url, {"path": str(tmp_path / "x"), "overwrite": "yes"}), "overwrite must be true or false")
    r = requests.post(url + "/save_draft_weights", data="not json", timeout=TIMEOUT)
    assert_refused(r, "the body must be JSON")
    (tmp_path / "file").write_text("x")
    assert_refused(save(url, {"path": str(tmp_path / "file")}), "exists and is not a folder")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert_refused(save(url, {"path": str(other), "overwrite": True}), "not empty and not a drafter folder")
    assert (other / "notes.txt").read_text() == "keep me"
    assert_refused(save(url, {"path": "/sys/sglang-rl-save-test"}), "cannot write to")
    assert_serves(url)

    # a previous save is replaced only with overwrite
    again = tmp_path / "again"
    assert save(url, {"path": str(again)}).status_code == 200
    first = read_save_metadata(again)["saved_at"]
    assert_refused(save(url, {"path": str(again)}), "holds a previous save")
    assert read_save_metadata(again)["saved_at"] == first
    r = save(url, {"path": str(again), "overwrite": True})
    assert r.status_code == 200, r.text
    assert read_save_metadata(again)["saved_at"] > first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "file", "other"]  # no temporary folders
    assert_serves(url)


def test_server_without_a_draft_refuses(plain_server: Server, tmp_path: Path) -> None:
    assert_refused(save(plain_server.url, {"path": str(tmp_path / "d")}), "this server has no draft model")
    assert not (tmp_path / "d").exists()
    assert_serves(plain_server.url)
