"""SmolLM2-135M widened (sglang_rl.widen) against SmolLM2 itself, through plain transformers forwards.

The wide shape widens every dimension: hidden 576 -> 1152 (the default 'copies' layout: one exact
copy of the stream), 9 -> 12 query heads (3 -> 4 per KV group), 3 -> 4 KV heads, head dim 64 -> 128
(rotary pair i -> 2i, queries x sqrt 2), MLP 1536 -> 1600, 30 -> 31 layers. Weights are written in
float32; both models run in float64, so what is compared is the construction, not the order of
float32 sums (in float32 the two forwards differ by up to ~1e-4 on logits of ~38 by that alone).

Drafters: an EAGLE-1/2 and an EAGLE3 drafter of SmolLM2, briefly trained here on GSM8K prompt text,
widened by ``sglang-rl drafter widen``; their acceptance on held-out greedy answers is replayed as
sglang's greedy chain (3 draft steps) would accept it (sglang_rl.widen.replay).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_rl.datasets import gsm8k_path
from sglang_rl.drafter import DrafterTrainer, EagleLossConfig, init_drafter, load_drafter, sample_from_rows, save_drafter
from sglang_rl.drafter.eagle3 import init_eagle3, save_eagle3
from sglang_rl.widen import Shape, widen_model
from sglang_rl.widen.cli import drafter_main
from sglang_rl.widen.replay import acceptance, draft_tokens, replay_histogram

WIDE = Shape(hidden_size=1152, num_attention_heads=12, num_key_value_heads=4, head_dim=128, intermediate_size=1600,
             num_hidden_layers=31)
HELD_OUT = [0, 1]  # GSM8K prompts answered (greedy) and drafted on
TRAIN = list(range(10, 18))  # GSM8K prompts whose text trains the drafters
AUX = [1, 14, 26]  # EAGLE3 aux layers: sglang's default for a 30-layer target
ANSWER_TOKENS = 32
STEPS = 3


def chats(indices: list[int]) -> list[list[dict]]:
    with open(gsm8k_path()) as f:
        lines = f.readlines()
    return [json.loads(lines[i])["messages"] for i in indices]


@pytest.fixture(scope="module")
def tok(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def wide_path(model_path: str, tmp_path_factory) -> Path:
    return widen_model(model_path, tmp_path_factory.mktemp("widen") / "wide", WIDE, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def small(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def wide(wide_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(wide_path, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def answers(small, tok) -> list[tuple[torch.Tensor, int]]:
    """(prompt + SmolLM2's greedy answer ids, prompt length) for the held-out prompts."""
    out = []
    for chat in chats(HELD_OUT):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            full = small.generate(ids, max_new_tokens=ANSWER_TOKENS, min_new_tokens=ANSWER_TOKENS, do_sample=False)
        out.append((full[0], ids.shape[1]))
    return out


@torch.no_grad()
def forward(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits, post-norm rows (EAGLE-1/2 features) and aux-layer outputs (EAGLE3 features)."""
    out = model(ids[None], output_hidden_states=True)
    hidden = out.hidden_states  # the embeddings, then each layer's output (the last one normed)
    return {"logits": out.logits[0], "rows": hidden[-1][0], "aux": torch.cat([hidden[i + 1][0] for i in AUX], -1)}


@pytest.fixture(scope="module")
def passes(small, wide, answers) -> dict[str, list[dict]]:
    """One forward of each model over each held-out answer."""
    return {name: [forward(model, ids) for ids, _ in answers] for name, model in (("small", small), ("wide", wide))}


def test_widened_smollm2_gives_its_logits_and_greedy_answers(passes, answers) -> None:
    for n, ((ids, prompt_len), s, w) in enumerate(zip(answers, passes["small"], passes["wide"])):
        want, got = s["logits"], w["logits"]
        diff = (got - want).abs().max().item()
        print(f"prompt {n}: {ids.numel()} tokens, largest logit {want.abs().max():.1f}, largest difference {diff:.2e}")
        assert diff <= 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))  # the same next token everywhere
        # the wide model's greedy choice after every answer prefix is SmolLM2's answer token
        assert torch.equal(got[prompt_len - 1:-1].argmax(-1), ids[prompt_len:])


def train_samples(model, tok) -> dict[str, list]:
    """EAGLE-1/2 and EAGLE3 training samples from the target's rows over GSM8K prompt text."""
    samples: dict[str, list] = {"eagle": [], "eagle3": []}
    for chat in chats(TRAIN):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"][0]
        out = forward(model, ids)
        samples["eagle"].append(sample_from_rows(ids, out["rows"].float(), 1))
        samples["eagle3"].append(sample_from_rows(ids, out["aux"].float(), 1))
    return samples


@pytest.fixture(scope="module")
def drafters(model_path: str, small, tok, tmp_path_factory) -> dict[str, Path]:
    """Small EAGLE-1/2 and EAGLE3 drafters, trained briefly (float32), saved as folders."""
    root = tmp_path_factory.mktemp("drafters")
    samples = train_samples(small, tok)
    torch.manual_seed(0)
    eagle = init_drafter(model_path, seed=0)
    DrafterTrainer(eagle, lr=1e-3, loss=EagleLossConfig(soft_topk=64), full_vocab_metrics=False).train_steps(
        samples["eagle"], 10)
    save_drafter(eagle, root / "eagle", "float32")
    counts = torch.zeros(small.config.vocab_size)
    for sample in samples["eagle"]:
        counts += torch.bincount(sample.input_ids, minlength=counts.numel())
    cfg, tensors = init_eagle3(model_path, 2048, counts.tolist(), seed=0)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    save_eagle3(root / "eagle3-init", cfg, tensors)
    eagle3 = load_drafter(root / "eagle3-init", model_path)
    DrafterTrainer(eagle3, lr=1e-3).train_steps(samples["eagle3"], 10)
    save_drafter(eagle3, root / "eagle3", "float32")
    return {"eagle": root / "eagle", "eagle3": root / "eagle3"}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_widened_drafter_keeps_its_acceptance(kind: str, model_path: str, wide_path: Path, passes, answers,
                                              drafters, tmp_path: Path) -> None:
    wide_draft = tmp_path / f"{kind}-wide"
    assert drafter_main(["--drafter-path", str(drafters[kind]), "--model-path", str(wide_path),
                         "--out", str(wide_draft)]) == 0
    feature = "aux" if kind == "eagle3" else "rows"
    result, drafts = {}, {}
    for name, folder, target_dir in (("small", drafters[kind], model_path), ("wide", wide_draft, wide_path)):
        drafter = load_drafter(folder, target_dir)
        hists, drafts[name] = [], []
        for (ids, prompt_len), out in zip(answers, passes[name]):
            d = draft_tokens(drafter, ids, out[feature].float(), STEPS, start=prompt_len - 1)
            drafts[name].append(d[:, prompt_len - 1:])
            hists.append(replay_histogram(d, ids, prompt_len))
        result[name] = acceptance(hists, STEPS)
    same = sum(int((a == b).sum()) for a, b in zip(drafts["small"], drafts["wide"]))
    total = sum(a.numel() for a in drafts["small"])
    print(f"{kind}: small pair {result['small']}, widened pair {result['wide']}, drafts equal {same}/{total}")
    assert result["small"]["tokens_per_step"] > 1.05  # the briefly trained drafter is accepted at times
    assert abs(result["wide"]["tokens_per_step"] - result["small"]["tokens_per_step"]) <= 0.05
    assert same >= 0.99 * total
