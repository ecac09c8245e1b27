"""Saving the served drafter (`POST /save_draft_weights`) on a real CPU server with EAGLE.

The server starts with one random drafter; a draft-only update replaces it with another, so the
drafter being served differs from every folder on disk. The save must write that one: its tensors
equal what was pushed and what the server reads back (`/get_draft_weights_by_name`), the plugin's
loader (`load_drafter`) reads the folder as the same drafter, and the server's own draft model
takes it back through its weight loader (`/update_draft_weights_from_disk`, which loads by the
checkpoint names sglang's EAGLE loader reads at start). Bad requests get a 400 with the reason,
nothing is left half-written, and the server keeps answering; a server without a draft refuses.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from e2e_servers import EAGER, POOL, Server, ServerHandle, e2e_env, server_fixture
from sglang_rl.drafter import init_drafter, load_drafter, sglang_weights
from sglang_rl.drafter.saved_folder import METADATA_FILE, read_save_metadata
from test_draft_weight_update import EAGLE as DRAFT_WEIGHTS
from test_draft_weight_update import K

TIMEOUT = 300

ENGINE_SCRIPT = textwrap.dedent('''
    import json
    import sys


    def main(engine_kwargs, out_dir):
        import sglang

        engine = sglang.Engine(**json.loads(engine_kwargs))
        result = {}
        try:
            result["bias"] = engine.get_draft_weights_by_name("fc.bias", truncate_size=10**6)
            result["saved"] = engine.save_draft_weights(out_dir)
            try:
                engine.save_draft_weights(out_dir)
            except ValueError as exc:
                result["refused"] = str(exc)
        finally:
            print("RESULT " + json.dumps(result), flush=True)
            engine.shutdown()


    if __name__ == "__main__":
        main(*sys.argv[1:])
''')


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


def test_engine_starts_from_a_save_and_saves(saved_dirs: dict, pushed: dict, model_path: str, tmp_path: Path) -> None:
    """sglang loads the saved folder as its EAGLE draft at start (an sgl.Engine in a subprocess,
    the plugin patches sglang process-wide), and Engine.save_draft_weights writes it out again."""
    if "http" not in saved_dirs:
        pytest.skip("needs the folder test_save_writes_the_served_drafter saves")
    script = tmp_path / "engine_script.py"
    script.write_text(ENGINE_SCRIPT)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **e2e_env(EAGER)}
    engine_kwargs = {"model_path": model_path, "device": "cpu", "attention_backend": "torch_native",
                     "dtype": "float32", "max_total_tokens": 4096, "log_level": "warning",
                     "speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(saved_dirs["http"]),
                     "speculative_num_steps": K, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": K + 1}
    run = subprocess.run([sys.executable, str(script), json.dumps(engine_kwargs), str(tmp_path / "out")], env=env,
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, (run.stdout + run.stderr)[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert torch.equal(torch.tensor(result["bias"]), pushed["fc.bias"])  # sglang's own loader read the save
    assert result["saved"]["path"] == str(tmp_path / "out") and result["saved"]["tensors"] == len(pushed)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(tensors[n], pushed[n]) for n in pushed)
    assert "holds a previous save" in result["refused"]
