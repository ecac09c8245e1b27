"""EAGLE speculative decoding on the CPU test server (SmolLM2 target, a one-layer EAGLE-1/2 drafter).

The drafter is written here into a tmp folder in the checkpoint format sglang loads
(LlamaForCausalLMEagle: config.json + `fc.*`, `layers.0.*`; embedding and lm_head come from the
target). It starts random, then `fc` is set to map a token's embedding e to (E^T E)^-1 e and the
attention/MLP outputs to zero, so its proposal argmax(E (E^T E)^-1 e_t) is the last token again
(for ~98% of SmolLM2's vocabulary; E is the shared embedding, also the tied lm_head). On a
prompt whose greedy continuation repeats a word, whole chains of drafts are accepted, so the
accepted-draft path (bonus tokens, KV of accepted drafts, draft extend at the last accepted row)
runs, not only the reject-everything path of a random drafter.

The target decides every token: greedy output ids with EAGLE must equal those of the server
without speculative decoding, for prompts sent together (batched verify), over /generate, chat
completions and streaming, and `meta_info.spec_verify_ct` counts the verify steps.

The server also runs --toploc-verification: its fingerprints cover the committed runs of the verify
steps and verify on a server without speculative decoding, and the other way round.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from e2e_servers import EAGER, Prepared, Server, Spec, server_fixture
from hidden_states_fixtures import check_rows_of_accepted_drafts, generate
from toploc_helpers import assert_fingerprints_verify
from speculative_prompts import MAX_NEW, PROMPTS, REPEATING

STEPS = 3  # draft steps per verify; topk 1 makes a chain of STEPS drafts + the bonus token
CHAT = [{"role": "user", "content": "Name three colors, then say hello five times."}]
TIMEOUT = 300


def write_drafter(target: Path, out: Path, seed: int = 0) -> Path:
    """A random-init EAGLE drafter folder for `target`, then set to draft the last token again."""
    cfg = json.loads((target / "config.json").read_text())
    # tie_word_embeddings must be false: sglang swaps in the target's embedding and lm_head with
    # two `del`s, which fail on a tied (single-module) head
    cfg.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1, tie_word_embeddings=False)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q_dim, kv_dim = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q_dim, h),
        "layers.0.self_attn.k_proj.weight": (kv_dim, h),
        "layers.0.self_attn.v_proj.weight": (kv_dim, h),
        "layers.0.self_attn.o_proj.weight": (h, q_dim),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    weights = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}
    weights["fc.bias"] = torch.zeros(h)
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(h)

    target_weights: dict = {}
    for file in sorted(target.glob("*.safetensors")):
        target_weights.update(load_file(file))
    embed = target_weights["model.embed_tokens.weight"].double()
    weights["fc.weight"] = torch.cat([torch.linalg.inv(embed.T @ embed), torch.zeros(h, h)], dim=1).float()
    weights["layers.0.self_attn.o_proj.weight"].zero_()
    weights["layers.0.mlp.down_proj.weight"].zero_()

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(out / "model.safetensors"))
    return out


def _last_token_drafter(model_path: str, workdir: Path) -> Prepared:
    return Prepared(args=("--speculative-draft-model-path", str(write_drafter(Path(model_path), workdir / "drafter"))))


EAGLE = Spec("eagle", (
    "--enable-return-hidden-states", "--toploc-verification", "--speculative-algorithm", "EAGLE",
    "--speculative-num-steps", str(STEPS), "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", str(STEPS + 1)), env=EAGER, prepare=_last_token_drafter)
eagle_server = server_fixture(EAGLE, scope="module", doc="EAGLE with the last-token drafter of `write_drafter`.")


def _all_at_once(url: str) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda prompt: generate(url, prompt, MAX_NEW), PROMPTS))


@pytest.fixture(scope="module")
def answers(eagle_server: Server, toploc_server: Server) -> tuple[list[dict], list[dict]]:
    """The prompts sent together to this server and to the `toploc` server (no speculative
    decoding): the greedy and the fingerprint tests read the same answers."""
    return _all_at_once(eagle_server.url), _all_at_once(toploc_server.url)


def test_greedy_ids_equal_the_plain_server(answers: tuple) -> None:
    """Prompts sent together: the same ids and finish reasons as without speculative decoding,
    every request went through verify steps, and the repeating one got whole chains accepted."""
    eagle, plain = answers
    for prompt, got, want in zip(PROMPTS, eagle, plain):
        meta = got["meta_info"]
        assert meta["output_ids"] == want["meta_info"]["output_ids"], prompt
        assert meta["finish_reason"] == want["meta_info"]["finish_reason"], prompt
        assert "spec_verify_ct" not in want["meta_info"]
        assert 0 < meta["spec_verify_ct"] <= meta["completion_tokens"], (prompt, meta)
    repeating = eagle[0]["meta_info"]
    assert repeating["spec_verify_ct"] * 2 <= repeating["completion_tokens"], repeating


def _chat(url: str, stream: bool) -> str:
    body = {"model": "default", "messages": CHAT, "temperature": 0, "max_tokens": 24, "stream": stream}
    resp = requests.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT, stream=stream)
    assert resp.status_code == 200, resp.text[:2000]
    if not stream:
        return resp.json()["choices"][0]["message"]["content"]
    parts = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


def _streamed_ids(url: str) -> list[int]:
    body = {"text": REPEATING, "stream": True, "return_output_ids": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    resp = requests.post(url + "/generate", json=body, timeout=TIMEOUT, stream=True)
    assert resp.status_code == 200, resp.text[:2000]
    last = None
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            last = json.loads(line[6:])
    return last["meta_info"]["output_ids"]


def test_chat_and_streaming_match_the_plain_server(eagle_server: Server, plain_server: Server) -> None:
    """Chat completions, streamed or not, and streamed /generate say what the plain server says."""
    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(_chat, s.url, stream) for s in (eagle_server, plain_server) for stream in (False, True)]
        eagle_chat, eagle_stream, plain_chat, plain_stream = (job.result() for job in jobs)
    assert eagle_chat == plain_chat and eagle_stream == plain_chat and plain_stream == plain_chat
    assert eagle_chat
    assert _streamed_ids(eagle_server.url) == _streamed_ids(plain_server.url)


def test_hidden_state_rows_under_eagle(eagle_server: Server, hf) -> None:
    """--enable-return-hidden-states with EAGLE: the rows of a request whose drafts get accepted
    equal a transformers forward of prompt + response, and the ids do not change."""
    check_rows_of_accepted_drafts(eagle_server.url, hf, REPEATING, "eagle")


def test_fingerprints_under_eagle_verify_without_speculative_decoding(eagle_server: Server, toploc_server: Server,
                                                                      answers: tuple) -> None:
    """Batched EAGLE generations (whole draft chains accepted for the repeating prompt) verify on
    the plain TOPLOC server, and that server's generations verify on the EAGLE server."""
    eagle = [out["meta_info"] for out in answers[0]]
    assert eagle[0]["spec_verify_ct"] * 2 <= eagle[0]["completion_tokens"], eagle[0]
    assert_fingerprints_verify(toploc_server.url, eagle)
    assert_fingerprints_verify(eagle_server.url, [out["meta_info"] for out in answers[1]])
