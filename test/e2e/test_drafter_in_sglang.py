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
from pathlib import Path

import pytest
import requests
import torch

from e2e_servers import EAGER, POOL, Prepared, Server, Spec, server_fixture
from hidden_states_fixtures import float32_model

STEPS = 3  # --speculative-num-steps: draft tokens per chain
NEW_TOKENS = 24
PROMPTS = [
    "Question: A farmer has 12 cows and buys 5 more. How many cows does he have?\nAnswer:",
    "Write a short poem about the sea.",
    "List the first five prime numbers and explain why 1 is not prime.",
]


def _greedy(model_path: str) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(prompt + greedy continuation ids, prompt length, last-layer rows) for each prompt."""
    from transformers import AutoTokenizer

    lm = float32_model(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for text in PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
        ids, feed, past = prompt[0], prompt, None
        with torch.no_grad():
            for _ in range(NEW_TOKENS):  # plain argmax, end-of-turn included (the server ignores EOS)
                step = lm(feed, past_key_values=past, use_cache=True)
                feed, past = step.logits[0, -1].argmax().view(1, 1), step.past_key_values
                ids = torch.cat([ids, feed[0]])
            rows = lm.model(ids[None]).last_hidden_state[0]
        out.append((ids, prompt.shape[1], rows))
    return out


def _train(model_path: str, greedy, folder: Path) -> Path:
    """A briefly trained drafter (drafts that are sometimes right), saved to `folder`."""
    from sglang_rl.drafter import DrafterTrainer, EagleLossConfig, init_drafter, sample_from_rows, save_drafter

    torch.manual_seed(0)
    model = init_drafter(model_path, seed=0)
    trainer = DrafterTrainer(model, lr=1e-3, loss=EagleLossConfig(soft_topk=64))
    trainer.train_steps([sample_from_rows(ids, rows, n) for ids, n, rows in greedy], 40)
    return save_drafter(model, folder, dtype="float32")


def _trained_drafter(model_path: str, workdir: Path) -> Prepared:
    """The greedy references and the drafter trained on them (what the server is started with)."""
    greedy = _greedy(model_path)
    torch.save(greedy, workdir / "greedy.pt")
    folder = _train(model_path, greedy, workdir / "trained")
    return Prepared(args=("--speculative-draft-model-path", str(folder)),
                    data={"folder": folder, "greedy": workdir / "greedy.pt"})


EAGLE_EQUIVALENCE = Spec("eagle-equivalence", (
    "--disable-radix-cache", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(STEPS),
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(STEPS + 1)), env=EAGER,
    prepare=_trained_drafter)
eagle_server = server_fixture(EAGLE_EQUIVALENCE, scope="module", doc="EAGLE with the drafter of `_train`.")


@pytest.fixture(scope="module")
def greedy() -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(prompt + greedy continuation ids, prompt length, last-layer rows) for each prompt (`_greedy`)."""
    return torch.load(POOL.prepared_data(EAGLE_EQUIVALENCE.key)["greedy"], weights_only=False)


@pytest.fixture(scope="module")
def drafter(model_path: str):
    """The drafter the server was started with (`_train`), loaded back from its folder."""
    from sglang_rl.drafter import load_drafter

    folder = POOL.prepared_data(EAGLE_EQUIVALENCE.key)["folder"]
    return folder, load_drafter(folder, model_path)


TIE_MARGIN = 0.02  # logits closer than this may flip between the server's rows and HF's (~1e-5 apart)


def predict(model, ids: torch.Tensor, prompt_len: int, rows: torch.Tensor) -> tuple[list[int], bool, int]:
    """The accepted draft tokens of each verify step of greedy EAGLE with a topk=1 chain; whether
    the last step's chain ran past the end of the known tokens (the server, which generates past
    max_new_tokens and then cuts, may accept more there); and the number of steps whose outcome
    rests on a near-tie of the drafter's logits (a draft token up to the first rejected one whose
    top two logits are within TIE_MARGIN)."""
    from sglang_rl.drafter import greedy_draft_chain

    full = ids.tolist()
    committed = prompt_len + 1  # the prefill samples the first token
    accepted, ties, open_end = [], 0, False
    while committed < len(full):
        draft = greedy_draft_chain(model, ids[:committed], rows[:committed - 1], STEPS)
        chain = draft.tokens.tolist()
        n = 0
        while n < len(chain) and committed + n < len(full) and full[committed + n] == chain[n]:
            n += 1
        open_end = committed + n == len(full) and n < len(chain)
        with torch.no_grad():
            top2 = model.logits(draft.rows[: min(n + 1, len(chain))].to(model.fc.weight)).float().topk(2).values
        ties += bool(((top2[:, 0] - top2[:, 1]) < TIE_MARGIN).any())
        accepted.append(n)
        committed += n + 1
    return accepted, open_end, ties


def histograms(accepted: list[int], open_end: bool) -> list[list[int]]:
    """The accepted-count histograms the server may report: the last step's count may be higher
    when its chain ran past the known tokens."""
    lasts = range(accepted[-1], STEPS + 1) if open_end else [accepted[-1]]
    return [[(accepted[:-1] + [last]).count(i) for i in range(STEPS + 1)] for last in lasts]


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
        accepted, open_end, ties = predict(model, ids, prompt_len, rows)
        steps, candidates = len(accepted), histograms(accepted, open_end)
        histogram = candidates[0]
        print(f"\n[eagle] server verify steps {meta['spec_verify_ct']} histogram "
              f"{meta.get('spec_accept_histogram')}; torch module {steps} {candidates}, near-ties {ties}",
              flush=True)
        server_histogram = list(meta["spec_accept_histogram"])  # sglang drops trailing zeros
        server_histogram += [0] * (STEPS + 1 - len(server_histogram))
        # exact, except that each step decided by a near-tie may go the other way on the server
        # (and move the steps after it): a wrong weight or order changes far more than that
        assert abs(meta["spec_verify_ct"] - steps) <= ties, (meta["spec_verify_ct"], steps, ties)
        distance = min(sum(abs(a - b) for a, b in zip(server_histogram, c)) for c in candidates)
        assert distance <= 2 * ties, (server_histogram, candidates, ties)
        totals = [a + b for a, b in zip(totals, histogram)]
    assert sum(totals[1:]) > 0, f"no draft token was ever accepted: the comparison says little ({totals})"
    print(json.dumps({"accepted_histogram": totals}))
