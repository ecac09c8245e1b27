"""EAGLE3 speculative decoding on the CPU test server with a drafter from `sglang-rl drafter init
--arch eagle3` (SmolLM2 target, float32).

The drafter's vocabulary is 4096 target ids: the ids of a few texts first (by count), then the
lowest ids, so " hello" sits at a draft id far from its target id and reaches the target only
through the folder's d2t mapping. The test then sets the weights so that the draft always proposes
" hello" (its LM head is zero except the " hello" row, which reads a coordinate the MLP makes
positive: z * silu(z) >= 0), so on a prompt whose continuation repeats "hello" chains of drafts
are accepted, and a wrong mapping would propose another token and have every draft rejected.

The target decides every token: greedy output ids with EAGLE3 equal those of the plain server.
The server also runs --toploc-verification and --enable-return-hidden-states: fingerprints and
hidden-state rows are the last layer's (the target captures auxiliary layers for its draft), so
its fingerprints verify on a server without speculative decoding and the other way round, and its
rows equal a transformers forward. With --specforge-export-dir it writes each rollout in
SpecForge's offline format, whose last-layer and auxiliary rows equal a transformers forward's.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e_servers import EAGER, Prepared, Server, Spec, server_fixture
from hidden_states_fixtures import check_rows_of_accepted_drafts, generate
from speculative_prompts import MAX_NEW, PROMPTS, REPEATING
from toploc_helpers import assert_fingerprints_verify

STEPS = 3
DRAFT_VOCAB = 4096


def _eagle3_drafter(model_path: str, workdir: Path) -> Prepared:
    from transformers import AutoTokenizer

    from sglang_rl.drafter.cli import main
    from sglang_rl.drafter.config import DrafterConfig

    vocab = DrafterConfig.from_dir(model_path).vocab_size
    counts = [0] * vocab
    tok = AutoTokenizer.from_pretrained(model_path)
    for text in PROMPTS + [" hello Hello Paris. The sea, the waves; return fib(n - 1) + fib(n - 2)"]:
        for i in tok(text)["input_ids"]:
            counts[i] += 1
    (workdir / "counts.json").write_text(json.dumps(counts))
    out = workdir / "eagle3"
    rc = main(["init", "--arch", "eagle3", "--model-path", model_path, "--out", str(out), "--init", "normal",
               "--draft-vocab-size", str(DRAFT_VOCAB), "--token-counts", str(workdir / "counts.json")])
    assert rc == 0
    _always_hello(out, tok(" hello", add_special_tokens=False)["input_ids"][0])
    export = workdir / "specforge"
    return Prepared(args=("--speculative-draft-model-path", str(out), "--specforge-export-dir", str(export)),
                    data={"drafter": out, "specforge": export})


def _always_hello(folder: Path, hello: int) -> None:
    """Rewrite the drafter so that its top draft id is always the one of target id ``hello``."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    draft_id = int(torch.nonzero(torch.arange(DRAFT_VOCAB) + weights["d2t"] == hello)[0])
    assert draft_id != hello  # the mapping matters
    m = "midlayer."
    weights["fc.weight"].zero_()  # the layer's residual starts at 0 ...
    weights[m + "self_attn.o_proj.weight"][0].zero_()  # ... and attention never writes coordinate 0
    weights[m + "mlp.up_proj.weight"][0] = weights[m + "mlp.gate_proj.weight"][0]  # unit 0: z * silu(z)
    weights[m + "mlp.down_proj.weight"].zero_()
    weights[m + "mlp.down_proj.weight"][0, 0] = 1.0  # which only goes to coordinate 0
    weights["lm_head.weight"].zero_()
    weights["lm_head.weight"][draft_id, 0] = 1.0
    save_file(weights, str(folder / "model.safetensors"))


EAGLE3 = Spec("eagle3", (
    "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(STEPS),
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(STEPS + 1),
    "--toploc-verification", "--enable-return-hidden-states"),
    env=EAGER, prepare=_eagle3_drafter)
eagle3_server = server_fixture(EAGLE3, scope="module",
                               doc="EAGLE3 (TOPLOC, hidden states) with a `drafter init --arch eagle3` folder that always drafts ' hello'.")


def _all_at_once(url: str) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda prompt: generate(url, prompt, MAX_NEW), PROMPTS))


@pytest.fixture(scope="module")
def answers(eagle3_server: Server, toploc_server: Server) -> tuple[list[dict], list[dict]]:
    """The prompts sent together to this server and to the `toploc` server (no speculative
    decoding): the greedy and the fingerprint tests read the same answers."""
    return _all_at_once(eagle3_server.url), _all_at_once(toploc_server.url)


def test_greedy_ids_equal_the_plain_server(answers: tuple, tokenizer) -> None:
    """Prompts sent together: the ids and finish reasons of a server without speculative
    decoding, every request verified by EAGLE3 steps, and on the repeating prompt drafts (mapped
    through d2t) accepted."""
    eagle3, plain = answers
    for prompt, got, want in zip(PROMPTS, eagle3, plain):
        meta = got["meta_info"]
        assert meta["output_ids"] == want["meta_info"]["output_ids"], prompt
        assert meta["finish_reason"] == want["meta_info"]["finish_reason"], prompt
        assert 0 < meta["spec_verify_ct"] <= meta["completion_tokens"], (prompt, meta)
    repeating = eagle3[0]["meta_info"]
    hello = tokenizer(" hello", add_special_tokens=False)["input_ids"]
    assert len(hello) == 1 and hello[0] >= DRAFT_VOCAB  # reached only through d2t
    assert repeating["output_ids"].count(hello[0]) >= 4, repeating["output_ids"]
    # each verify step commits its accepted drafts plus one token of the target's own (a mapping
    # that sends the draft id itself accepts 1 of 24 here)
    accepted = repeating["completion_tokens"] - repeating["spec_verify_ct"]
    assert accepted >= repeating["completion_tokens"] // 2, (accepted, repeating)


def test_hidden_state_rows_are_the_last_layers(eagle3_server: Server, hf) -> None:
    """Rows asked for on the EAGLE3 server, of a request whose drafts get accepted, equal a
    transformers forward of prompt + response: the last layer, not the auxiliary layers."""
    check_rows_of_accepted_drafts(eagle3_server.url, hf, REPEATING, "eagle3")


def test_fingerprints_under_eagle3_verify_without_speculative_decoding(eagle3_server: Server, toploc_server: Server,
                                                                       answers: tuple) -> None:
    """Batched EAGLE3 generations (draft chains accepted on the repeating prompt) verify on the
    plain TOPLOC server, and that server's generations verify on the EAGLE3 server."""
    eagle3 = [out["meta_info"] for out in answers[0]]
    assert eagle3[0]["spec_verify_ct"] * 2 <= eagle3[0]["completion_tokens"], eagle3[0]
    assert_fingerprints_verify(toploc_server.url, eagle3)
    assert_fingerprints_verify(eagle3_server.url, [out["meta_info"] for out in answers[1]])


def _exported(folder: Path, ids: list[int], timeout: float = 60) -> dict:
    """The exported record of the rollout with these input ids (the writer runs off the loop)."""
    import time

    import torch

    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in sorted(folder.glob("*.ckpt")):
            record = torch.load(path, weights_only=True)
            if record["input_ids"].tolist() == ids:
                return record
        time.sleep(0.5)
    seen = [torch.load(path, weights_only=True)["input_ids"].tolist()[:8] for path in sorted(folder.glob("*.ckpt"))]
    raise AssertionError(f"no record of {ids[:8]}... in {folder}, only of {seen}")


def test_rollouts_are_exported_in_specforge_format(eagle3_server: Server, hf) -> None:
    """Each rollout is a SpecForge record: input ids of prompt + response less its last token,
    the response's loss mask, and bf16 rows of the last layer and of the auxiliary layers the
    draft reads (inputs of target layers 2, 15 and 27), each equal to a transformers forward."""
    import torch

    from sglang_rl.drafter.eagle3 import default_aux_layer_ids

    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda p: generate(eagle3_server.url, p, MAX_NEW), PROMPTS[:2]))
    assert outs[0]["meta_info"]["spec_verify_ct"] * 2 <= outs[0]["meta_info"]["completion_tokens"]  # chains accepted
    layers = [i + 1 for i in default_aux_layer_ids(hf.model.config.num_hidden_layers)]
    for out in outs:
        prompt, response = out["meta_info"]["input_ids"], out["meta_info"]["output_ids"]
        ids = prompt + response[:-1]
        record = _exported(Path(eagle3_server.prepared["specforge"]), ids)
        assert set(record) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert record["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(response) - 1)
        with torch.no_grad():
            states = hf.model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want_last = hf.rows(ids)
        want_aux = torch.cat([states[layer][0] for layer in layers], dim=-1)
        for name, want in (("hidden_state", want_last), ("aux_hidden_state", want_aux)):
            got = record[name]
            assert got.dtype == torch.bfloat16 and tuple(got.shape) == (1, *want.shape), (name, got.shape)
            torch.testing.assert_close(got[0].float(), want, atol=2e-3, rtol=1e-2, msg=name)
