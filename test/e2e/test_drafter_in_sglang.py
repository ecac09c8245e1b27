"""A drafter saved by `sglang_rl.drafter` drafts in sglang exactly what the torch module drafts.

sglang does not return draft tokens, but with greedy verification and a topk=1 chain they decide
everything it does return: each verify step accepts the longest prefix of the chain that equals
the target's greedy tokens. So the torch module (`greedy_draft_chain`) replayed over the target's
greedy output predicts every request's number of verify steps (`spec_verify_ct`) and its whole
acceptance histogram (`spec_accept_histogram`). A drafter with one wrong weight, a swapped concat
order or an off-by-one position predicts other counts.
"""

from __future__ import annotations

import json
from typing import Iterator

import pytest
import requests
import torch

from e2e_servers import Server, start_server

STEPS = 3  # --speculative-num-steps: draft tokens per chain
NEW_TOKENS = 40
PROMPTS = [
    "Question: A farmer has 12 cows and buys 5 more. How many cows does he have?\nAnswer:",
    "Write a short poem about the sea.",
    "List the first five prime numbers and explain why 1 is not prime.",
]


@pytest.fixture(scope="module")
def target(model_path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return lm, AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def greedy(target) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(prompt + greedy continuation ids, prompt length, last-layer rows) for each prompt."""
    lm, tok = target
    out = []
    for text in PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
        ids = prompt[0]
        with torch.no_grad():
            for _ in range(NEW_TOKENS):  # plain argmax, end-of-turn included (the server ignores EOS)
                ids = torch.cat([ids, lm(ids[None]).logits[0, -1].argmax().view(1)])
            rows = lm.model(ids[None]).last_hidden_state[0]
        out.append((ids, prompt.shape[1], rows))
    return out


@pytest.fixture(scope="module")
def drafter(model_path: str, greedy, tmp_path_factory):
    """A briefly trained drafter (drafts that are sometimes right), saved and loaded back."""
    from sglang_rl.drafter import DrafterTrainer, EagleLossConfig, init_drafter, load_drafter, sample_from_rows, save_drafter

    torch.manual_seed(0)
    model = init_drafter(model_path, seed=0)
    trainer = DrafterTrainer(model, lr=1e-3, loss=EagleLossConfig(soft_topk=64))
    trainer.train_steps([sample_from_rows(ids, rows, n) for ids, n, rows in greedy], 40)
    folder = save_drafter(model, tmp_path_factory.mktemp("drafter") / "trained", dtype="float32")
    return folder, load_drafter(folder, model_path)


@pytest.fixture(scope="module")
def eagle_server(model_path: str, drafter) -> Iterator[Server]:
    server = start_server(model_path, "--disable-radix-cache", "--speculative-algorithm", "EAGLE",
                          "--speculative-draft-model-path", str(drafter[0]), "--speculative-num-steps", str(STEPS),
                          "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(STEPS + 1),
                          log_name="eagle-equivalence")
    yield server
    server.stop()


def predict(model, ids: torch.Tensor, prompt_len: int, rows: torch.Tensor) -> tuple[int, list[int]]:
    """Verify steps and the accepted-draft-token histogram of greedy EAGLE with a topk=1 chain."""
    from sglang_rl.drafter import greedy_draft_chain

    full = ids.tolist()
    committed = prompt_len + 1  # the prefill samples the first token
    accepted = []
    while committed < len(full):
        chain = greedy_draft_chain(model, ids[:committed], rows[:committed - 1], STEPS).tokens.tolist()
        n = 0
        while n < len(chain) and committed + n < len(full) and full[committed + n] == chain[n]:
            n += 1
        accepted.append(n)
        committed += n + 1
    return len(accepted), [accepted.count(i) for i in range(STEPS + 1)]


def test_server_drafts_what_the_torch_module_drafts(eagle_server: Server, drafter, greedy) -> None:
    _, model = drafter
    totals = [0] * (STEPS + 1)
    for ids, prompt_len, rows in greedy:
        resp = requests.post(eagle_server.url + "/generate", json={
            "input_ids": ids[:prompt_len].tolist(),
            "sampling_params": {"temperature": 0, "max_new_tokens": len(ids) - prompt_len, "ignore_eos": True}},
            timeout=600)
        assert resp.status_code == 200, resp.text[:1000]
        out = resp.json()
        assert out["output_ids"] == ids[prompt_len:].tolist(), "EAGLE changed the greedy output"
        meta = out["meta_info"]
        steps, histogram = predict(model, ids, prompt_len, rows)
        print(f"\n[eagle] server verify steps {meta['spec_verify_ct']} histogram "
              f"{meta.get('spec_accept_histogram')}; torch module {steps} {histogram}", flush=True)
        assert meta["spec_verify_ct"] == steps
        server_histogram = list(meta["spec_accept_histogram"])  # sglang drops trailing zeros
        assert server_histogram + [0] * (STEPS + 1 - len(server_histogram)) == histogram
        totals = [a + b for a, b in zip(totals, histogram)]
    assert sum(totals[1:]) > 0, f"no draft token was ever accepted: the comparison says little ({totals})"
    print(json.dumps({"accepted_histogram": totals}))
