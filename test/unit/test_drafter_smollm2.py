"""The drafter on the real default target, SmolLM2-135M (tied embeddings, H=576, V=49152).

Target rows come from a transformers forward of the target over a fixed chat (its final,
post-norm hidden states: the rows sglang returns and feeds its EAGLE draft model).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from sglang_rl.drafter import (
    DrafterTrainer,
    EagleLossConfig,
    greedy_draft_chain,
    init_drafter,
    load_drafter,
    load_target_head,
    sample_from_rows,
    save_drafter,
)

CHAT = [
    {"role": "user", "content": "Explain in a few sentences why the sky is blue."},
    {"role": "assistant", "content": (
        "The sky looks blue because sunlight is scattered by the molecules in the air. Blue light "
        "has a shorter wavelength than red light, so it is scattered much more strongly. When you "
        "look at the sky away from the sun, you see this scattered blue light coming from every "
        "direction. At sunset the light travels through more air, the blue is scattered away, and "
        "the sky turns red and orange.")},
]


@pytest.fixture(scope="module")
def target(model_path: str):
    """(ids [L], rows [L, H], greedy next tokens [L], response_start) from the real target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompt = tok.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(CHAT, tokenize=False)
    assert full.startswith(prompt)
    ids = torch.tensor(tok(full, add_special_tokens=False)["input_ids"])
    response_start = len(tok(prompt, add_special_tokens=False)["input_ids"])
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = lm.model(ids[None]).last_hidden_state[0]
        greedy = lm.lm_head(rows).argmax(-1)
    return ids, rows, greedy, response_start


def test_target_head_is_the_tied_embedding(model_path: str) -> None:
    head = load_target_head(model_path)
    assert head.tied and tuple(head.embed.shape) == (49152, 576) and head.embed.dtype == torch.float32


def test_passthrough_drafter_proposes_the_greedy_token_again(model_path: str, target, tmp_path: Path) -> None:
    """The default init outputs the target row unchanged, so its first draft token is the
    target's own greedy choice and every later one repeats it (what an sglang EAGLE server
    with this folder proposes under greedy decoding)."""
    ids, rows, greedy, _ = target
    model = load_drafter(save_drafter(init_drafter(model_path), tmp_path / "draft"), model_path)
    for m in (5, 40, ids.numel() - 1):
        chain = greedy_draft_chain(model, ids[: m + 1], rows[:m], 4)
        assert chain.tokens.tolist() == [int(greedy[m - 1])] * 4
        torch.testing.assert_close(chain.rows[0], rows[m - 1])


def test_training_on_real_rows_lowers_the_loss(model_path: str, target) -> None:
    ids, rows, greedy, response_start = target
    torch.manual_seed(0)
    model = init_drafter(model_path, seed=0)
    trainer = DrafterTrainer(model, lr=1e-3, loss=EagleLossConfig(soft_topk=64))
    sample = sample_from_rows(ids, rows, response_start)
    before = trainer.evaluate([sample])
    start = time.perf_counter()
    history = trainer.train_steps([sample], 25)
    per_step = (time.perf_counter() - start) / 25
    after = trainer.evaluate([sample])
    print(f"SmolLM2 drafter: {history[0]['num_pairs']:.0f} pairs, {per_step:.2f} s/step (top-64 soft loss), "
          f"loss {before['loss']:.3f} -> {after['loss']:.3f}, "
          f"top-1 agreement {before['top1_agreement']:.2f} -> {after['top1_agreement']:.2f}")
    assert after["loss"] < 0.6 * before["loss"]
    assert after["value_loss"] < before["value_loss"]
    assert after["top1_agreement"] > before["top1_agreement"]
