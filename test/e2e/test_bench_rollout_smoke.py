"""benchmark/bench_rollout.py run as a user runs it (a subprocess), at a tiny size, against servers
the suite already has: the shared `plain` server and test_speculative_switch's server (EAGLE with
the speculation switch and co-training) as the `switch-cotrain` arm. (A fixed-EAGLE arm reads the
same verify-step counters; test_eagle_cpu checks that server's greedy answers and acceptance.)

Every arm must report every response of every step, its table row and its JSON; the speculative
arm's acceptance comes from its verify steps, the co-training arm reports its rounds, and at
temperature 0 every arm's answers equal the plain server's (the target decides every token). An
arm given a server that does not run what the arm measures ends the run with a one-line message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from e2e_servers import Server, server_fixture
from test_speculative_switch import SWITCH

BENCH = Path(__file__).resolve().parents[2] / "benchmark" / "bench_rollout.py"
PROMPTS, SAMPLES, MAX_NEW = 2, 2, 8

ARMS = ("plain", "switch-cotrain")

switch_server = server_fixture(SWITCH, scope="module", doc="The speculation switch with co-training (test_speculative_switch).")


def _bench(model_path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), "--model-path", model_path, *args],
                          capture_output=True, text=True, timeout=600)


def test_every_arm_reports_every_response(plain_server: Server, switch_server: Server, model_path: str,
                                          tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    run = _bench(model_path, "--server", f"plain={plain_server.url}", "--server", f"switch-cotrain={switch_server.url}",
                 "--gap-s", "30", "--prompts", str(PROMPTS), "--samples", str(SAMPLES), "--max-new-tokens", str(MAX_NEW),
                 "--temperatures", "1.0", "0", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print("\n" + "\n".join(line for line in run.stdout.splitlines() if line.startswith("# ")), flush=True)  # per-step times
    report = json.loads(out.read_text())
    assert tuple(report["arms"]) == ARMS
    for arm, data in report["arms"].items():
        assert [(s["temp"], s["step"]) for s in data["steps"]] == [(1.0, 1), (0.0, 1)], arm
        for step in data["steps"]:
            assert step["responses"] == PROMPTS * SAMPLES and len(step["done_s"]) == PROMPTS * SAMPLES
            assert 0 < step["tokens"] <= PROMPTS * SAMPLES * MAX_NEW
            assert 0 <= step["tail_s"] <= step["wall_s"] == max(step["done_s"])
            assert abs(step["tok_s"] - step["tokens"] / step["wall_s"]) <= 0.1 + 1e-3 * step["tok_s"]
            if arm == "plain":
                assert step["verify_steps"] == 0 and step["accept"] is None
            else:  # switched off, a step decodes plainly (no verify step); on, at most 3 drafts + the bonus each
                assert step["verify_steps"] <= step["tokens"] <= 4 * step["verify_steps"] + step["tokens"]
                if step["verify_steps"]:
                    assert step["accept"] == round(step["tokens"] / step["verify_steps"], 3), step
        if arm == "switch-cotrain":  # between the steps, the first one's rollouts reached the trainer and trained
            after = data["steps"][0]["cotrain"]["after_gap"]
            handed = after["samples"] + after["samples_dropped"] + after["samples_skipped_busy"]
            assert handed >= PROMPTS * SAMPLES and after["rounds"] + after["rounds_held"] >= 1, data["steps"][0]
    greedy = {arm: report["arms"][arm]["steps"][1]["texts"] for arm in ARMS}
    assert len(greedy["plain"]) == PROMPTS * SAMPLES and greedy["switch-cotrain"] == greedy["plain"]

    table = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "arm" and "same_as_plain" in table[0]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table[1:]]
    assert [(r[0], r[1]) for r in rows] == [(arm, temp) for arm in ARMS for temp in ("1.0", "0.0")]
    assert [r[-1] for r in rows[1::2]] == [f"{PROMPTS * SAMPLES}/{PROMPTS * SAMPLES}"] * len(ARMS)  # greedy: as plain


def test_an_arm_without_its_feature_ends_with_one_line(plain_server: Server, model_path: str) -> None:
    run = _bench(model_path, "--server", f"switch={plain_server.url}", "--prompts", "1", "--samples", "1")
    assert run.returncode != 0
    message = run.stderr.strip().splitlines()
    assert message == [f"arm switch: the server at {plain_server.url} runs speculative_algorithm=None"], run.stderr
