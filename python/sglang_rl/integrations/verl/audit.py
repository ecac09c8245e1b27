"""Verify a random sample of a verl run's rollouts on a verifier server.

Reads the rollout sample the rollout servers wrote (rollout_sample.py), draws `--count` of them
at random, and checks each fingerprint in the exact-token form on `--server`: a sglang-rl server
with `--toploc-verification` serving the agreed model (with `--toploc-verification-calibration`
for calibrated bounds). Prints one line per failure and a summary; exits 1 if any failed.

    sglang-rl audit --server http://verifier:30000 \\
        --sample-dir /path/to/folder --count 256
"""

from __future__ import annotations

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sglang_rl.arguments import ArgumentParser
from sglang_rl.request_options import FINGERPRINTS_FIELD
from sglang_rl_client import Rollout, RolloutError, ServerError, VerifierClient


def read_sample(folder: Path) -> list[dict]:
    """Every rollout written to the folder's .jsonl files."""
    rollouts = []
    for path in sorted(folder.glob("*.jsonl")):
        rollouts += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rollouts


def verify(server: str, rollout: dict, timeout: float = 600.0) -> dict:
    """The verifier's report for one rollout's last fingerprint ({"error": ...} if none came)."""
    try:
        return VerifierClient(server, timeout=timeout).verify(
            Rollout(rollout["input_ids"], rollout["output_ids"], rollout[FINGERPRINTS_FIELD][-1]))
    except (RolloutError, ServerError, KeyError, IndexError, TypeError) as error:
        return {"error": f"{type(error).__name__}: {error}"}


def audit(server: str, rollouts: list[dict], workers: int = 8) -> list[tuple[dict, dict]]:
    """(rollout, report) for each rollout, verified `workers` at a time with a progress bar."""
    from tqdm import tqdm

    with ThreadPoolExecutor(workers) as pool:
        reports = list(tqdm(pool.map(lambda r: verify(server, r), rollouts), total=len(rollouts),
                            desc="verifying", unit="rollout"))
    return list(zip(rollouts, reports))


def by_step(results: list[tuple[dict, dict]]) -> dict[Any, tuple[int, int]]:
    """(verified, sampled) per RL step: the verifier serves one policy, the run's moved each step."""
    counts: dict[Any, tuple[int, int]] = {}
    for rollout, report in results:
        ok, n = counts.get(rollout.get("global_steps"), (0, 0))
        counts[rollout.get("global_steps")] = (ok + (report.get("verified") is True), n + 1)
    return counts


def main(argv: Any = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="verifier URL")
    parser.add_argument("--sample-dir", type=Path, required=True, help="SGLANG_RL_ROLLOUT_SAMPLE_DIR of the run")
    parser.add_argument("--count", type=int, default=256, help="rollouts to verify (all if fewer were written)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args(argv)
    if not args.sample_dir.is_dir():
        parser.error(f"--sample-dir {args.sample_dir} is not a folder")
    rollouts = read_sample(args.sample_dir)
    if not rollouts:
        parser.error(f"no rollouts in {args.sample_dir}/*.jsonl")
    chosen = random.Random(args.seed).sample(rollouts, min(args.count, len(rollouts)))
    results = audit(args.server, chosen, args.workers)
    failed = [(r, rep) for r, rep in results if rep.get("verified") is not True]
    for rollout, report in failed:
        print(f"FAILED {rollout['request_id']} (step {rollout.get('global_steps')}): "
              f"{report.get('error') or json.dumps(report)[:300]}")
    print(f"verified {len(results) - len(failed)} of {len(results)} rollouts "
          f"(sampled from {len(rollouts)}) on {args.server}")
    steps = sorted(by_step(results).items(), key=lambda item: (item[0] is None, item[0] or 0))
    print("by RL step (verified/sampled): " + ", ".join(f"{step}: {ok}/{n}" for step, (ok, n) in steps))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
