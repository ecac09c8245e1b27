"""sglang-rl inside verl 0.9.1's own rollout server, turned on by configuration alone.

verl's rollout registry gives the replica class for `rollout.name=sglang`; its servers run as Ray
actors, build sglang's `ServerArgs` from `rollout.engine_kwargs.sglang` and launch sglang the way
verl does. Here they are started exactly so, in a local Ray cluster whose runtime env carries the
one setting a verl user adds (`ray_kwargs.ray_init.runtime_env.worker_process_setup_hook`), with
the plugin's flags in `engine_kwargs.sglang`: TOPLOC fingerprints and drafter co-training on EAGLE,
as examples/verl/run_grpo.py configures its co-training arm (verl's config composed with its
overrides). As in verl, the target starts as dummy weights and then gets real ones pushed; the
draft must still be the one in its folder.
Rollouts go through verl's own `generate`; what it returns (the `extra_fields` verl copies into
its batch) carries each rollout's fingerprint, verified on another server, and its speculative
counters; the co-training stats come from the server actor. (Without the setting verl refuses the
flags: test/unit/test_verl_activation.py.) verl is installed without its pins (they need
transformers < 5.11; sglang 0.5.17 pins 5.12.1); the CPU stand-ins make its GPU defaults run on
the CPU (`CPU_ARGS`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Iterator

import pytest
import ray
import requests
import torch
from omegaconf import open_dict

from e2e_servers import EAGER
from test_drafter_cotrain import draft_fc_rows, gsm8k, init_drafter
from sglang_rl.request_options import FINGERPRINTS_FIELD
from toploc_helpers import assert_fingerprints_verify
from verl_example import example_config

SETUP_HOOK = "sglang_rl.integrations.verl.activate.load_plugins_first"
# verl's GPU defaults that a CPU server cannot take (no memory saver, no flashinfer)
CPU_ARGS = {"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 16384,
            "enable_memory_saver": False, "sleep_on_idle": True}
# co-training rounds small enough for two CPU cores
CPU_COTRAIN = {"drafter_cotrain_samples_per_round": 4, "drafter_cotrain_steps": 2,
               "drafter_cotrain_soft_topk": 64, "drafter_cotrain_threads": 1}
ROLLOUTS = 4


def example_setup_hook(model_path: str) -> str:
    """The Ray worker set-up hook the example puts in verl's `ray_kwargs`."""
    hook = example_config("plain", model_path, None).ray_kwargs.ray_init.runtime_env.worker_process_setup_hook
    assert hook == SETUP_HOOK, hook
    return hook


def _verl_server(model_path: str, drafter_path: str):
    """The server of the replica class verl's registry gives for `sglang`, with the rollout config
    of the example's co-training arm (CPU settings on top), as that replica creates it: a Ray
    actor, one replica."""
    from sglang_rl.integrations.verl.activate import load_plugins_first

    load_plugins_first()  # what the hook does in every Ray worker; here the driver asks the registry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.model import HFModelConfig
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class

    rollout = example_config("cotrain", model_path, drafter_path).actor_rollout_ref.rollout
    assert rollout.load_format == "dummy"  # verl's: the trainer pushes the target's weights
    with open_dict(rollout):
        rollout.dtype = "float32"
        rollout.engine_kwargs.sglang.update({**CPU_ARGS, **CPU_COTRAIN})
    config = omega_conf_to_dataclass(rollout)
    model_config = HFModelConfig(path=model_path)
    replica = get_rollout_replica_class("sglang")(replica_rank=0, config=config, model_config=model_config)
    assert type(replica).__name__ == "SGLangRLReplica", type(replica)
    return replica.server_class.remote(
        config=config, model_config=model_config, rollout_mode=RolloutMode.STANDALONE,
        workers=[], replica_rank=0, node_rank=0, nnodes=1, cuda_visible_devices="", base_gpu_id=0)


@pytest.fixture(scope="module")
def verl_server(model_path: str, tmp_path_factory) -> Iterator[tuple]:
    draft = init_drafter(model_path, tmp_path_factory.mktemp("verl-drafter") / "d0")
    sample_dir = tmp_path_factory.mktemp("verl-rollout-sample")
    # loopback only: verl serves HTTP on Ray's node address
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"worker_process_setup_hook": example_setup_hook(model_path),
                          "env_vars": {"OMP_NUM_THREADS": "1", **EAGER, "SGLANG_RL_ROLLOUT_SAMPLE_DIR": str(sample_dir),
                                       "SGLANG_RL_ROLLOUT_SAMPLE_RATE": "1.0"}})
    try:
        server = _verl_server(model_path, str(draft))
        ray.get(server.launch_server.remote(), timeout=600)
        host, port = ray.get(server.get_server_address.remote())
        url = f"http://{host}:{port}"
        # the target starts as dummy weights and gets the trainer's (here: the checkpoint's), as in verl
        pushed = requests.post(url + "/update_weights_from_disk", json={"model_path": model_path, "load_format": "auto"},
                               timeout=600)
        assert pushed.status_code == 200 and pushed.json()["success"], pushed.text
        yield server, url, sample_dir, (draft, draft_fc_rows(url))
    finally:
        ray.shutdown()


class _Replicas:
    """verl's LLMServerManager and CheckpointEngineManager as the trainer sees them: the replicas'
    server actors, and a weight update that only counts (no trainer weights on this CPU test)."""

    def __init__(self, server) -> None:
        self.servers, self.updates = [server], []

    def get_replicas(self) -> list:
        return [self]

    def update_weights(self, global_steps: int) -> None:
        self.updates.append(global_steps)


def _trainer_step_end(server) -> dict:
    """SGLangRLTrainerSync.on_step_end on the real server actor; the metrics verl would log."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    trainer = get_trainer_cls("sglang_rl_sync").__new__(get_trainer_cls("sglang_rl_sync"))
    trainer.llm_server_manager = trainer.checkpoint_manager = _Replicas(server)
    trainer.global_steps, trainer.timing_raw, trainer._cotrain_rounds = 7, {}, 0
    trainer.on_step_end()
    assert trainer.checkpoint_manager.updates == [7] and "update_weights" in trainer.timing_raw
    return trainer._consume_sync_metrics()


def _prompt_ids(model_path: str, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)


def test_verl_rollouts_are_fingerprinted_and_cotrain_the_drafter(verl_server, model_path: str,
                                                                toploc_server) -> None:
    server, url, sample_dir, (draft, served_draft) = verl_server
    # the draft came from its folder although verl loads the target as dummy weights
    # (speculative_draft_load_format=auto in the example's config)
    from safetensors.torch import load_file

    folder = load_file(str(draft / "model.safetensors"))["fc.weight"][:2].float()
    assert torch.allclose(torch.tensor(served_draft), folder, atol=1e-6), "the served draft is not the folder's"
    prompts = [_prompt_ids(model_path, m) for m in gsm8k()[300:300 + ROLLOUTS]]
    # verl's own generate (its agent loop's call), greedy as verl's validation runs it
    outs = [ray.get(server.generate.remote(prompt_ids=ids, sampling_params={"temperature": 0, "max_tokens": 24},
                                           request_id=f"verl-{i}"), timeout=600)
            for i, ids in enumerate(prompts)]
    assert all(len(o.token_ids) > 1 and o.stop_reason in ("stop", "length") for o in outs), outs
    # what verl copies into its batch: each rollout's fingerprint, which verifies on another server
    assert_fingerprints_verify(toploc_server.url, [
        {"input_ids": ids, "output_ids": list(o.token_ids), FINGERPRINTS_FIELD: o.extra_fields[FINGERPRINTS_FIELD]}
        for ids, o in zip(prompts, outs)])
    for out in outs:  # verl's rollout-common speculative counters (rollout/spec_accept_length)
        fields = out.extra_fields
        assert 0 < fields["spec_num_verify_steps"] <= len(out.token_ids), fields
        assert 0 <= fields["spec_num_accepted_tokens"] <= fields["spec_num_draft_tokens"], fields
        assert fields["spec_num_verify_steps"] + fields["spec_num_accepted_tokens"] >= len(out.token_ids) - 1, fields
    stats = ray.get(server.drafter_cotrain_stats.remote(), timeout=120)  # the actor's method
    assert stats.keys() == requests.get(url + "/drafter_cotrain_stats", timeout=120).json().keys()
    assert stats["samples"] >= ROLLOUTS and stats["trainer_alive"] and not stats["errors"], stats
    assert stats["acceptance_verify_steps"][0] > 0, stats
    # the sglang_rl_sync trainer's step end: verl's weight update, then these stats as cotrain/*
    # metrics that verl's fit() merges into the step it logs
    metrics = _trainer_step_end(server)
    after = ray.get(server.drafter_cotrain_stats.remote(), timeout=120)
    # the trainer runs on its own: a round may land between the reads, never a sample (no rollouts)
    assert metrics["cotrain/samples"] == stats["samples"] == after["samples"], (stats, metrics, after)
    assert stats["rounds"] <= metrics["cotrain/rounds"] <= after["rounds"], (stats, metrics, after)
    assert metrics["cotrain/trainer_alive"] == 1.0 and metrics["cotrain/errors"] == 0, metrics
    assert "cotrain/acceptance_length" in metrics and "cotrain/policy_version" in metrics, metrics
    # the rollout sample (rate 1: every rollout) holds them with their ids; the audit verifies them
    written = [json.loads(line) for path in sample_dir.glob("*.jsonl") for line in path.read_text().splitlines()]
    assert sorted(r["output_ids"] for r in written) == sorted(list(o.token_ids) for o in outs)
    audit = _audit(toploc_server.url, sample_dir)
    assert audit.returncode == 0 and f"verified {ROLLOUTS} of {ROLLOUTS}" in audit.stdout, audit.stdout + audit.stderr
    assert "by RL step (verified/sampled): " in audit.stdout
    tampered = sample_dir.parent / "tampered"
    tampered.mkdir()
    ids = written[0]["output_ids"]
    bad = dict(written[0], output_ids=[ids[0] ^ 1, *ids[1:]])  # another first token: every later row moves
    (tampered / "r.jsonl").write_text("\n".join(json.dumps(r) for r in [bad, *written[1:]]) + "\n")
    audit = _audit(toploc_server.url, tampered)
    assert audit.returncode == 1 and f"verified {ROLLOUTS - 1} of {ROLLOUTS}" in audit.stdout, audit.stdout
    assert f"FAILED {bad['request_id']}" in audit.stdout
    # the HTTP API verl serves answers the same tokens
    resp = requests.post(url + "/generate", json={
        "input_ids": prompts[0], "sampling_params": {"temperature": 0, "max_new_tokens": 24},
        "return_output_ids": True}, timeout=600)
    assert resp.status_code == 200, resp.text[:1000]
    assert resp.json()["meta_info"]["output_ids"] == list(outs[0].token_ids)


def _audit(verifier: str, sample_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_rl.integrations.verl.audit", "--server", verifier,
                           "--sample-dir", str(sample_dir), "--count", "256"],
                          capture_output=True, text=True, timeout=600)
