"""Per-step table of the verl GRPO example's arms, from verl's file logger.

verl's `file` logger writes one JSON line per RL step (`{"step": N, "data": {metric: value}}`) to
`$VERL_FILE_LOGGER_ROOT/<project>/<arm>.jsonl`. For each arm and step this prints the rollout
seconds (`timing_s/gen`), output tokens per second of the rollout, the acceptance length
(`rollout/spec_accept_length`), the mean reward (`critic/score/mean`), the step seconds and, for
the co-training arm (trainer `sglang_rl_sync`), the co-training rounds, loss and policy version;
then a summary per arm with the step time against the `eagle` arm's. `--png` draws acceptance
against RL step (`eagle`, `cotrain`) and the reward curves of all arms.

    python benchmark/verl_grpo_table.py LOG_DIR/sglang-rl-gsm8k --samples-per-step 512 --png grpo.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

ARMS = ("plain", "eagle", "cotrain")


def read_steps(path: Path) -> list[dict]:
    """One dict of metrics per logged step, in step order (validation-only lines skipped)."""
    steps = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "timing_s/gen" in entry["data"]:
            steps.append({"step": entry["step"], **entry["data"]})
    return sorted(steps, key=lambda s: s["step"])


def row(metrics: dict, samples_per_step: int) -> tuple:
    gen = metrics["timing_s/gen"]
    tokens = metrics["response_length/mean"] * samples_per_step
    return (gen, tokens / gen if gen else 0.0, metrics.get("rollout/spec_accept_length"),
            metrics.get("critic/score/mean"), metrics.get("timing_s/step"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", type=Path, help="folder with <arm>.jsonl files")
    parser.add_argument("--samples-per-step", type=int, required=True, help="prompts x rollouts per prompt")
    parser.add_argument("--png", type=Path, help="also draw acceptance and reward per step into this PNG")
    args = parser.parse_args()
    arms = {arm: read_steps(args.log_dir / f"{arm}.jsonl") for arm in ARMS if (args.log_dir / f"{arm}.jsonl").exists()}
    if not arms:
        parser.error(f"no {', '.join(a + '.jsonl' for a in ARMS)} in {args.log_dir}")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print("| arm | step | rollout s | output tok/s | acceptance length | mean reward | step s "
          "| co-training rounds | co-training loss | policy version |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm, steps in arms.items():
        for metrics in steps:
            gen, tps, accept, reward, step_s = row(metrics, args.samples_per_step)
            print(f"| {arm} | {metrics['step']} | {gen:.2f} | {tps:.0f} | {fmt(accept, '.2f')} | "
                  f"{fmt(reward, '.3f')} | {fmt(step_s, '.2f')} | {fmt(metrics.get('cotrain/rounds'), '.0f')} | "
                  f"{fmt(metrics.get('cotrain/loss'), '.3f')} | {fmt(metrics.get('cotrain/policy_version'), '.0f')} |")
    step_medians = {arm: _median([row(m, args.samples_per_step)[4] for m in steps]) for arm, steps in arms.items()}
    print("\n| arm | steps | median rollout s | median output tok/s | median step s | step s vs eagle "
          "| last-5 mean reward |")
    print("|---|---|---|---|---|---|---|")
    for arm, steps in arms.items():
        rows = [row(m, args.samples_per_step) for m in steps]
        rewards = [r[3] for r in rows[-5:] if r[3] is not None]
        base, mine = step_medians.get("eagle"), step_medians[arm]
        ratio = mine / base if base and mine is not None else None
        print(f"| {arm} | {len(rows)} | {median(r[0] for r in rows):.2f} | {median(r[1] for r in rows):.0f} | "
              f"{fmt(mine, '.2f')} | {fmt(ratio, '.3f')} | "
              f"{fmt(sum(rewards) / len(rewards) if rewards else None, '.3f')} |")
    if args.png:
        plot(arms, args.png)
        print(f"\nplot: {args.png}")


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return median(values) if values else None


def plot(arms: dict[str, list[dict]], path: Path) -> None:
    """Acceptance length against RL step (arms with speculative decoding) and mean reward of
    every arm, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (accept_ax, reward_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, steps in arms.items():
        xs = [m["step"] for m in steps]
        accepts = [m.get("rollout/spec_accept_length") for m in steps]
        if any(a is not None for a in accepts):
            accept_ax.plot(xs, accepts, marker="o", label=arm)
        reward_ax.plot(xs, [m.get("critic/score/mean") for m in steps], marker=".", label=arm)
    accept_ax.set(xlabel="RL step", ylabel="acceptance length (tokens per verify step)",
                  title="speculative acceptance")
    reward_ax.set(xlabel="RL step", ylabel="mean reward", title="GSM8K reward")
    for ax in (accept_ax, reward_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
