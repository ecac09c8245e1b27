"""Hidden-state rows under EAGLE speculative decoding follow the committed tokens (GPU).

A verify step commits a run of 1-4 tokens, and the rows it returns must be those of the
committed positions, each as a prefill of the final sequence would give it. A small Llama target
and an EAGLE draft that usually guesses right (benchmark/spec_models.py) run in two fresh
Engines (CUDA graphs on), each in its own process:
* spec: EAGLE (3 steps, topk 1, 4 draft tokens); FULL rows (scope all, final row) and LAST rows
  of greedy requests;
* plain: the same requests without speculative decoding (their rows against the replay give
  the scale of bf16 decode noise, printed, not checked), and a prefill-only replay of each spec
  request's `input_ids + output_ids`, whose rows are the reference for every position.
A control compares the spec rows one position off, to show the comparison can fail. With `-s`
the tests print the figures of docs/hidden-states.md's table.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, PROMPT_LEN, MAX_NEW = 16, 48, 61  # 61 is odd on purpose: runs overshoot the end

CHILD = r'''
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(sys.argv[1]) / "benchmark"))
from common import engine_kwargs, random_prompts
import sglang as sgl

def main():
    work, group = Path(sys.argv[2]), sys.argv[3]
    requests, prompt_len, max_new = (int(v) for v in sys.argv[4:7])
    extra = {"enable_return_hidden_states": True, "mem_fraction_static": 0.5}
    if group == "spec":
        extra.update(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                     speculative_num_draft_tokens=4, speculative_draft_model_path=str(work / "draft"))
    llm = sgl.Engine(**engine_kwargs(str(work / "target"), False, True, **extra))
    prompts = random_prompts(requests, prompt_len, seed=7)
    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    full = llm.generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True,
                        hidden_states_format="tensor", return_final_hidden_state=True)
    saved = {
        "output_ids": [list(o["output_ids"]) for o in full],
        "rows": [o["meta_info"]["hidden_states_rows"].float() for o in full],
        "positions": [o["meta_info"]["hidden_states_positions"] for o in full],
        "verify_ct": [o["meta_info"].get("spec_verify_ct") for o in full],
        "completion": [o["meta_info"]["completion_tokens"] for o in full],
    }
    if group == "spec":
        last = llm.generate(input_ids=prompts, sampling_params=sp, return_hidden_states="last",
                            hidden_states_format="tensor")
        saved["last_rows"] = [o["meta_info"]["hidden_states_rows"].float() for o in last]
        saved["last_positions"] = [o["meta_info"]["hidden_states_positions"] for o in last]
        saved["last_output_ids"] = [list(o["output_ids"]) for o in last]
    else:
        spec = torch.load(work / "spec.pt")
        replay_ids = [p + o for p, o in zip(prompts, spec["output_ids"])]
        replay = llm.generate(input_ids=replay_ids, sampling_params={"max_new_tokens": 0},
                              return_hidden_states=True, hidden_states_format="tensor")
        saved["replay_rows"] = [o["meta_info"]["hidden_states_rows"].float() for o in replay]
        saved["replay_positions"] = [o["meta_info"]["hidden_states_positions"] for o in replay]
    llm.shutdown()
    torch.save(saved, work / f"{group}.pt")
    print("RESULT " + json.dumps({"group": group}), flush=True)

if __name__ == "__main__":
    main()
'''


def _run_group(work: Path, group: str) -> dict:
    script = work / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run([sys.executable, str(script), str(ROOT), str(work), group,
                           str(REQUESTS), str(PROMPT_LEN), str(MAX_NEW)],
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return torch.load(work / f"{group}.pt")


def _compare(rows: list[torch.Tensor], refs: list[torch.Tensor], shift: int = 0) -> tuple[float, float]:
    """The lowest cosine similarity of a row with its reference and the largest |difference|,
    over every request and position (`shift`: each row against the reference `shift` positions
    earlier)."""
    cos, diff = [], []
    for got, ref in zip(rows, refs):
        if shift:
            got, ref = got[shift:], ref[:-shift]
        n = min(got.shape[0], ref.shape[0])
        cos.append(torch.nn.functional.cosine_similarity(got[:n], ref[:n], dim=-1).min().item())
        diff.append((got[:n] - ref[:n]).abs().max().item())
    return min(cos), max(diff)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer: Path) -> tuple[dict, dict]:
    """The spec and the plain (replay) group's saved outputs."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    from spec_models import make_eagle_pair

    work = tmp_path_factory.mktemp("spec")
    make_eagle_pair(work, tokenizer)
    spec = _run_group(work, "spec")
    plain = _run_group(work, "plain")
    return spec, plain


def test_spec_decoding_commits_runs_of_tokens(runs) -> None:
    """The draft is accepted often enough that verify steps commit several tokens."""
    spec, _ = runs
    assert all(spec["verify_ct"]), spec["verify_ct"]
    tokens_per_step = sum(spec["completion"]) / sum(spec["verify_ct"])
    print(f"spec tokens per verify step: {tokens_per_step:.2f}")
    assert tokens_per_step > 1.5


def test_every_position_has_its_row(runs) -> None:
    spec, plain = runs
    n_rows = PROMPT_LEN + MAX_NEW
    assert all(pos == list(range(n_rows)) for pos in spec["positions"])
    assert all(pos == list(range(n_rows)) for pos in plain["replay_positions"])
    assert all(pos == [n_rows - 2] for pos in spec["last_positions"])


def test_full_rows_match_a_prefill_replay(runs) -> None:
    spec, plain = runs
    cosine, diff = _compare(spec["rows"], plain["replay_rows"])
    control, control_diff = _compare(spec["rows"], plain["replay_rows"], shift=1)
    same = [i for i in range(REQUESTS) if plain["output_ids"][i] == spec["output_ids"][i]]
    print(f"spec FULL vs replay: min cosine {cosine:.4f}, max abs diff {diff:.3g}; "
          f"control, one position off: {control:.4f}, {control_diff:.3g}")
    if same:  # for scale only: plain decoding's own bf16 noise against the replay
        noise = _compare([plain["rows"][i] for i in same], [plain["replay_rows"][i] for i in same])
        print(f"plain FULL vs replay, {len(same)} requests with the same tokens: "
              f"min cosine {noise[0]:.4f}, max abs diff {noise[1]:.3g}")
    assert cosine >= 0.99
    assert control < 0.5


def test_last_rows_match_a_prefill_replay(runs) -> None:
    """LAST rows of the requests whose output equals the FULL run's (greedy; bf16 batches may
    differ) against the replay's row of the same position."""
    spec, plain = runs
    same = [i for i in range(REQUESTS) if spec["last_output_ids"][i] == spec["output_ids"][i]]
    assert same, "no LAST request decoded as its FULL twin"
    cosine, diff = _compare([spec["last_rows"][i] for i in same], [plain["replay_rows"][i][-2:-1] for i in same])
    print(f"spec LAST vs replay, {len(same)} requests: min cosine {cosine:.4f}, max abs diff {diff:.3g}")
    assert cosine >= 0.99
