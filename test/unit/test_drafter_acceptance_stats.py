"""Co-training's acceptance statistics per draft position and per sampling temperature, and the
sampled objective's co-training config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_rl.adapters.cotrain_acceptance import RoundCounts, temperature_bucket
from sglang_rl.drafter.acceptance import at_least_rates
from sglang_rl.drafter.cotrain import CotrainConfig


def test_at_least_rates_by_hand() -> None:
    # 10 verify steps: 4 accepted 0 drafts, 3 accepted 1, 2 accepted 2, 1 accepted 3
    assert at_least_rates([4, 3, 2, 1]) == pytest.approx([0.6, 0.3, 0.1])
    assert at_least_rates([]) == [] and at_least_rates([0, 0]) == []
    with pytest.raises(ValueError):
        at_least_rates([1, -1])


def test_temperature_buckets_of_sglangs_sampling_params() -> None:
    # sglang turns temperature 0 into top_k 1 (greedy) with temperature 1.0
    assert temperature_bucket(SamplingParams(temperature=0)) == "greedy"
    assert temperature_bucket(SamplingParams(temperature=0.7)) == "0.7"
    assert temperature_bucket(SamplingParams(temperature=1.0)) == "1"
    assert temperature_bucket(None) is None


def test_counts_split_by_temperature_and_merge_histograms() -> None:
    counts = RoundCounts()
    req = lambda t, hist: SimpleNamespace(sampling_params=SamplingParams(temperature=t),  # noqa: E731
                                          spec_correct_drafts_histogram=hist)
    counts.add(req(0.7, [2, 1]), tokens=6, steps=3)
    counts.add(req(0.7, [1, 0, 2]), tokens=9, steps=3)
    counts.add(req(0, [0, 0, 0, 2]), tokens=9, steps=2)
    hot = counts.by_temperature["0.7"].summary()
    assert hot["histogram"] == [3, 1, 2] and hot["verify_steps"] == 6 and hot["acceptance_length"] == 2.5
    assert hot["position_acceptance"] == pytest.approx([0.5, 2 / 6])
    assert counts.by_temperature["greedy"].summary()["position_acceptance"] == [1.0, 1.0, 1.0]
    assert counts.all.histogram == [3, 1, 2, 2] and counts.all.verify_steps == 8


def test_cotrain_config_checks_the_objective() -> None:
    CotrainConfig("d", "t", objective="sampled", temperature=0.7).check()
    with pytest.raises(ValueError, match="objective"):
        CotrainConfig("d", "t", objective="tv").check()
    with pytest.raises(ValueError, match="temperature"):
        CotrainConfig("d", "t", objective="sampled", temperature=-1.0).check()


def test_objective_flags_reach_the_trainer_and_eagle3_refuses_sampled(tmp_path) -> None:
    """`--drafter-cotrain-objective sampled --drafter-cotrain-temperature 0.7` reaches the co-training
    config of an EAGLE server; an EAGLE3 server refuses it (its rows are aux rows, p_T needs the final)."""
    import json

    from sglang_rl.adapters.cotrain_config import config_from_args
    from sglang_rl.drafter.cli import main
    from sglang_rl.server_args import RLServerArgs
    from test_drafter_eagle3 import target as write_target
    from test_server_args import _cotrain_args

    args = RLServerArgs(**_cotrain_args(tmp_path / "eagle"), drafter_cotrain_objective="sampled",
                        drafter_cotrain_temperature=0.7)
    config = config_from_args(args)
    assert (config.objective, config.temperature) == ("sampled", 0.7)
    assert config_from_args(RLServerArgs(**_cotrain_args(tmp_path / "plain"))).objective == "greedy"
    target = write_target(tmp_path, tied=False)
    draft = tmp_path / "eagle3"
    assert main(["init", "--arch", "eagle3", "--model-path", str(target), "--out", str(draft)]) == 0
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    kwargs = dict(model_path=str(target), speculative_algorithm="EAGLE3", drafter_cotrain=True,
                  speculative_draft_model_path=str(draft), device="cpu")
    assert RLServerArgs(**kwargs).drafter_cotrain
    with pytest.raises(ValueError, match="--drafter-cotrain-objective sampled with EAGLE3"):
        RLServerArgs(**kwargs, drafter_cotrain_objective="sampled")
