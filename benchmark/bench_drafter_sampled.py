"""Held-out drafter acceptance at sampling temperatures, greedy vs sampled training objective (CPU).

SmolLM2 answers GSM8K prompts by sampling (temperature --rollout-temperature, as an RL rollout
does); a transformers forward over each prompt + answer gives the target's rows (final rows for
EAGLE-1/2, [aux | final] rows for EAGLE3). The first --train prompts' rows train one drafter per
objective from the same initial weights, the same steps and batches:

* ``greedy``: today's loss (EAGLE-1/2: regression + 0.1 x soft cross-entropy; EAGLE3: cross-entropy
  against the sampled token);
* ``sampled@T``: the same plus the TV loss ``1 - sum min(p_T, q_T)`` at temperature T.

On the held-out prompts' rows it reports, for draft step 1 (teacher-forced) and the chained steps
2..--eval-steps (the drafter's own rows fed back, as serving does), the mean per pair of:

* ``sampled@T``: ``sum min(p_T, q_T)``, the acceptance of a draft sampled from the drafter;
* ``target_only@T``: ``p_T(argmax q)``, the acceptance of sglang's verify (its drafts are the
  draft's top tokens, accepted with the target's probability);
* ``greedy``: ``argmax q == argmax p``, the acceptance under greedy decoding.

Prints a table and writes JSON (--out). No server, no GPU:
    nice -n 10 .venv/bin/python benchmark/bench_drafter_sampled.py --out /tmp/sampled.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sglang_rl.drafter import DrafterTrainer, EagleLossConfig, build_eagle_batch, init_drafter, sample_from_rows
from sglang_rl.drafter.eagle3 import init_eagle3, save_eagle3
from sglang_rl.drafter.eagle3_model import load_eagle3_drafter
from sglang_rl.drafter.sampled import acceptance_metrics
from sglang_rl.drafter.target_weights import load_target_head
from sglang_rl.drafter.unroll import unroll_valid, unrolled_predictions


def rollouts(model_path: str, n: int, max_new: int, temperature: float, batch: int, seed: int) -> list:
    """``n`` sampled GSM8K answers as (ids [L], response_start, final rows [L, H], aux rows [L, 3H])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_rl.datasets import gsm8k_path
    from sglang_rl.drafter.eagle3 import default_aux_layer_ids

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    aux_ids = default_aux_layer_ids(lm.config.num_hidden_layers)
    with open(gsm8k_path()) as f:
        chats = [json.loads(line)["messages"] for line in f][:n]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    torch.manual_seed(seed)
    out = []
    for start in tqdm(range(0, n, batch), desc="rollouts"):
        enc = tok(prompts[start:start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = lm.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        width = enc["input_ids"].shape[1]
        for i in range(gen.shape[0]):
            prompt = enc["input_ids"][i][enc["attention_mask"][i].bool()]
            answer = gen[i, width:].tolist()
            if tok.eos_token_id in answer:
                answer = answer[:answer.index(tok.eos_token_id) + 1]
            ids = torch.cat((prompt, torch.tensor(answer, dtype=torch.long)))
            with torch.no_grad():
                outputs = lm.model(ids[None], output_hidden_states=True)
            # sglang's EAGLE3 capture of layer i is that layer's output (hidden_states[i + 1] here)
            aux = torch.cat([outputs.hidden_states[i + 1][0] for i in aux_ids], dim=-1)
            out.append((ids, prompt.numel(), outputs.last_hidden_state[0], aux))  # final: post-norm rows
    return out


def make_samples(data: list, eagle3: bool) -> list:
    return [sample_from_rows(ids, torch.cat((aux, final), -1) if eagle3 else final, start)
            for ids, start, final, aux in data]


def new_drafter(kind: str, model_path: str, train: list, draft_vocab: int, folder: Path):
    if kind == "eagle":
        return init_drafter(model_path, seed=0)
    counts = torch.zeros(load_target_head(model_path).embed.shape[0])
    for ids, *_ in train:
        counts.index_add_(0, ids, torch.ones(ids.numel()))
    cfg, tensors = init_eagle3(model_path, draft_vocab, counts + 1e-3, seed=0)
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    return load_eagle3_drafter(save_eagle3(folder, cfg, tensors), model_path)


def train(kind: str, objective: str, temperature: float, data: list, args: argparse.Namespace, folder: Path):
    model = new_drafter(kind, args.model_path, data, args.draft_vocab, folder)
    head = load_target_head(args.model_path).lm_head
    loss = EagleLossConfig(soft_topk=args.soft_topk if kind == "eagle" else None, objective=objective,
                           temperature=temperature, tv_weight=args.tv_weight, prob_weight=args.prob_weight)
    trainer = DrafterTrainer(model, lr=args.lr, loss=loss, unroll_steps=args.unroll_steps, target_head=head)
    samples = make_samples(data, kind == "eagle3")
    random.Random(0).shuffle(samples)
    groups = [samples[i:i + args.samples_per_step] for i in range(0, len(samples), args.samples_per_step)]
    batches = [b for g in groups for b in trainer.as_batches(g)]
    start = time.perf_counter()
    for _ in tqdm(range(args.steps), desc=f"{kind} {objective}@{temperature:g}"):
        trainer.train_steps(batches[trainer.steps_done % len(batches)], 1)
    return model, time.perf_counter() - start


@torch.no_grad()
def evaluate(model, kind: str, data: list, head: torch.Tensor, temperatures: list[float], steps: int) -> list[dict]:
    """Per draft step: the pair-weighted mean of :func:`acceptance_metrics` over held-out rows."""
    model.eval()
    eagle3 = kind == "eagle3"
    hot = model.to_target_ids(torch.arange(model.draft_vocab_size)) if eagle3 else None
    sums = [dict() for _ in range(steps)]
    counts = [0] * steps
    for sample in make_samples(data, eagle3):
        batch = build_eagle_batch([sample])
        if batch is None:
            continue
        ids, rows = batch["input_ids"][0], batch["hidden_states"][0].float()
        nxt, mask, pos, cu = batch["target"][0].float(), batch["loss_mask"][0], batch["position_ids"][0], batch["cu_seqlens"]
        width = model.feature_width
        preds = unrolled_predictions(model, ids, rows[:, :width], pos, cu, steps)
        target_logits = F.linear(nxt[:, -head.shape[1]:], head)
        for j, pred in enumerate(preds):
            keep = (mask * unroll_valid(cu, ids.numel(), j)) > 0
            m = int(keep.sum())
            if not m:
                continue
            draft_logits = model.logits(pred[keep]).float()
            for t in temperatures:
                got = acceptance_metrics(target_logits[keep], draft_logits, t, hot)
                for key in ("sampled", "target_only"):
                    sums[j][f"{key}@{t:g}"] = sums[j].get(f"{key}@{t:g}", 0.0) + got[key] * m
                sums[j]["greedy"] = sums[j].get("greedy", 0.0) + got["greedy"] * m / len(temperatures)
            counts[j] += m
    return [{k: round(v / c, 4) for k, v in s.items()} | {"pairs": c} for s, c in zip(sums, counts)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="target folder (default: the converted SmolLM2)")
    p.add_argument("--kinds", default="eagle,eagle3", help="drafter kinds, comma-separated (eagle, eagle3)")
    p.add_argument("--train", type=int, default=48, help="GSM8K prompts whose rows train")
    p.add_argument("--held-out", type=int, default=16, help="the next prompts, whose rows evaluate")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rollout-temperature", type=float, default=1.0)
    p.add_argument("--objectives", default="greedy,sampled@1.0,sampled@0.7",
                   help="objectives to train: greedy, sampled@T (comma-separated)")
    p.add_argument("--eval-temperatures", default="1.0,0.7")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--samples-per-step", type=int, default=8)
    p.add_argument("--soft-topk", type=int, default=256, help="EAGLE-1/2 soft vocabulary (top-N target tokens)")
    p.add_argument("--tv-weight", type=float, default=1.0)
    p.add_argument("--prob-weight", type=float, default=0.1, help="EAGLE-1/2 soft cross-entropy weight")
    p.add_argument("--unroll-steps", type=int, default=1)
    p.add_argument("--eval-steps", type=int, default=2, help="draft steps evaluated (chained)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="EAGLE3 draft vocabulary")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows-cache", help="file of the rollouts' rows: read if it exists, else written")
    p.add_argument("--out", help="JSON file for the results")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_path is None:
        from sglang_rl.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    cache = Path(args.rows_cache) if args.rows_cache else None
    if cache is not None and cache.is_file():
        data = torch.load(cache)
    else:
        data = rollouts(args.model_path, args.train + args.held_out, args.max_new_tokens, args.rollout_temperature,
                        8, seed=0)
        if cache is not None:
            torch.save(data, cache)
    if len(data) < args.train + args.held_out:
        raise SystemExit(f"{cache} holds {len(data)} rollouts, fewer than --train + --held-out")
    train_data, held = data[:args.train], data[args.train:]
    head = load_target_head(args.model_path).lm_head
    temps = [float(t) for t in args.eval_temperatures.split(",")]
    results = []
    import tempfile

    for kind in args.kinds.split(","):
        for spec in args.objectives.split(","):
            objective, _, t = spec.partition("@")
            with tempfile.TemporaryDirectory() as tmp:
                model, seconds = train(kind, objective, float(t or 1.0), train_data, args, Path(tmp) / "draft")
            for step, row in enumerate(evaluate(model, kind, held, head, temps, args.eval_steps), start=1):
                results.append({"kind": kind, "objective": spec, "draft_step": step, "train_s": round(seconds, 1), **row})
                print(json.dumps(results[-1]), flush=True)
    cols = ["kind", "objective", "draft_step", *[f"{k}@{t:g}" for t in temps for k in ("sampled", "target_only")],
            "greedy", "pairs"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
