"""The speculation switch (`--speculative-switch`) under concurrent requests, with every feature on.

The break-even table asks 2.5 tokens per verify step at every batch size and the random-init
drafter accepts far less, so each probe (one measured drafting step every 6 plain steps) finds drafting
does not pay and the switch turns it off again: it flips every few steps. Meanwhile greedy
answers equal a plain server's (the target decides every token, drafting or not), fingerprints
verify on the `toploc` server (no speculation), hidden-state rows equal a transformers prefill
of prompt + response, the co-training rows keep reaching the trainer and train the drafter, and
the switch's state is in /get_server_info and /metrics.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from e2e_servers import EAGER, Prepared, Server, Spec, server_fixture
from hidden_states_fixtures import HFReference, check_response, generate, hs_fields
from test_drafter_cotrain import chat, gsm8k, init_drafter, stats, wait_rounds
from toploc_helpers import assert_fingerprints_verify

PROMPTS = range(4)
ROUND = 2
TABLE = {"description": "drafting would need 2.5 tokens per step", "break_even_tokens_per_step": {"1": 2.5, "16": 2.5}}


def _drafter_and_table(model_path: str, workdir: Path) -> Prepared:
    draft = init_drafter(model_path, workdir / "d0")
    table = workdir / "switch_table.json"
    table.write_text(json.dumps(TABLE))
    return Prepared(args=("--speculative-draft-model-path", str(draft), "--speculative-switch-table", str(table)))


SWITCH = Spec("speculation-switch", (
    "--log-level", "info",  # the switch logs at start-up whether off steps replay a graph
    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4", "--speculative-switch", "--speculative-switch-probe-interval", "6",
    "--speculative-switch-probe-steps", "1", "--speculative-switch-window", "2",
    "--speculative-switch-probe-backoff", "1", "--speculative-switch-probe-reach", "10", "--toploc-verification",
    "--enable-return-hidden-states", "--enable-metrics",
    "--drafter-cotrain", "--drafter-cotrain-samples-per-round", str(ROUND), "--drafter-cotrain-steps", "2",
    "--drafter-cotrain-threads", "1",
), env=EAGER, prepare=_drafter_and_table)
switch_server = server_fixture(SWITCH, scope="module",
                               doc="EAGLE with the speculation switch flipping every few steps, co-training and TOPLOC.")


def switch_state(url: str) -> dict:
    resp = requests.get(url + "/get_server_info", timeout=60)
    assert resp.status_code == 200, resp.text[:2000]
    return resp.json()["internal_states"][0]["speculation_switch"]


def test_switch_flips_while_answers_fingerprints_and_training_stay_right(switch_server: Server,
                                                                         toploc_server: Server) -> None:
    prompts = gsm8k()
    before = switch_state(switch_server.url)
    answers = []
    for wave in (PROMPTS[:ROUND], PROMPTS[ROUND:]):  # samples that reach the trainer together make one round
        rounds = stats(switch_server.url)["rounds"]
        with ThreadPoolExecutor(ROUND) as pool:
            answers += pool.map(lambda i: chat(switch_server.url, prompts[i]), wave)
        wait_rounds(switch_server.url, rounds + 1)  # every request's rows reached the trainer and trained it

    state = switch_state(switch_server.url)
    assert state["error"] is None, state
    steps = {k: state[k] - before[k] for k in ("steps_on", "steps_off", "flips", "probes", "catch_ups")}
    print(f"\n[speculation switch] {steps}, acceptance {state['acceptance']}")
    assert steps["steps_off"] > steps["steps_on"] > 0 and steps["flips"] >= 4 and steps["catch_ups"] >= 2, state
    assert state["acceptance"] is not None and state["acceptance"] < 2.5, state
    assert state["table"] == TABLE["break_even_tokens_per_step"], state

    trained = stats(switch_server.url)
    assert trained["trainer_alive"] and not trained["errors"], trained
    assert trained["trainer_received"] >= len(PROMPTS) and all(v > 0 for v in trained["loss"]), trained

    messages = [a["choices"][0]["message"] for a in answers]
    with ThreadPoolExecutor(4) as pool:
        plain = list(pool.map(lambda i: chat(toploc_server.url, prompts[i]), PROMPTS))
    assert [m["output_ids"] for m in messages] == [p["choices"][0]["message"]["output_ids"] for p in plain]
    assert_fingerprints_verify(toploc_server.url, messages)

    metrics = requests.get(switch_server.url + "/metrics", timeout=60).text
    assert "sglang_rl:speculation_switch_steps_off" in metrics, metrics[-2000:]
    # off steps decode plainly, so the server admits a plain server's batch, not sglang's 48 for speculation
    info = requests.get(switch_server.url + "/get_server_info", timeout=60).json()
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] > 48, info["internal_states"][0]


def test_rows_equal_a_prefill_replay_across_flips(switch_server: Server, hf: HFReference) -> None:
    before = switch_state(switch_server.url)
    prompts = ["Count: one, two, three,", "The capital of France is"]
    fields = hs_fields(True, "list", "response")
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda p: generate(switch_server.url, p, 24, fields=fields), prompts))
    state = switch_state(switch_server.url)
    assert state["flips"] - before["flips"] >= 2, state  # both on and off steps made these rows
    for prompt, out in zip(prompts, outs):
        check_response(hf, out["meta_info"], mode=True, fmt="list", scope="response", what=prompt)
