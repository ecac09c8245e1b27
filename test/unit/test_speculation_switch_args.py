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
