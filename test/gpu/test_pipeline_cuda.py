"""`FingerprintPipeline` on CUDA: a GPU server's whole path from kept rows to fingerprints (GPU).

The CPU tests run the pipeline's GPU bookkeeping with a CPU prover. Here the rows are on the
device: each step's rows are kept in the pipeline's row ring, staged and written on the proof
stream, and proven by CUDA-graph jobs that the caller's thread launches. Rows are built from
distinct magnitudes, so the device top-k has no ties to order, and every fingerprint must equal
the host proofs of the request's returned rows (which equal toploc's: test_fingerprint_proof).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_rl.fingerprint import build_chunk_proofs, decode_fingerprint
from sglang_rl.fingerprint.builder import FingerprintBuilder
from sglang_rl.fingerprint.pipeline import FingerprintPipeline
from sglang_rl.fingerprint.settings import CHUNK_ROWS, PipelineSettings

TOPK = 16
HIDDEN = 64
STRIDE = 5  # rows per request in a speculative step's block


def _distinct_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, HIDDEN] bf16 rows on the host whose magnitudes are all distinct (up to 120 rows)."""
    exponents = torch.arange(-60, 60).repeat_interleave(128)
    mantissas = torch.arange(128).repeat(120)
    pool = torch.ldexp(1 + mantissas / 128, exponents)  # exact in bf16: 7 mantissa bits
    picks = torch.randperm(pool.numel(), generator=gen)[: n * HIDDEN]
    signs = torch.randint(0, 2, (n * HIDDEN,), generator=gen) * 2 - 1
    return (pool[picks] * signs).view(n, HIDDEN).to(torch.bfloat16)


def _host_proofs(rows: torch.Tensor) -> list[bytes]:
    return build_chunk_proofs(list(rows.split(CHUNK_ROWS)), TOPK)


@pytest.mark.parametrize("small", [False, True], ids=["defaults", "small ring, 3 staged steps"])
def test_random_traffic_on_the_device_gives_the_host_proofs(small: bool) -> None:
    """Requests arrive, commit runs of 1-4 rows at the front of their blocks, finish (some cut
    inside their last run) or are aborted; finished ones are released as their jobs come back.
    Every fingerprint equals the host proofs of the returned rows, and every slot comes back."""
    device = torch.device("cuda", 0)
    posted: dict[int, str] = {}
    settings = PipelineSettings(staged_steps=3) if small else PipelineSettings()
    pipeline = FingerprintPipeline(device, settings, lambda req, fp: posted.__setitem__(id(req), fp))
    if small:
        pipeline.rings.ring_bytes = 500 * HIDDEN * 2  # staged steps wrap round it, some do not fit
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    live: list[dict] = []
    held: list[dict] = []
    for _ in range(400):
        while len(live) < 24 and rng.random() < 0.5:
            target = rng.randint(1, 120)
            live.append({"builder": FingerprintBuilder(TOPK), "target": target, "taken": 0,
                         "rows": _distinct_rows(target + 3, gen)})
        counts = [rng.choice((1, 1, 3, 4)) for _ in live]
        block = 1e4 * torch.randn(len(live) * STRIDE, HIDDEN, generator=gen)
        for n, (r, count) in enumerate(zip(live, counts)):
            block[n * STRIDE : n * STRIDE + count] = r["rows"][r["taken"] : r["taken"] + count].float()
            r["taken"] += count
        kept = pipeline.keep_rows(block.to(device, torch.bfloat16))
        torch.cuda.current_stream().synchronize()  # as sglang's result hooks wait for copy_done
        pipeline.add_builder_rows([r["builder"] for r in live], kept, TOPK, counts,
                                  [n * STRIDE for n in range(len(live))])
        ending = [r for r in live if r["taken"] >= r["target"] or rng.random() < 0.02]
        items = []
        for r in ending:
            r["req"] = SimpleNamespace(rid="r")
            r["returned"] = 0 if rng.random() < 0.2 else min(r["target"], r["taken"])
            items.append((r["builder"], r["req"], r["returned"]))
            if r["returned"]:
                held.append(r)
        pipeline.finish_builders(items)
        pipeline.release_finished()
        live = [r for r in live if r not in ending]
    pipeline.release_finished(wait=True)
    for r in live:
        r["builder"].release()
    assert len(held) > 100
    for r in held:
        fingerprint = decode_fingerprint(posted[id(r["req"])], expected_topk=TOPK)
        assert list(fingerprint.proofs) == _host_proofs(r["rows"][: r["returned"]])
    store = pipeline.store
    for future in list(store._lent):
        future.result(timeout=30)
    store.reclaim()
    store.flush()
    assert len(store._free) == store.capacity and not pipeline.pending.queue
