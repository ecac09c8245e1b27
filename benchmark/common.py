"""Helpers shared by the benchmark scripts: model folders and timed Engine runs."""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

# the EAGLE chain every benchmark serves: 3 draft steps, top-1, 4 draft tokens per verify step
EAGLE = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
             speculative_num_draft_tokens=4)

LLAMA_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def make_dummy_8b(target: Path, tokenizer_dir: Path) -> Path:
    """A Llama-3.1-8B-shaped folder (config + the SmolLM2 tokenizer) for --load-format dummy."""
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(LLAMA_8B_SHAPE))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = tokenizer_dir / name
        if src.exists():
            (target / name).write_bytes(src.read_bytes())
    return target


def model_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: which model, random weights, CPU instead of GPU."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="model folder (default: the converted SmolLM2)")
    p.add_argument("--dummy", action="store_true", help="random weights from config.json (--load-format dummy)")
    p.add_argument("--cpu", action="store_true")
    return p


def parse_with_model(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the arguments; without --model-path, use (and if needed convert) the default model."""
    args = p.parse_args()
    if args.model_path is None:
        from sglang_rl.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    return args


def random_prompts(n: int, length: int, seed: int = 0, low: int = 100, high: int = 49000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(low, high) for _ in range(length)] for _ in range(n)]


def engine_kwargs(model_path: str, dummy: bool, gpu: bool, **extra) -> dict:
    kw = dict(model_path=model_path, log_level="error")
    if dummy:
        kw["load_format"] = "dummy"
    if gpu:
        # prefill CUDA graphs are compiled at every start (minutes for a small model); decode's stay on
        kw.update(attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.8,
                  cuda_graph_backend_prefill="disabled")
    else:
        kw.update(device="cpu", attention_backend="torch_native", dtype="float32", max_total_tokens=16384)
    kw.update(extra)
    return kw


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)) + " |")


def on_gpu() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") != "1"


def run_in_subprocesses(script: str, argv: list[str], flag: str, values: list[str]) -> list:
    """Run `script argv flag value` once per value (a fresh Engine each) and collect the JSON
    printed after `RESULT ` by each; exits with the child's output if one fails. Each result is
    also printed as it arrives, so a run cut short by a time limit keeps what it measured."""
    import subprocess
    import sys

    results = []
    for n, value in enumerate(values, 1):
        out = subprocess.run([sys.executable, script, flag, value] + argv, capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(out.stdout[-3000:], out.stderr[-6000:])
            raise SystemExit(f"{flag} {value} failed")
        print(f"# process {n}/{len(values)} ({flag} {value}): {line[-1]}", flush=True)
        results.append(json.loads(line[-1][len("RESULT "):]))
    return results


def stop_process_group(proc, grace_s: float) -> None:
    """SIGTERM to the process group a bench started (start_new_session), SIGKILL after grace_s."""
    import signal
    import subprocess

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
