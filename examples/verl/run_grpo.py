"""GRPO on GSM8K with SmolLM2-135M-Instruct in verl 0.9.1, with sglang-rl in the rollout.

One host with two GPUs: verl's colocated (hybrid) mode, the FSDP actor and two sglang rollout
replicas (TP 1) sharing the GPUs, sleeping and waking around each update. Three arms:

- `plain`: no speculative decoding;
- `eagle`: EAGLE with a drafter that stays as it is (`--drafter-path`);
- `cotrain`: EAGLE whose drafter (`--drafter-path`, its start) is co-trained on the rollouts.

Every arm serves with TOPLOC fingerprints, which reach verl's batch (each sample's
`extra_fields`). With EAGLE, verl logs `rollout/spec_accept_length` every step; with co-training,
the trainer (`sglang_rl_sync`, verl's sync trainer) also logs `cotrain/*` (rounds, loss, acceptance,
policy version).

    python examples/verl/prepare_gsm8k.py --out data/gsm8k
    sglang-rl drafter init --model-path MODEL --out drafters/d0
    python examples/verl/run_grpo.py --arm cotrain --model-path MODEL --drafter-path drafters/d0 \\
        --data-dir data/gsm8k --steps 30 [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = ("plain", "eagle", "cotrain")
SETUP_HOOK = "sglang_rl.integrations.verl.activate.load_plugins_first"


def sglang_kwargs(arm: str, drafter_path: str | None) -> dict:
    """The sglang-rl and sglang flags of an arm, as verl's `engine_kwargs.sglang`."""
    # prefill CUDA graphs are compiled at every server start (~4 min for this model on an H100)
    kwargs: dict = {"toploc_verification": True, "cuda_graph_backend_prefill": "disabled"}
    if arm in ("eagle", "cotrain"):
        # verl starts sglang with load_format=dummy (the trainer pushes the target's weights) and
        # sglang loads the draft in that format too unless told: the draft would be random
        kwargs.update(speculative_draft_model_path=drafter_path, speculative_draft_load_format="auto")
    if arm == "cotrain":
        # one round per RL step (16 prompts x 4 rollouts), trained while verl updates the actor and
        # the server sleeps, so the rollout never waits on the trainer (docs/cotrain.md, idle gaps)
        kwargs.update(drafter_cotrain=True, drafter_cotrain_samples_per_round=64, drafter_cotrain_steps=50,
                      drafter_cotrain_lr=1e-3, drafter_cotrain_train_in_gaps=True)
    return kwargs


def overrides(arm: str, model_path: str, data_dir: str, drafter_path: str | None = None,
              steps: int = 30, gpus: int = 2, batch: int = 64, samples: int = 8,
              rollout_sample_dir: str | None = None, rollout_sample_rate: float = 0.05,
              file_logger_root: str | None = None) -> list[str]:
    """verl's hydra overrides for one arm."""
    if arm not in ARMS:
        raise ValueError(f"--arm must be one of {', '.join(ARMS)}")
    if arm != "plain" and not drafter_path:
        raise ValueError(f"--arm {arm} needs --drafter-path")
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    args = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/test.parquet",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=256",
        "data.max_response_length=256",
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.optim.lr=1e-6",
        f"{actor}.ppo_mini_batch_size={batch}",
        f"{actor}.ppo_micro_batch_size_per_gpu=32",
        f"{actor}.use_kl_loss=False",
        f"{rollout}.name=sglang",
        f"{rollout}.mode=async",
        f"{rollout}.n={samples}",
        f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.gpu_memory_utilization=0.4",
        f"{rollout}.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
        f"reward.custom_reward_function.path={HERE / 'gsm8k_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.n_gpus_per_node={gpus}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=sglang-rl-gsm8k",
        f"trainer.experiment_name={arm}",
        # verl's sync trainer that also logs cotrain/* every step (the same RL in every arm)
        "trainer.v1.trainer_mode=sglang_rl_sync",
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={SETUP_HOOK}",
    ]
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    if rollout_sample_dir:  # a random share of the rollouts, with their ids, for an audit after the run
        args += [f"{env}.SGLANG_RL_ROLLOUT_SAMPLE_DIR={rollout_sample_dir}",
                 f"{env}.SGLANG_RL_ROLLOUT_SAMPLE_RATE='{rollout_sample_rate}'"]  # quoted: Ray wants a string
    if file_logger_root:  # verl's file logger runs in a Ray worker, which a running cluster does not give our env
        args.append(f"{env}.VERL_FILE_LOGGER_ROOT={os.path.abspath(file_logger_root)}")
    if arm != "plain":  # verl's switch for speculative rollout: EAGLE, 3 steps, top-1, 4 draft tokens
        args += ["actor_rollout_ref.model.mtp.enable=True", "actor_rollout_ref.model.mtp.enable_rollout=True"]
    args += [f"+{rollout}.engine_kwargs.sglang.{key}={value}"
             for key, value in sglang_kwargs(arm, drafter_path).items()]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", choices=ARMS, required=True)
    parser.add_argument("--model-path", required=True, help="the policy's starting folder")
    parser.add_argument("--drafter-path", help="EAGLE drafter folder (eagle, cotrain)")
    parser.add_argument("--data-dir", required=True, help="folder written by prepare_gsm8k.py")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--rollout-sample-dir", help="write a random share of the rollouts here for an audit "
                        "(sglang-rl audit)")
    parser.add_argument("--rollout-sample-rate", type=float, default=0.05,
                        help="the share of rollouts --rollout-sample-dir gets (default 0.05)")
    parser.add_argument("--print", action="store_true", help="print verl's command instead of running it")
    args, extra = parser.parse_known_args()
    try:
        command = [sys.executable, "-m", "verl.trainer.main_ppo",
                   *overrides(args.arm, args.model_path, args.data_dir, args.drafter_path, args.steps, args.gpus,
                             rollout_sample_dir=args.rollout_sample_dir,
                             rollout_sample_rate=args.rollout_sample_rate,
                             file_logger_root=os.environ.get("VERL_FILE_LOGGER_ROOT")),
                   *extra]
    except ValueError as error:
        parser.error(str(error))
    if args.print:
        print(" \\\n  ".join(command))
        return
    sys.exit(subprocess.call(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}))


if __name__ == "__main__":
    main()
