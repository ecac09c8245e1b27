"""Co-training on one CPU server with `--tp-size 2 --dp-size 2` (four schedulers, gloo) and an
EAGLE3 drafter: one trainer for both replicas, rows from TP rank 0 of each, every TP rank swapping
in each round at the same scheduler iteration, statistics per replica and in total. The drafter's
own LM head is split over the TP ranks by vocabulary, and each rank loads its rows of a pushed head
and of every round. (Start-up refusals of bad parallel options: test/unit/test_cotrain_parallel.py;
EAGLE-1 co-training with a soft top-k loss on one scheduler: test_drafter_cotrain.py.)"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from e2e_servers import EAGER, Prepared, Spec, server_fixture
from test_draft_weight_update import payload
from test_drafter_cotrain_eagle3 import DRAFT_VOCAB, _eagle3_drafter

ROUND = 4
FLAGS = ("--tp-size", "2", "--dp-size", "2", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--drafter-cotrain",
         "--drafter-cotrain-samples-per-round", str(ROUND), "--drafter-cotrain-steps", "3",
         "--drafter-cotrain-lr", "1e-3", "--drafter-cotrain-threads", "1")
# sglang's CPU backend wants one core list per TP rank
BIND = {"SGLANG_CPU_OMP_THREADS_BIND": f"0|{min(1, (os.cpu_count() or 1) - 1)}"}


def _split_heads_eagle3(model_path: str, workdir: Path) -> Prepared:
    """An EAGLE3 drafter whose attention splits over 2 ranks: SmolLM2's 9 heads of 64 do not, so
    the same weights are read as 6 heads of 96 with 2 key/value heads (every tensor keeps its shape)."""
    draft = Path(_eagle3_drafter(model_path, workdir).args[1])
    config = json.loads((draft / "config.json").read_text())
    config.update(num_attention_heads=6, num_key_value_heads=2, head_dim=96)
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    return Prepared(args=("--speculative-draft-model-path", str(draft)))


# one server for both modules' checks: an EAGLE3 TP-only server took another 84 s start of 2 schedulers
PARALLEL = Spec("cotrain-eagle3-tp2-dp2", FLAGS, env={**EAGER, **BIND}, prepare=_split_heads_eagle3,
                polls_when_idle=True)
parallel_server = server_fixture(PARALLEL, scope="module", doc="tp 2 x dp 2 EAGLE3 co-training server (4 schedulers).")


def _stats(url: str) -> dict:
    got = requests.get(url + "/drafter_cotrain_stats", timeout=60)
    assert got.status_code == 200, got.text
    return got.json()


def _chat(url: str, i: int) -> dict:
    got = requests.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": f"Count from {i} to {i + 30}, one number a line."}],
        "max_tokens": 24, "temperature": 0})
    assert got.status_code == 200, got.text
    return got.json()


def _train_a_round(url: str) -> dict:
    """Three rounds' worth of chats, then the statistics once every replica has loaded a round."""
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _chat(url, i), range(3 * ROUND)))
    deadline = time.time() + 180
    while time.time() < deadline:
        now = _stats(url)
        if now["rounds"] >= 1 or now["errors"]:
            break
        time.sleep(0.5)
    assert now["rounds"] >= 1 and not now["errors"], f"no round loaded by every replica: {now}"
    return now


def _replica_ranks(stats: dict) -> list[list[dict]]:
    """Each replica's TP ranks (rank order), none with an error."""
    assert stats["dp_size"] == 2 and [r["dp_rank"] for r in stats["replicas"]] == [0, 1], stats
    out = []
    for r in stats["replicas"]:
        ranks = r["tp_ranks"]
        assert [t["tp_rank"] for t in ranks] == [0, 1] and all(not t["errors"] for t in ranks), ranks
        out.append(ranks)
    return out


def test_eagle3_tp_ranks_each_load_their_rows_of_a_pushed_head(parallel_server, model_path: str) -> None:
    """Before any round: a pushed head reaches every replica, each TP rank keeping its vocabulary half."""
    url = parallel_server.url
    assert _stats(url)["rounds"] == 0
    hidden = json.loads((Path(model_path) / "config.json").read_text())["hidden_size"]
    # a head whose vocabulary halves differ: rank 0 holds ids 0..2047 of the draft vocabulary, rank 1 the rest
    head = torch.randn(DRAFT_VOCAB, hidden, generator=torch.Generator().manual_seed(3)) * 0.02
    head[DRAFT_VOCAB // 2:] += 0.01
    body = payload([("lm_head.weight", head)])
    pushed = requests.post(url + "/update_draft_weights_from_tensor", timeout=120,
                           json={"serialized_named_tensors": [body, body]})  # one payload per TP rank
    assert pushed.status_code == 200 and pushed.json()["success"], pushed.text
    halves = [float(h.double().sum()) for h in head.split(DRAFT_VOCAB // 2)]
    for ranks in _replica_ranks(_stats(url)):
        for rank, want in zip(ranks, halves):
            assert abs(rank["head_shard_checksum"] - want) < 1e-6 * max(1.0, abs(want)), (ranks, halves)


def test_tp_dp_server_cotrains_one_drafter(parallel_server) -> None:
    url = parallel_server.url
    start = _stats(url)
    assert start["trainer_alive"] and start["rounds"] == 0, start
    checks0 = {i: [t["fc_checksum"] for t in ranks] for i, ranks in enumerate(_replica_ranks(start))}
    heads0 = {i: [t["head_shard_checksum"] for t in ranks] for i, ranks in enumerate(_replica_ranks(start))}

    now = _train_a_round(url)  # the DP controller sends the requests to both replicas

    replicas = now["replicas"]
    assert all(r["samples"] > 0 for r in replicas), "each replica's TP rank 0 sends its rollouts: " + \
        str([r["samples"] for r in replicas])
    assert now["samples"] == sum(r["samples"] for r in replicas)
    tokens = sum(sum(r["acceptance_tokens"]) for r in replicas)
    assert now["acceptance_tokens_total"] == tokens > 0
    for i, ranks in enumerate(_replica_ranks(now)):
        assert ranks[0]["loaded_rounds"] == ranks[1]["loaded_rounds"] != [], \
            f"replica {i}: TP ranks loaded different rounds: {ranks}"
        assert ranks[0]["loaded_at_forward"] == ranks[1]["loaded_at_forward"], \
            f"replica {i}: TP ranks swapped at different iterations: {ranks}"
        assert ranks[0]["fc_checksum"] == ranks[1]["fc_checksum"] != checks0[i][0], \
            f"replica {i}: TP ranks do not both hold the new round: {ranks} (at start {checks0})"
        for rank, before in zip(ranks, heads0[i]):  # the round's head reached both vocabulary halves
            assert rank["head_shard_checksum"] != before, (i, ranks, heads0)
    # one trainer: a round has one loss, whichever replica loaded it
    losses = [dict(zip(r["tp_ranks"][0]["loaded_rounds"], r["loss"])) for r in replicas]
    common = set(losses[0]) & set(losses[1])
    assert common and all(losses[0][n] == losses[1][n] for n in common), losses
    assert max(r["trainer_received"] for r in replicas) >= ROUND
