"""The host-side cost of FULL hidden-state rows, without a model: what the scheduler thread spends
storing one batch's rows (prefill, then every decode step) and what the API process spends
delivering them. Rows are random bf16 tensors of an 8B model's width; no GPU, no server.

    python benchmark/bench_row_path.py                      # 64 requests, 128 and 512 tokens
    python benchmark/bench_row_path.py --tokens 512 --format base64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402


def _store(requests: int, tokens: int, hidden: int, fmt: str) -> tuple[list, dict]:
    """Prompt and output of `tokens` each for `requests` fresh requests: store every row as the
    scheduler hooks do and finish them. Returns the delivery payloads and the timings."""
    from sglang_rl.adapters.hidden_states import PAYLOAD_KEY, RowCollector, add_decode_rows
    from sglang_rl.hidden_states import HiddenStatesFormat, HiddenStatesMode, HiddenStatesOptions, HiddenStatesScope

    opts = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat(fmt), scope=HiddenStatesScope.ALL)
    collectors = [RowCollector(opts, tokens, tokens) for _ in range(requests)]
    prompt_rows = torch.randn(requests * tokens, hidden).to(torch.bfloat16)
    step_rows = torch.randn(requests, hidden).to(torch.bfloat16)

    t = time.perf_counter()
    for i, c in enumerate(collectors):
        c.add_prefill(prompt_rows[i * tokens:(i + 1) * tokens], last_chunk=True)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for s in range(tokens):
        add_decode_rows([(c, i, 1, tokens + s) for i, c in enumerate(collectors)], step_rows)
    decode = time.perf_counter() - t
    t = time.perf_counter()
    payloads = [c.finish(output_len=tokens)[PAYLOAD_KEY] for c in collectors]
    finish = time.perf_counter() - t
    return payloads, {"prefill_ms": round(prefill * 1e3), "decode_ms_per_step": round(decode / tokens * 1e3, 3),
                      "finish_ms": round(finish * 1e3)}


def measure(requests: int, tokens: int, hidden: int, fmt: str) -> dict:
    """Store and deliver one batch's rows; then store them again and deliver them the way the API
    adapter does for a batch request: every output in a worker thread, all at once."""
    from sglang_rl.adapters.hidden_states import deliver

    payloads, row = _store(requests, tokens, hidden, fmt)
    t = time.perf_counter()
    for p in payloads:
        deliver(p)
    delivered = time.perf_counter() - t
    payloads, _ = _store(requests, tokens, hidden, fmt)

    async def deliver_all() -> None:
        await asyncio.gather(*(asyncio.to_thread(deliver, p) for p in payloads))

    t = time.perf_counter()
    asyncio.run(deliver_all())
    threaded = time.perf_counter() - t
    return {"shape": f"{requests}x{tokens}x{tokens}", "format": fmt, **row,
            "deliver_ms": round(delivered * 1e3), "deliver_threads_ms": round(threaded * 1e3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512], help="prompt = output tokens")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--format", nargs="+", default=["tensor", "base64"], choices=["tensor", "base64", "list"])
    args = p.parse_args()
    rows = [measure(args.requests, n, args.hidden, fmt) for n in args.tokens for fmt in args.format]
    print(f"\nHost-side row path, {args.requests} requests, bf16 rows of width {args.hidden}")
    print(f"deliver_threads_ms: all outputs at once through asyncio.to_thread, as the API adapter does "
          f"for a batch request (default executor, {min(32, (os.cpu_count() or 1) + 4)} threads)")
    print_table(rows, ["shape", "format", "prefill_ms", "decode_ms_per_step", "finish_ms", "deliver_ms",
                       "deliver_threads_ms"])


if __name__ == "__main__":
    main()
