"""Speculation only where it pays: sglang's `--speculative-adaptive` with co-training and TOPLOC.

sglang's adaptive EAGLE picks the number of draft steps per batch-size slot from the recent
acceptance, including 0 (no drafting: the target decodes alone, the draft's KV stays warm). Here
the slot for every batch size may choose 0 or 3 steps, and the random-init drafter accepts nothing,
so the server switches drafting off, probes it again, and switches it off again. Meanwhile the
co-training rows keep flowing and train the drafter, the target decides every token (greedy ids as
a plain server's) and the fingerprints verify on the plain server.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from e2e_servers import EAGER, Prepared, Server, Spec, server_fixture
from test_drafter_cotrain import chat, gsm8k, init_drafter, stats, wait_rounds
from toploc_helpers import assert_fingerprints_verify

PROMPTS = range(4)
ROUND = 2
# every batch size may draft 3 steps or none; the acceptance decides, looked at every 2 batches
ADAPTIVE_CONFIG = {"1": {"candidate_steps": [0, 3], "warmup_batches": 2, "update_interval": 2}}


def _drafter_and_config(model_path: str, workdir: Path) -> Prepared:
    draft = init_drafter(model_path, workdir / "d0")
    config = workdir / "adaptive.json"
    config.write_text(json.dumps(ADAPTIVE_CONFIG))
    return Prepared(args=("--speculative-draft-model-path", str(draft), "--speculative-adaptive-config", str(config)))


ADAPTIVE = Spec("cotrain-adaptive", (
    "--log-level", "info",  # sglang logs each switch of the draft steps at info
    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4", "--speculative-adaptive", "--toploc-verification",
    "--drafter-cotrain", "--drafter-cotrain-samples-per-round", str(ROUND), "--drafter-cotrain-steps", "2",
    "--drafter-cotrain-threads", "1",
), env=EAGER, prepare=_drafter_and_config)
adaptive_server = server_fixture(ADAPTIVE, scope="module",
                                 doc="Adaptive EAGLE (0 or 3 draft steps) with co-training and TOPLOC.")


def test_drafting_switches_off_and_on_while_rows_keep_training_the_drafter(adaptive_server: Server,
                                                                           toploc_server: Server) -> None:
    prompts = gsm8k()
    # two waves of one round each: samples that reach the trainer together make one round
    answers = []
    for wave in (PROMPTS[:ROUND], PROMPTS[ROUND:]):
        before = stats(adaptive_server.url)["rounds"]
        with ThreadPoolExecutor(ROUND) as pool:
            answers += pool.map(lambda i: chat(adaptive_server.url, prompts[i]), wave)
        # the rows of every request reached the trainer, drafting on or off, and trained it
        wait_rounds(adaptive_server.url, before + 1)
    log = adaptive_server.log_path.read_text(errors="replace")
    assert "Switch adaptive runtime state: steps 3 -> 0" in log, log[-3000:]
    assert "Switch adaptive runtime state: steps 0 -> 3" in log, log[-3000:]

    trained = stats(adaptive_server.url)
    assert trained["trainer_alive"] and not trained["errors"], trained
    assert trained["trainer_received"] >= len(PROMPTS) and all(v > 0 for v in trained["loss"]), trained

    # the target decides every token, and the fingerprints verify without speculative decoding
    messages = [a["choices"][0]["message"] for a in answers]
    with ThreadPoolExecutor(4) as pool:
        plain = list(pool.map(lambda i: chat(toploc_server.url, prompts[i]), PROMPTS))
    assert [m["output_ids"] for m in messages] == [p["choices"][0]["message"]["output_ids"] for p in plain]
    assert_fingerprints_verify(toploc_server.url, messages)
