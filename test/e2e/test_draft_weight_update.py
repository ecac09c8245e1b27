"""Draft-only weight updates on a real CPU server with EAGLE (SmolLM2 target, one-layer drafter).

The drafters here are built to propose one fixed token T at every draft step: ``fc.weight = 0``,
``fc.bias = v``, attention and MLP outputs zeroed, so the draft's output is v and its proposal is
argmax(E v) with E the (shared, tied) embedding; ``v = (E^T E)^-1 E[T]`` makes that T. With
--speculative-eagle-topk 1 and K draft steps, a verify step then accepts the leading run of T's in
the target's next tokens (at most K), so the number of accepted drafts of a greedy request follows
from its output ids alone (`expected_accepted`). That makes what the draft is observable from
outside: a draft update is live when the accepted count follows the new token, and the draft is
intact after a target update when the count still follows the old one.

Contract checked: only the draft changes (target weights read back unchanged; greedy ids always
the same, logprobs bit-identical whenever the drafter is back to the reference one, see
`assert_target_output`); a request in flight during draft updates finishes (no abort) with the
target's output; sglang's target updates (tensor with target names, as verl sends every step,
``load_format="direct"``, and from disk) never touch the draft, in either order, and a target
update of the shared embedding reaches the draft; bad names, shapes, formats, folders, and a
server without a draft get a 400 with the reason, nothing is half-applied, the server keeps serving;
the same calls on an sgl.Engine (subprocess).

CPU tensors go over HTTP as ``pickle.dumps`` (base64): sglang's MultiprocessingSerializer shares
CPU storage through a file-descriptor server that only the sender's own child processes may use.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Iterator

import pytest
import requests
import torch
import torch.multiprocessing  # noqa: F401 - registers the tensor reductions ForkingPickler uses
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from e2e_servers import EAGER, POOL, Prepared, Server, ServerHandle, Spec, e2e_env, server_fixture
from sglang_rl.drafter import EagleDrafter, init_drafter, save_drafter, sglang_weights

K = 3  # draft steps per verify (topk 1: a chain of K proposals)
PROMPT = "hello hello hello hello hello hello hello hello"
MAX_NEW = 24  # tokens of most generations
IN_FLIGHT_NEW = 48  # tokens of the reference and of the request that sees draft updates in flight
TIMEOUT = 300
NO_DRAFT = "this server has no draft model"


ENGINE_SCRIPT = textwrap.dedent('''
    import json
    import sys

    from safetensors.torch import load_file


    def main(model, start_dir, push_file, steps, save_dir):
        import sglang

        engine = sglang.Engine(
            model_path=model, device="cpu", attention_backend="torch_native", dtype="float32",
            max_total_tokens=4096, log_level="warning", speculative_algorithm="EAGLE",
            speculative_draft_model_path=start_dir, speculative_num_steps=int(steps),
            speculative_eagle_topk=1, speculative_num_draft_tokens=int(steps) + 1)
        result = {}
        try:
            push = load_file(push_file)
            result["tensor"] = engine.update_draft_weights_from_tensor(list(push.items()))
            result["bias"] = engine.get_draft_weights_by_name("fc.bias", truncate_size=100000)
            result["bad"] = engine.update_draft_weights_from_tensor([("model.fc.bias", push["fc.bias"])])
            result["saved"] = engine.save_draft_weights(save_dir)  # the pushed draft, as served
            try:
                engine.save_draft_weights(save_dir)
            except ValueError as exc:
                result["refused"] = str(exc)
            result["disk"] = engine.update_draft_weights_from_disk(start_dir)
            result["bias_after_disk"] = engine.get_draft_weights_by_name("fc.bias", truncate_size=100000)
            result["disk_save"] = engine.update_draft_weights_from_disk(save_dir)  # sglang's loader reads the save
            result["bias_after_save"] = engine.get_draft_weights_by_name("fc.bias", truncate_size=100000)
        finally:
            print("RESULT " + json.dumps(result), flush=True)
            engine.shutdown()


    if __name__ == "__main__":
        main(*sys.argv[1:])
''')


# --- drafters --------------------------------------------------------------------------------


def target_tensors(model_path: str, names: list[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(model_path) / "model.safetensors"), framework="pt") as f:
        return {n: f.get_tensor(n).float() for n in names}


class Drafts:
    """One-token drafters for the target at ``model_path``, built and saved with the drafter core
    (`sglang_rl.drafter`): its random init, then fc/o_proj/down_proj set as described above."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.config = json.loads((Path(model_path) / "config.json").read_text())
        self.embed = target_tensors(model_path, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
        e = self.embed.double()
        self._gram_inv = torch.linalg.inv(e.T @ e)
        self._fits: dict[int, bool] = {}
        self._models: dict[int, EagleDrafter] = {}

    def proposes(self, token: int) -> bool:
        """Does the drafter for ``token`` really propose it (argmax of E v)?"""
        if token not in self._fits:
            self._fits[token] = int(torch.argmax(self.embed @ self.vector(token))) == token
        return self._fits[token]

    def vector(self, token: int) -> torch.Tensor:
        return (self._gram_inv @ self.embed[token].double()).float()

    def model(self, token: int) -> EagleDrafter:
        if token not in self._models:
            model = init_drafter(self.model_path, seed=token, init="normal", dtype=torch.float32)
            with torch.no_grad():
                model.fc.weight.zero_()
                model.fc.bias.copy_(self.vector(token))
                model.layers[0].self_attn.o_proj.weight.zero_()
                model.layers[0].mlp.down_proj.weight.zero_()
            self._models[token] = model
        return self._models[token]

    def weights(self, token: int) -> dict[str, torch.Tensor]:
        return dict(sglang_weights(self.model(token)))

    def folder(self, path: Path, token: int, extra: dict | None = None) -> Path:
        """The drafter folder sglang loads (config.json + model.safetensors), plus ``extra`` tensors."""
        save_drafter(self.model(token), path, dtype="float32")
        if extra:
            file = path / "model.safetensors"
            save_file({**load_file(str(file)), **extra}, str(file))
        return path


def expected_accepted(ids: list[int], token: int) -> int:
    """Accepted drafts of a greedy request whose drafter always proposes ``token``: ids[0] comes
    from the prefill; each verify step accepts the leading run of ``token`` (at most K) and adds
    the target's own next token."""
    i, accepted = 1, 0
    while i < len(ids):
        run = 0
        while run < K and i + run < len(ids) and ids[i + run] == token:
            run += 1
        accepted += run
        i += run + 1
    return accepted


# --- client ----------------------------------------------------------------------------------


def payload(named: list[tuple[str, torch.Tensor]]) -> str:
    return base64.b64encode(pickle.dumps(named)).decode()


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT)


def push_draft(url: str, named: dict | list, **fields) -> requests.Response:
    items = list(named.items()) if isinstance(named, dict) else named
    return post(url, "/update_draft_weights_from_tensor", {"serialized_named_tensors": [payload(items)], **fields})


def push_target(url: str, named: dict, **fields) -> requests.Response:
    return post(url, "/update_weights_from_tensor",
                {"serialized_named_tensors": [payload(list(named.items()))], **fields})


def draft_rows(url: str, name: str, rows: int = 1) -> torch.Tensor:
    r = post(url, "/get_draft_weights_by_name", {"name": name, "truncate_size": rows})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def target_rows(url: str, name: str, rows: int = 1) -> torch.Tensor:
    r = post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def generate(url: str, n: int = MAX_NEW) -> dict:
    r = post(url, "/generate", {"text": PROMPT, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return {"ids": [t[1] for t in meta["output_token_logprobs"]],
            "logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "accepted": meta.get("spec_num_correct_drafts", 0), "verify": meta.get("spec_verify_ct"),
            "finish": meta["finish_reason"]}


def assert_ok(r: requests.Response) -> str:
    assert r.status_code == 200 and r.json()["success"], r.text
    return r.json()["message"]


def assert_refused(r: requests.Response, reason: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and reason in body["message"], body


# --- fixtures --------------------------------------------------------------------------------


def _start_drafter(model_path: str, workdir: Path) -> Prepared:
    """The start-up drafter proposes a token the target never writes here (no draft accepted)."""
    drafts = Drafts(model_path)
    root = workdir / "drafters"
    absent = next(t for t in range(1000, 2000) if drafts.proposes(t))
    engine_token = next(t for t in range(2000, 3000) if drafts.proposes(t))
    folders = {"root": root, "absent": absent, "start": drafts.folder(root / "start", absent),
               "engine_token": engine_token}
    return Prepared(args=("--speculative-draft-model-path", str(folders["start"])), data={"folders": folders})


EAGLE = Spec("draft-weights", (
    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(K), "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", str(K + 1), "--max-running-requests", "8"), env=EAGER, prepare=_start_drafter)

eagle = server_fixture(EAGLE, scope="module", doc="EAGLE with the start-up drafter (`_start_drafter`). Its "
                       "draft and target weights are changed by the tests here, each of which puts them back.")


@pytest.fixture(scope="module")
def drafts(model_path: str) -> Drafts:
    return Drafts(model_path)


@pytest.fixture(scope="module")
def folders() -> dict:
    """The folders of the start-up drafter the server starts with (and where more go)."""
    return POOL.prepared_data(EAGLE.key)["folders"]


@pytest.fixture(scope="module")
def engine_job(model_path: str, drafts: Drafts, folders: dict) -> Iterator[dict]:
    """An sgl.Engine with the same EAGLE draft, in a subprocess (the plugin patches sglang
    process-wide). `ref` starts it once the HTTP server is up, so that it starts while the HTTP
    tests run (two sglang starts at once on two cores slowed both). It does not generate: the
    HTTP tests show what a pushed draft does."""
    root = folders["root"]
    token = folders["engine_token"]
    save_file(drafts.weights(token), str(root / "engine_push.safetensors"))
    script = root / "engine_script.py"
    script.write_text(ENGINE_SCRIPT)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **e2e_env(EAGER)}
    log = root / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), model_path, str(folders["start"]), str(root / "engine_push.safetensors"),
             str(K), str(root / "engine_save")], env=env, cwd=str(root), stdout=out, stderr=subprocess.STDOUT)
    yield {"proc": proc, "token": token, "log": log, "save_dir": root / "engine_save",
           "push": root / "engine_push.safetensors"}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def ref(eagle: ServerHandle, drafts: Drafts, folders: dict, engine_job: dict) -> dict:
    """The target's greedy output with the start-up drafter, and the token T the tests' drafter
    proposes (the most frequent output token a one-token drafter can propose)."""
    out = generate(eagle.url, IN_FLIGHT_NEW)
    assert out["ids"] and folders["absent"] not in out["ids"] and out["accepted"] == 0, out
    first = out["ids"][:MAX_NEW]
    token = next(t for t, _ in Counter(first).most_common() if drafts.proposes(t))
    assert expected_accepted(first, token) > 0
    return {**out, "token": token, "draft": folders["absent"]}


def assert_target_output(out: dict, ref: dict, token: int) -> None:
    """The output is the target's and the draft proposed ``token``.

    Greedy ids are always the reference's (its first tokens: the reference is longer). Logprobs
    are bit-identical when the drafter is the reference's (nothing accepted: every token comes from
    the first row of a verify step, as in the reference); with another drafter the same tokens are
    computed at other rows of the 4-row verify blocks, which changes float32 rounding (seen:
    ~7e-6), not the values."""
    n = len(out["ids"])
    assert out["ids"] == ref["ids"][:n]
    if token == ref["draft"]:
        assert out["logprobs"] == ref["logprobs"][:n]
    else:
        assert max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"][:n])) < 1e-4
    assert out["accepted"] == expected_accepted(out["ids"], token), (out, token)


# --- tests -----------------------------------------------------------------------------------


def test_tensor_update_changes_only_the_draft(eagle: Server, drafts: Drafts, folders: dict, ref: dict) -> None:
    url, token = eagle.url, ref["token"]
    watched = ["model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"]
    before = {n: target_rows(url, n, 2) for n in watched}
    message = assert_ok(push_draft(url, drafts.weights(token)))
    assert "loaded 10 draft tensors" in message and "cache flushed" in message
    assert torch.equal(draft_rows(url, "fc.bias", 1000), drafts.vector(token))
    assert torch.equal(draft_rows(url, "layers.0.self_attn.k_proj.weight", 2),
                       drafts.weights(token)["layers.0.self_attn.k_proj.weight"][:2])
    assert_target_output(generate(url), ref, token)
    assert all(torch.equal(target_rows(url, n, 2), before[n]) for n in watched)
    assert_ok(push_draft(url, drafts.weights(folders["absent"])))
    assert_target_output(generate(url), ref, folders["absent"])


def test_disk_update_loads_a_drafter_folder(eagle: Server, drafts: Drafts, folders: dict, ref: dict) -> None:
    url, token = eagle.url, ref["token"]
    h = drafts.config["hidden_size"]
    # published EAGLE folders may carry the embedding and layer 0's input_layernorm: skipped
    folder = drafts.folder(folders["root"] / "disk", token, extra={
        "embed_tokens.weight": torch.zeros(drafts.config["vocab_size"], h),
        "layers.0.input_layernorm.weight": torch.ones(h)})
    message = assert_ok(post(url, "/update_draft_weights_from_disk", {"model_path": str(folder)}))
    assert "loaded 10 draft tensors" in message and "skipped 2 names" in message
    assert torch.equal(draft_rows(url, "fc.bias", 1000), drafts.vector(token))
    assert torch.equal(draft_rows(url, "layers.0.self_attn.v_proj.weight", 2),
                       drafts.weights(token)["layers.0.self_attn.v_proj.weight"][:2])
    assert torch.equal(draft_rows(url, "embed_tokens.weight", 1)[0], drafts.embed[0])  # still the target's
    assert_ok(post(url, "/update_draft_weights_from_disk", {"model_path": str(folders["start"])}))
    assert torch.equal(draft_rows(url, "fc.bias", 1000), drafts.vector(folders["absent"]))


def test_target_updates_never_touch_the_draft(eagle: Server, drafts: Drafts, folders: dict, ref: dict,
                                              model_path: str) -> None:
    url, token = eagle.url, ref["token"]
    norm = target_tensors(model_path, ["model.norm.weight"])
    # draft, then target: a scaled final norm changes every logprob but no greedy id
    assert_ok(push_draft(url, drafts.weights(token)))
    assert_ok(push_target(url, {"model.norm.weight": norm["model.norm.weight"] * 1.5}))
    scaled = generate(url)
    assert scaled["ids"] == ref["ids"][:MAX_NEW] and scaled["logprobs"] != ref["logprobs"][:MAX_NEW]
    assert scaled["accepted"] == expected_accepted(scaled["ids"], token)
    assert torch.equal(draft_rows(url, "fc.bias", 1000), drafts.vector(token))
    # target, then draft: both stay in effect
    other = drafts.weights(folders["absent"])
    assert_ok(push_draft(url, other))
    assert torch.equal(target_rows(url, "model.norm.weight", 1000), norm["model.norm.weight"] * 1.5)
    assert torch.equal(draft_rows(url, "fc.bias", 1000), other["fc.bias"])
    # load_format="direct" takes the model's own parameter names, and sglang would also hand them
    # to the draft model: a name it lacks kills the scheduler (KeyError), and layer 0's names,
    # which it has, would overwrite the draft's layer with the target's
    assert_ok(push_target(url, norm, load_format="direct"))
    down = target_tensors(model_path, ["model.layers.0.mlp.down_proj.weight"])
    assert_ok(push_target(url, down, load_format="direct"))
    assert not draft_rows(url, "layers.0.mlp.down_proj.weight", 4).any()  # the drafter's zeros
    assert_ok(push_draft(url, drafts.weights(token)))
    # the target's own folder from disk: the target reloads, the draft keeps its weights
    assert_ok(post(url, "/update_weights_from_disk", {"model_path": model_path}))
    assert_target_output(generate(url), ref, token)
    assert_ok(push_draft(url, drafts.weights(folders["absent"])))


def test_target_embedding_update_reaches_the_draft(eagle: Server, drafts: Drafts, ref: dict) -> None:
    url = eagle.url
    # sent in bfloat16, the checkpoint's dtype (exact, and half the bytes of the float32 table)
    original = drafts.embed.bfloat16()
    embed = original.clone()
    assert 0 not in ref["ids"]
    embed[0] = torch.linspace(-1, 1, embed.shape[1]).bfloat16()
    assert_ok(push_target(url, {"model.embed_tokens.weight": embed}))
    assert torch.equal(draft_rows(url, "embed_tokens.weight", 1)[0], embed[0].float())
    assert torch.equal(draft_rows(url, "lm_head.weight", 1)[0], embed[0].float())  # tied target: the head too
    assert_ok(push_target(url, {"model.embed_tokens.weight": original}))
    assert torch.equal(draft_rows(url, "embed_tokens.weight", 1)[0], drafts.embed[0])


def test_requests_in_flight_finish_with_the_targets_output(eagle: Server, drafts: Drafts, folders: dict,
                                                           ref: dict) -> None:
    url, token = eagle.url, ref["token"]
    started, result = threading.Event(), {}
    bodies = [{"serialized_named_tensors": [payload(list(drafts.weights(t).items()))]}
              for t in (token, folders["absent"], token)]

    def stream() -> None:
        body = {"text": PROMPT, "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": IN_FLIGHT_NEW, "temperature": 0}}
        with requests.post(url + "/generate", json=body, stream=True, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    result["last"] = json.loads(line[len(b"data: "):])
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(TIMEOUT)
    messages = [assert_ok(post(url, "/update_draft_weights_from_tensor", body)) for body in bodies]
    thread.join(TIMEOUT)
    meta = result["last"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert [t[1] for t in meta["output_token_logprobs"]] == ref["ids"]
    assert any("cache not flushed: requests are running" in m for m in messages), messages
    assert_ok(push_draft(url, drafts.weights(folders["absent"])))


def test_bad_updates_are_refused_and_nothing_is_loaded(eagle: Server, drafts: Drafts, folders: dict,
                                                       ref: dict, model_path: str) -> None:
    url, token = eagle.url, ref["token"]
    good = drafts.weights(token)
    assert_ok(push_draft(url, good))
    h = drafts.config["hidden_size"]
    changed_bias = torch.ones(h)
    cases = [
        ([("model.fc.weight", good["fc.weight"])], {}, "names the draft model does not have: model.fc.weight"),
        ([("layers.0.self_attn.qkv_proj.weight", torch.zeros(3 * h, h))], {}, "does not have"),
        ([("fc.bias", changed_bias), ("fc.weight", torch.zeros(h, h))], {},
         f"wrong shapes: fc.weight [{h}, {h}] (expected [{h}, {2 * h}])"),
        ([("fc.bias", changed_bias), ("embed_tokens.weight", drafts.embed[:2])], {}, "shares with the target"),
        ([("fc.bias", changed_bias), ("lm_head.weight", drafts.embed[:2])], {}, "shares with the target"),
        ([("fc.bias", changed_bias), ("fc.bias", changed_bias)], {}, "more than once"),
        ([("fc.bias", changed_bias.long())], {}, "not floating point"),
        ([], {}, "holds no tensors"),
        ([("fc.bias", changed_bias)], {"load_format": "direct"}, "load_format 'direct' is not supported"),
        ([("fc.bias", changed_bias)], {"weight_version": "7"}, "weight_version cannot be used"),
        ([("fc.bias", changed_bias)], {"abort_all_requests": True}, "abort_all_requests cannot be used"),
    ]
    for named, fields, reason in cases:
        assert_refused(push_draft(url, named, **fields), reason)
    garbage = {"serialized_named_tensors": [base64.b64encode(b"not a pickle").decode()]}
    assert_refused(post(url, "/update_draft_weights_from_tensor", garbage), "could not be deserialized")
    # what sglang's MultiprocessingSerializer writes: CPU storage shared by file descriptor, which
    # only the sender's child processes may fetch (sglang's own /update_weights_from_tensor dies on it)
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("fc.bias", changed_bias)])
    fd_shared = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()]}
    assert_refused(post(url, "/update_draft_weights_from_tensor", fd_shared), "send base64(pickle.dumps")
    bucket = {"flattened_tensor": torch.zeros(8, dtype=torch.uint8), "metadata": ["not metadata"]}
    assert_refused(post(url, "/update_draft_weights_from_tensor",
                        {"serialized_named_tensors": [payload(bucket)], "load_format": "flattened_bucket"}),
                   "flattened_bucket metadata is malformed")
    # folders: the target's checkpoint, a missing one, one with a wrong shape
    assert_refused(post(url, "/update_draft_weights_from_disk", {"model_path": model_path}),
                   "missing draft weights: fc.bias")
    assert_refused(post(url, "/update_draft_weights_from_disk", {"model_path": "/nonexistent/drafter"}),
                   "is not a directory")
    wrong = drafts.folder(folders["root"] / "wrong", token, extra={"fc.bias": torch.zeros(h + 1)})
    assert_refused(post(url, "/update_draft_weights_from_disk", {"model_path": str(wrong)}),
                   f"fc.bias [{h + 1}]")
    assert post(url, "/update_draft_weights_from_disk", {}).status_code == 400
    assert_refused(post(url, "/get_draft_weights_by_name", {"name": "model.fc.bias"}), "no draft weight named")
    # nothing was half-applied, and the server still serves the target with the good drafter
    assert torch.equal(draft_rows(url, "fc.bias", 1000), drafts.vector(token))
    assert_target_output(generate(url), ref, token)
    assert_ok(push_draft(url, drafts.weights(folders["absent"])))


def test_flattened_bucket_update(eagle: Server, drafts: Drafts, ref: dict) -> None:
    """The bucketed form verl uses (load_format="flattened_bucket") works for the draft too."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    url, token = eagle.url, ref["token"]
    bucket = FlattenedTensorBucket(named_tensors=list(drafts.weights(token).items()))
    body = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    assert_ok(post(url, "/update_draft_weights_from_tensor",
                   {"serialized_named_tensors": [payload(body)], "load_format": "flattened_bucket"}))
    assert torch.equal(draft_rows(url, "fc.bias", 1000), drafts.vector(token))
    assert torch.equal(draft_rows(url, "layers.0.mlp.up_proj.weight", 2),
                       drafts.weights(token)["layers.0.mlp.up_proj.weight"][:2])


def test_engine_methods(engine_job: dict, drafts: Drafts, folders: dict) -> None:
    """Engine.update_draft_weights_from_tensor (sglang's own serialization of CPU tensors),
    get_draft_weights_by_name, update_draft_weights_from_disk and a refusal, in an sgl.Engine; and
    Engine.save_draft_weights: it writes the served (pushed) draft, refuses a folder that holds a
    save, and sglang's own draft loader reads the save back."""
    engine_job["proc"].wait(timeout=TIMEOUT)
    out = engine_job["log"].read_text()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    result, token = json.loads(lines[-1][len("RESULT "):]), engine_job["token"]
    ok, message = result["tensor"]
    assert ok and "loaded 10 draft tensors" in message, message
    assert torch.equal(torch.tensor(result["bias"]), drafts.vector(token))
    ok, message = result["bad"]
    assert not ok and "names the draft model does not have: model.fc.bias" in message, message
    assert result["disk"][0], result["disk"]
    assert torch.equal(torch.tensor(result["bias_after_disk"]), drafts.vector(folders["absent"]))
    pushed = load_file(str(engine_job["push"]))
    saved = load_file(str(engine_job["save_dir"] / "model.safetensors"))
    assert result["saved"]["path"] == str(engine_job["save_dir"]) and result["saved"]["tensors"] == len(saved)
    assert all(torch.equal(saved[n], pushed[n]) for n in pushed), sorted(pushed)
    assert "holds a previous save" in result["refused"]
    assert result["disk_save"][0], result["disk_save"]
    assert torch.equal(torch.tensor(result["bias_after_save"]), drafts.vector(token))


def test_server_without_a_draft_refuses(plain_server: Server, drafts: Drafts) -> None:
    url = plain_server.url
    assert_refused(push_draft(url, drafts.weights(5)), NO_DRAFT)
    assert_refused(post(url, "/update_draft_weights_from_disk", {"model_path": "/tmp"}), NO_DRAFT)
    assert post(url, "/get_draft_weights_by_name", {"name": "fc.bias"}).status_code == 400
    out = post(url, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4
