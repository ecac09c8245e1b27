"""examples/verl: the GSM8K reward, the dataset files verl reads, and the launcher's arms."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from verl_example import EXAMPLE, example, example_config

reward = example("gsm8k_reward")


@pytest.mark.parametrize("response, truth, score", [
    ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "18", 1.0),
    ("She makes $18 every day.", "18", 1.0),
    ("The profit is 70,000 dollars", "70000", 1.0),
    ("#### 18.0", "18", 1.0),
    ("#### 17", "18", 0.0),
    ("#### 18 then 19", "18", 0.0),  # the final number counts
    ("We get 18, so #### -18", "-18", 1.0),
    ("no number at all", "18", 0.0),
    ("", "3", 0.0),
])
def test_reward_reads_the_final_number(response: str, truth: str, score: float) -> None:
    assert reward.compute_score("gsm8k", response, truth, {}) == score


def test_dataset_files_hold_disjoint_train_and_held_out_problems(tmp_path) -> None:
    run = subprocess.run([sys.executable, str(EXAMPLE / "prepare_gsm8k.py"), "--out", str(tmp_path),
                          "--train", "40", "--held-out", "10"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    train, test = pd.read_parquet(tmp_path / "train.parquet"), pd.read_parquet(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (40, 10)
    assert set(train.columns) >= {"data_source", "prompt", "reward_model", "extra_info"}
    prompts = lambda df: {row[0]["content"] for row in df["prompt"]}  # noqa: E731
    assert not prompts(train) & prompts(test)
    first = train.iloc[0]
    assert first["prompt"][0]["role"] == "user" and "Janet" in first["prompt"][0]["content"]
    assert first["reward_model"]["ground_truth"] == "18"  # GSM8K's "#### 18"
    chats = [json.loads(line)["messages"] for line in (tmp_path / "train_prompts.jsonl").read_text().splitlines()]
    assert [c[0]["content"] for c in chats] == [row[0]["content"] for row in train["prompt"]]
    assert reward.compute_score(first["data_source"], "#### 18", first["reward_model"]["ground_truth"]) == 1.0
    too_many = subprocess.run([sys.executable, str(EXAMPLE / "prepare_gsm8k.py"), "--out", str(tmp_path),
                               "--train", "2000"], capture_output=True, text=True, timeout=300)
    assert too_many.returncode == 2 and "more than the 1319 problems" in too_many.stderr


@pytest.mark.parametrize("arm", ["plain", "eagle", "cotrain"])
def test_arms_compose_into_verl_config(arm: str) -> None:
    from verl.utils.config import omega_conf_to_dataclass

    config = example_config(arm, "/models/policy", None if arm == "plain" else "/drafters/d0")
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    sglang = rollout.engine_kwargs["sglang"]
    assert rollout.name == "sglang" and sglang["toploc_verification"] is True
    assert config.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    speculative = arm != "plain"
    assert (rollout.mtp is not None and rollout.mtp.enable and rollout.mtp.enable_rollout) == speculative
    assert sglang.get("speculative_draft_model_path") == ("/drafters/d0" if speculative else None)
    # verl's rollout loads dummy weights (the trainer pushes the target's); the draft comes from its folder
    assert rollout.load_format == "dummy"
    assert sglang.get("speculative_draft_load_format") == ("auto" if speculative else None)
    assert sglang.get("drafter_cotrain", False) == (arm == "cotrain")
    # co-training trains in the idle gaps (verl's actor update), never on the rollout's critical path
    assert sglang.get("drafter_cotrain_train_in_gaps", False) == (arm == "cotrain")
    assert config.trainer.n_gpus_per_node == 2 and config.trainer.total_training_steps == 30
    assert config.trainer.experiment_name == arm
    assert config.trainer.v1.trainer_mode == "sglang_rl_sync"  # the same trainer in every arm


def test_rollout_sample_goes_to_every_ray_worker() -> None:
    config = example_config("cotrain", "/m", "/drafters/d0", rollout_sample_dir="/audit", rollout_sample_rate=0.2)
    env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env_vars.SGLANG_RL_ROLLOUT_SAMPLE_DIR == "/audit"
    assert env_vars.SGLANG_RL_ROLLOUT_SAMPLE_RATE == "0.2"  # a string: Ray refuses other env values
    assert "env_vars" not in example_config("plain", "/m", None).ray_kwargs.ray_init.runtime_env
    logged = example_config("plain", "/m", None, file_logger_root="/logs").ray_kwargs.ray_init.runtime_env
    assert logged.env_vars.VERL_FILE_LOGGER_ROOT == "/logs"  # the file logger runs in a Ray worker


def test_launcher_refuses_an_arm_without_its_drafter() -> None:
    run = subprocess.run([sys.executable, str(EXAMPLE / "run_grpo.py"), "--arm", "eagle", "--model-path", "/m",
                          "--data-dir", "/d", "--print"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--arm eagle needs --drafter-path" in run.stderr, run.stderr
    run = subprocess.run([sys.executable, str(EXAMPLE / "run_grpo.py"), "--arm", "plain", "--model-path", "/m",
                          "--data-dir", "/d", "--print", "trainer.total_training_steps=2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "verl.trainer.main_ppo" in run.stdout
    assert run.stdout.rstrip().endswith("trainer.total_training_steps=2")  # extra overrides come last
