"""The sampled objective on the real default target, SmolLM2-135M: training with it raises the
expected sampled acceptance sum_x min(p_T, q_T) on held-out rows.

Rows come from a transformers forward of the target over fixed chats (its final rows, the ones
sglang feeds its EAGLE draft model); one chat trains, another is held out. At this scale (one
training sequence, 30 steps) the greedy objective raises it as much or more (greedy +0.12,
sampled +0.09 at T = 1); on 32 sampled GSM8K rollouts the sampled objective raises it more
(benchmark/bench_drafter_sampled.py, docs/cotrain.md), which is too slow for a unit test.
"""

from __future__ import annotations

import pytest
import torch

from sglang_rl.drafter import DrafterTrainer, EagleLossConfig, build_eagle_batch, init_drafter, sample_from_rows
from sglang_rl.drafter.sampled import acceptance_metrics
from test_drafter_smollm2 import CHAT

TRAIN = CHAT  # test_drafter_smollm2's chat
HELD_OUT = [
    {"role": "user", "content": "Why do leaves change colour in autumn?"},
    {"role": "assistant", "content": (
        "In autumn the days get shorter and colder, so trees stop making chlorophyll, the green "
        "pigment that captures sunlight. As the chlorophyll breaks down, the yellow and orange "
        "pigments that were hidden in the leaf become visible. Some trees also make red pigments "
        "in the autumn, which is why the forest turns red, orange and yellow.")},
]
T = 1.0


@pytest.fixture(scope="module")
def rows(model_path: str):
    """(train sample, held-out sample, target head) from the real target's final rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def sample(chat):
        prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor(tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            hidden = lm.model(ids[None]).last_hidden_state[0]
        return sample_from_rows(ids, hidden, len(tok(prompt, add_special_tokens=False)["input_ids"]))

    return sample(TRAIN), sample(HELD_OUT), lm.lm_head.weight.detach()


@torch.no_grad()
def held_out_acceptance(model, sample, head: torch.Tensor) -> float:
    """Mean sum min(p_T, q_T) of draft step 1 over the held-out response pairs (full vocabulary)."""
    batch = build_eagle_batch([sample])
    keep = batch["loss_mask"][0] > 0
    pred = model(batch["input_ids"][0], batch["hidden_states"][0].float(), batch["position_ids"][0], batch["cu_seqlens"])
    target = batch["target"][0].float()[keep] @ head.T
    return acceptance_metrics(target, model.logits(pred[keep]), T)["sampled"]


def test_sampled_objective_raises_held_out_sampled_acceptance(model_path: str, rows) -> None:
    train, held, head = rows
    model = init_drafter(model_path, seed=0)
    before = held_out_acceptance(model, held, head)
    trainer = DrafterTrainer(model, lr=1e-3, loss=EagleLossConfig(soft_topk=256, objective="sampled", temperature=T))
    history = trainer.train_steps([train], 30)
    after = held_out_acceptance(model, held, head)
    print(f"\n[sampled] held-out sum min(p, q) at T={T}: {before:.4f} -> {after:.4f}", flush=True)
    assert history[-1]["tv_loss"] < history[0]["tv_loss"]
    assert after > before + 0.03, (before, after)
