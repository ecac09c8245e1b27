"""sglang-rl inside verl 0.9.1's own rollout server, turned on by configuration alone.

verl's `SGLangHttpServer` runs as a Ray actor, builds sglang's `ServerArgs` from
`rollout.engine_kwargs.sglang` and launches sglang the way verl does. Here it is started exactly
so, in a local Ray cluster whose runtime env carries the one setting a verl user adds
(`ray_kwargs.ray_init.runtime_env.worker_process_setup_hook`), with the plugin's flags in
`engine_kwargs.sglang`: TOPLOC fingerprints and drafter co-training on EAGLE. Rollouts go through
verl's own `generate`; the same server's HTTP API (which verl serves) gives their fingerprints,
verified on another server, and the co-training stats. Without the setting, verl refuses the
flags. verl is installed without its pins (they need transformers < 5.11; sglang 0.5.17 pins
5.12.1); the CPU stand-ins make its GPU defaults run on the CPU (`CPU_ARGS`).
"""

from __future__ import annotations

from typing import Iterator

import pytest
import ray
import requests

from test_drafter_cotrain import gsm8k, init_drafter
from toploc_helpers import assert_fingerprints_verify

SETUP_HOOK = "sglang_rl.integrations.verl.activate.load_plugins_first"
# verl's GPU defaults that a CPU server cannot take (no memory saver, no flashinfer)
CPU_ARGS = {"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 16384,
            "enable_memory_saver": False, "sleep_on_idle": True}
PLUGIN_ARGS = {
    "toploc_verification": True,
    "speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "drafter_cotrain": True, "drafter_cotrain_samples_per_round": 4, "drafter_cotrain_steps": 2,
    "drafter_cotrain_soft_topk": 64, "drafter_cotrain_threads": 1,
}
ROLLOUTS = 4


def _verl_server(model_path: str, engine_kwargs: dict):
    """verl's SGLangHttpServer as verl's SGLangReplica creates it: a Ray actor, one replica."""
    from verl.workers.config.model import HFModelConfig
    from verl.workers.config.rollout import RolloutConfig
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    config = RolloutConfig(name="sglang", tensor_model_parallel_size=1, dtype="float32", load_format="auto",
                           engine_kwargs={"sglang": {**CPU_ARGS, **engine_kwargs}})
    return ray.remote(SGLangHttpServer).remote(
        config=config, model_config=HFModelConfig(path=model_path), rollout_mode=RolloutMode.STANDALONE,
        workers=[], replica_rank=0, node_rank=0, nnodes=1, cuda_visible_devices="", base_gpu_id=0)


@pytest.fixture(scope="module")
def verl_server(model_path: str, tmp_path_factory) -> Iterator[tuple]:
    draft = init_drafter(model_path, tmp_path_factory.mktemp("verl-drafter") / "d0")
    # loopback only: verl serves HTTP on Ray's node address
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"worker_process_setup_hook": SETUP_HOOK, "env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        server = _verl_server(model_path, {**PLUGIN_ARGS, "speculative_draft_model_path": str(draft)})
        ray.get(server.launch_server.remote(), timeout=600)
        host, port = ray.get(server.get_server_address.remote())
        yield server, f"http://{host}:{port}"
    finally:
        ray.shutdown()


def _prompt_ids(model_path: str, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)


def test_verl_rollouts_are_fingerprinted_and_cotrain_the_drafter(verl_server, model_path: str,
                                                                toploc_server) -> None:
    server, url = verl_server
    prompts = [_prompt_ids(model_path, m) for m in gsm8k()[300:300 + ROLLOUTS]]
    # verl's own generate (its agent loop's call), greedy as verl's validation runs it
    outs = [ray.get(server.generate.remote(prompt_ids=ids, sampling_params={"temperature": 0, "max_tokens": 24},
                                           request_id=f"verl-{i}"), timeout=600)
            for i, ids in enumerate(prompts)]
    assert all(len(o.token_ids) > 1 and o.stop_reason in ("stop", "length") for o in outs), outs
    stats = requests.get(url + "/drafter_cotrain_stats", timeout=120).json()
    assert stats["samples"] >= ROLLOUTS and stats["trainer_alive"] and not stats["errors"], stats
    assert stats["acceptance_verify_steps"][0] > 0, stats
    # the same rollouts over the HTTP API verl serves: fingerprinted, and the same tokens
    metas = []
    for ids, out in zip(prompts, outs):
        resp = requests.post(url + "/generate", json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24},
            "return_input_ids": True, "return_output_ids": True}, timeout=600)
        assert resp.status_code == 200, resp.text[:1000]
        meta = resp.json()["meta_info"]
        assert meta["output_ids"] == list(out.token_ids)
        metas.append(meta)
    assert_fingerprints_verify(toploc_server.url, metas)


def test_without_the_setup_hook_verl_refuses_the_flags(model_path: str) -> None:
    """The reason the setting exists: verl builds ServerArgs before sglang loads plugins."""
    import subprocess
    import sys

    code = (
        "import verl.workers.rollout.sglang_rollout.async_sglang_server as m\n"
        f"m.ServerArgs(model_path={model_path!r}, toploc_verification=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "toploc_verification" in run.stderr, run.stderr[-2000:]
    hooked = "import sglang_rl.integrations.verl.activate as a\na.load_plugins_first()\n" + code
    run = subprocess.run([sys.executable, "-c", hooked], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
