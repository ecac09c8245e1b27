"""--speculative-switch refuses what it cannot serve before the server starts."""

from __future__ import annotations

import json

import pytest

from sglang_rl.server_args import RLServerArgs


@pytest.mark.parametrize("flags, reason", [
    ({}, "needs --speculative-algorithm EAGLE or EAGLE3"),
    ({"speculative_algorithm": "NGRAM"}, "needs --speculative-algorithm EAGLE or EAGLE3"),
    ({"speculative_algorithm": "EAGLE", "speculative_adaptive": True}, "replaces --speculative-adaptive"),
    ({"speculative_algorithm": "EAGLE", "speculative_switch_probe_steps": 0}, "bad speculation switch config"),
])
def test_refused_combinations(flags: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        RLServerArgs(model_path="unused", speculative_switch=True, **flags)


def test_a_bad_table_fails_at_start(tmp_path) -> None:
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"break_even_tokens_per_step": {"0": 1.5}}))
    with pytest.raises(ValueError, match="bad break-even entry"):
        RLServerArgs(model_path="unused", speculative_algorithm="EAGLE", speculative_switch=True,
                     speculative_switch_table=str(table))
    table.write_text(json.dumps({"1": 1.5}))
    with pytest.raises(ValueError, match="no 'break_even_tokens_per_step' field"):
        RLServerArgs(model_path="unused", speculative_algorithm="EAGLE", speculative_switch=True,
                     speculative_switch_table=str(table))


@pytest.mark.parametrize("flags, running", [
    ({}, 48),  # sglang's own cap for a speculative server
    ({"speculative_switch": True}, None),  # switched: sized from the KV pool at start-up, as a plain server
    ({"speculative_switch": True, "max_running_requests": 20}, 20),  # what the user gives stays
])
def test_the_switch_runs_as_many_requests_as_a_plain_server(model_path: str, flags: dict, running) -> None:
    args = RLServerArgs(model_path=model_path, device="cpu", attention_backend="torch_native", dtype="float32",
                        speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                        speculative_num_draft_tokens=4, speculative_draft_model_path=model_path, **flags)
    assert args.max_running_requests == running
