"""EAGLE3 drafter co-training inside a real CPU server (SmolLM2 target, float32).

The draft is `sglang-rl drafter init --arch eagle3` (its own LM head over a 4096-id draft
vocabulary). The server trains it on its own rollouts' auxiliary-layer rows and hot-swaps every
round, with TOPLOC on (fingerprints take the last layer's rows, co-training the auxiliary
layers'). Checked like a user would: the rounds change the served draft (fc, its layer and its
own LM head), greedy outputs stay the plain server's and their fingerprints verify on a server
without speculative decoding, a target update reaches the target only and leaves the trained
draft alone, and the saved drafter is an EAGLE3 folder that loads back.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from e2e_servers import EAGER, Prepared, Server, Spec, server_fixture
from test_drafter_cotrain import gsm8k, stats, wait_rounds
from toploc_helpers import assert_fingerprints_verify

ROUND = 4  # small rounds: the checks are that every part of the draft changes, not by how much
DRAFT_VOCAB = 4096
MAX_TOKENS = 32
WATCHED = ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "lm_head.weight")


def _eagle3_drafter(model_path: str, workdir: Path) -> Prepared:
    from sglang_rl.drafter.cli import main

    out = workdir / "eagle3"
    assert main(["init", "--arch", "eagle3", "--model-path", model_path, "--out", str(out),
                 "--draft-vocab-size", str(DRAFT_VOCAB)]) == 0
    return Prepared(args=("--speculative-draft-model-path", str(out)), data={"drafter": out})


COTRAIN_EAGLE3 = Spec("cotrain-eagle3", (
    "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4", "--drafter-cotrain", "--drafter-cotrain-samples-per-round", str(ROUND),
    "--drafter-cotrain-steps", "4", "--drafter-cotrain-lr", "1e-3", "--drafter-cotrain-unroll-steps", "2",
    "--drafter-cotrain-threads", "1", "--enable-metrics", "--toploc-verification"), env=EAGER, prepare=_eagle3_drafter)
cotrain_eagle3_server = server_fixture(COTRAIN_EAGLE3, scope="module",
                                       doc="EAGLE3 with a random-init drafter, co-training and TOPLOC on.")


def chat(url: str, messages: list[dict]) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_input_ids": True, "return_output_ids": True}
    resp = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
    assert resp.status_code == 200, resp.text[:2000]
    return resp.json()


def stream(url: str, messages: list[dict]) -> str:
    """A streamed greedy chat's text, the chunks joined."""
    body = {"model": "default", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as resp:
        assert resp.status_code == 200, resp.text[:1000]
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                text.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return "".join(text)


def post(url: str, path: str, body: dict) -> dict:
    resp = requests.post(url + path, json=body, timeout=600)
    assert resp.status_code == 200, (path, resp.status_code, resp.text[:1000])
    return resp.json() if resp.text else {}


def draft_rows(url: str, name: str, rows: int = 2) -> torch.Tensor:
    got = post(url, "/get_draft_weights_by_name", {"name": name, "truncate_size": rows})
    assert got is not None, name
    return torch.tensor(got)


def _batch(url: str, prompts: list) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: chat(url, p), prompts))


def test_rounds_train_the_eagle3_draft_and_outputs_stay_the_plain_servers(
        cotrain_eagle3_server: Server, plain_server: Server, toploc_server: Server) -> None:
    url = cotrain_eagle3_server.url
    prompts = gsm8k()
    before = {name: draft_rows(url, name) for name in WATCHED}
    _batch(url, prompts[:ROUND])
    after = wait_rounds(url, 1)
    assert not after["errors"], after["errors"]
    assert after["samples"] >= ROUND and after["rows_sent"] > 0
    assert all(v == v and v > 0 for v in after["loss"]), after["loss"]  # finite, positive
    for name in WATCHED:  # every part is trained, the draft's own head too
        assert not torch.equal(draft_rows(url, name), before[name]), name

    # greedy outputs under the trained draft are the plain server's, streamed and with n > 1 too
    held = prompts[1200:1204]
    cotrained = _batch(url, held)
    plain = [r["choices"][0]["message"]["content"] for r in _batch(plain_server.url, held)]
    assert [r["choices"][0]["message"]["content"] for r in cotrained] == plain
    assert_fingerprints_verify(toploc_server.url, [r["choices"][0]["message"] for r in cotrained])
    assert stream(url, held[0]) == plain[0]
    two = requests.post(url + "/v1/chat/completions", json={"model": "default", "messages": held[1], "n": 2,
                                                            "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=900)
    assert two.status_code == 200, two.text[:1000]
    assert [c["message"]["content"] for c in two.json()["choices"]] == [plain[1]] * 2


def test_a_target_update_leaves_the_trained_draft_alone(cotrain_eagle3_server: Server, model_path: str) -> None:
    """sglang feeds a target update's names to the draft too; an EAGLE3 draft would take the
    target's layer 0 and norm into its own layer. The update reaches the target only."""
    url = cotrain_eagle3_server.url
    wait_rounds(url, 1)
    version = stats(url)["policy_version"]
    rounds = stats(url)["rounds"]
    before = {name: draft_rows(url, name) for name in (*WATCHED, "norm.weight")}
    assert post(url, "/update_weights_from_disk", {"model_path": model_path})["success"]
    current = stats(url)
    if current["rounds"] == rounds:  # no round landed meanwhile: the draft must be untouched
        for name, rows in before.items():
            assert torch.equal(draft_rows(url, name), rows), name
    assert current["policy_version"] == version + 1
    chat(url, gsm8k()[5])


def test_saved_eagle3_drafter_loads_back(cotrain_eagle3_server: Server, model_path: str, tmp_path: Path) -> None:
    from sglang_rl.drafter.eagle3 import read_eagle3

    url = cotrain_eagle3_server.url
    start = Path(cotrain_eagle3_server.prepared["drafter"])
    folder = tmp_path / "saved"
    post(url, "/save_draft_weights", {"path": str(folder)})
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    _, saved = read_eagle3(folder)
    _, first = read_eagle3(start)
    assert set(saved) == set(first)  # the same layout: the layer, fc, norm, the head, d2t, t2d
    assert torch.equal(saved["d2t"], first["d2t"]) and torch.equal(saved["t2d"], first["t2d"])
    served_head = draft_rows(url, "lm_head.weight", 3)
    assert torch.equal(saved["lm_head.weight"][:3].float(), served_head)

    # the server's draft loads it back, every trained tensor; the vocabulary mapping is fixed at start
    for source in (start, folder):
        message = post(url, "/update_draft_weights_from_disk", {"model_path": str(source)})["message"]
        assert message.startswith("loaded 13 draft tensors") and "skipped 2 names" in message, message
        assert "(d2t, t2d)" in message, message
    assert torch.equal(draft_rows(url, "lm_head.weight", 3), served_head)
