"""Drafter co-training under tensor and data parallelism (needs 2 GPUs; about 2 minutes).

Each case runs an EAGLE Engine with `drafter_cotrain=True` in its own process, on SmolLM2-135M
with zero-padded heads (tp_model.py) and a random-init drafter made from it (12 heads over 4,
which 2 ranks split), CUDA graphs on:

  tp2: one replica over 2 GPUs; both TP ranks load every round at the same scheduler iteration
  dp2: two replicas on one GPU each; one trainer, fed by both, every replica loads its rounds

Every greedy held-out token after the rounds must be the target's own top choice at its position
(the target verifies every draft token). Outputs are not compared with those before the rounds: in
bf16, a different number of accepted drafts changes the verify batch's shape and can flip near-ties.
With `-s` the tests print each case's statistics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_model import widen_heads  # noqa: E402

ROUND = 4

CHILD = r'''
import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]) / "benchmark"))
from common import engine_kwargs
import sglang as sgl

def main():
    work, layout, round_size = Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    llm = sgl.Engine(**engine_kwargs(str(work / "model"), False, True, mem_fraction_static=0.4,
                                     speculative_algorithm="EAGLE", speculative_draft_model_path=str(work / "draft"),
                                     speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                                     drafter_cotrain=True, drafter_cotrain_samples_per_round=round_size,
                                     drafter_cotrain_steps=3, drafter_cotrain_lr=1e-3, **layout))
    greedy = {"temperature": 0, "max_new_tokens": 48}
    held = [[200 + 13 * i + j for j in range(24)] for i in range(4)]
    train = [[1000 + 17 * i + j for j in range(24)] for i in range(4 * round_size)]
    start = llm.get_drafter_cotrain_stats()
    before = [o["output_ids"] for o in llm.generate(input_ids=held, sampling_params=greedy, drafter_cotrain=False)]
    checked = dict(return_logprob=True, top_logprobs_num=1, drafter_cotrain=False)
    for ids in train:  # one request each: DP's round robin alternates replicas
        llm.generate(input_ids=ids, sampling_params=greedy)
    deadline = time.time() + 90
    stats = llm.get_drafter_cotrain_stats()
    while time.time() < deadline and stats["rounds"] < 1 and not stats["errors"]:
        time.sleep(0.5)
        stats = llm.get_drafter_cotrain_stats()
    outs = llm.generate(input_ids=held, sampling_params=greedy, **checked)
    gaps = [top[0][0] - chosen[0] for o in outs
            for chosen, top in zip(o["meta_info"]["output_token_logprobs"], o["meta_info"]["output_top_logprobs"])]
    same = sum(b == o["output_ids"] for b, o in zip(before, outs))
    print("RESULT " + json.dumps({"start": start, "stats": stats, "greedy_gap": max(gaps), "positions": len(gaps),
                                  "tokens": sum(len(o["output_ids"]) for o in outs), "outputs_same": same}))
    llm.shutdown()

if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory, tokenizer: Path) -> Path:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    work = tmp_path_factory.mktemp("parallel-cotrain")
    widen_heads(tokenizer, work / "model")
    subprocess.run([sys.executable, "-m", "sglang_rl.drafter", "init", "--model-path", str(work / "model"),
                    "--out", str(work / "draft")], check=True, capture_output=True, text=True)
    heads = json.loads((work / "draft" / "config.json").read_text())["num_attention_heads"]
    assert heads % 2 == 0, f"the drafter has {heads} heads, which 2 TP ranks cannot split"
    (work / "child.py").write_text(CHILD)
    return work


def _run(work: Path, layout: dict) -> dict:
    proc = subprocess.run([sys.executable, str(work / "child.py"), str(ROOT), str(work), json.dumps(layout), str(ROUND)],
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"engine {layout} failed:\n{proc.stderr[-4000:]}"
    result = json.loads(line.removeprefix("RESULT "))
    print(json.dumps({"layout": layout, **result}, indent=1)[:4000])
    return result


def assert_greedy(result: dict) -> None:
    assert result["positions"] == result["tokens"] > 0, "every held-out token must carry its logprobs"
    assert result["greedy_gap"] <= 1e-3, \
        f"a token after the rounds is {result['greedy_gap']:.4f} nats below the target's top choice"


def test_tp2_ranks_swap_each_round_together(work: Path) -> None:
    result = _run(work, {"tp_size": 2})
    stats, start = result["stats"], result["start"]
    assert stats["rounds"] >= 1 and not stats["errors"], f"no round loaded: {stats}"
    assert stats["samples"] >= ROUND, "TP rank 0 must send the rollouts"
    ranks, ranks0 = stats["tp_ranks"], start["tp_ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1] and all(not r["errors"] for r in ranks), ranks
    assert ranks[0]["loaded_rounds"] == ranks[1]["loaded_rounds"], f"TP ranks loaded different rounds: {ranks}"
    assert ranks[0]["loaded_at_forward"] == ranks[1]["loaded_at_forward"], \
        f"TP ranks swapped at different scheduler iterations: {ranks}"
    assert ranks[0]["fc_checksum"] == ranks[1]["fc_checksum"] != ranks0[0]["fc_checksum"], \
        f"both TP ranks must hold the new round's (unsharded) fc weight: {ranks} (at start {ranks0})"
    assert_greedy(result)


def test_dp2_replicas_share_one_trainer(work: Path) -> None:
    result = _run(work, {"dp_size": 2})
    stats = result["stats"]
    assert stats["dp_size"] == 2 and [r["dp_rank"] for r in stats["replicas"]] == [0, 1], stats
    assert stats["rounds"] >= 1 and not stats["errors"], f"a replica loaded no round: {stats}"
    assert all(r["samples"] > 0 for r in stats["replicas"]), \
        f"both replicas must feed the trainer: {[r['samples'] for r in stats['replicas']]}"
    assert stats["samples"] == sum(r["samples"] for r in stats["replicas"])
    assert_greedy(result)
