"""The sglang-rl flags refuse combinations they cannot serve before the server starts."""

from __future__ import annotations

import pytest

from sglang_rl.server_args import RLServerArgs


def test_toploc_refuses_speculative_algorithms_it_cannot_follow() -> None:
    """EAGLE, EAGLE3, NEXTN and NGRAM are served (test/e2e/test_toploc_speculative.py,
    test_eagle3_cpu.py); the others are refused before anything starts, with the reason."""
    with pytest.raises(ValueError, match="--speculative-algorithm STANDALONE: .*supported: EAGLE, EAGLE3, NEXTN, NGRAM"):
        RLServerArgs(model_path="unused", toploc_verification=True, speculative_algorithm="STANDALONE")


@pytest.mark.parametrize("flags, refused", [
    ({"device": "cpu"}, None),
    ({"device": "cpu", "enable_torch_compile": True}, "without --enable-torch-compile"),
    ({"device": "cuda"}, "with --disable-cuda-graph"),
    ({"device": "cuda", "disable_cuda_graph": True}, None),
    ({"device": "cuda", "enable_return_hidden_states": True, "toploc_verification": False}, "with --disable-cuda-graph"),
])
def test_eagle3_rows_need_a_target_without_graphs(tmp_path, flags: dict, refused) -> None:
    """An EAGLE3 target's last-layer rows ride beside its auxiliary ones on the logits output,
    which a graph replay rebuilds without them: fingerprints and hidden-state fields on an EAGLE3
    server are refused with graphs, with the reason."""
    from sglang_rl.drafter.cli import main
    from test_drafter_eagle3 import target as write_target

    target = write_target(tmp_path, tied=False)
    assert main(["init", "--arch", "eagle3", "--model-path", str(target), "--out", str(tmp_path / "eagle3")]) == 0
    kwargs = dict(model_path=str(target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path / "eagle3"),
                  **{"toploc_verification": True, **flags})
    if refused is None:
        assert RLServerArgs(**kwargs).toploc_verification
    else:
        with pytest.raises(ValueError, match=f"EAGLE3 with --toploc-verification, --enable-return-hidden-states or --specforge-export-dir runs {refused}"):
            RLServerArgs(**kwargs)


@pytest.mark.parametrize("topk", [0, 4097])
def test_toploc_topk_range(topk: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 4096"):
        RLServerArgs(model_path="unused", toploc_verification=True, toploc_verification_topk=topk)


@pytest.mark.parametrize("memory_saver", [True, False])
def test_cotraining_with_memory_release_backs_up_the_draft(tmp_path, memory_saver: bool) -> None:
    """With --enable-memory-saver (verl's colocated mode releases the weights between rollouts),
    the co-trained draft is kept on the host across a release: nobody pushes it back."""
    from sglang_rl.drafter import init_drafter, save_drafter
    from test_drafter_checkpoint import write_target

    target = write_target(tmp_path / "target")
    save_drafter(init_drafter(target, seed=0), tmp_path / "draft")
    args = RLServerArgs(model_path=str(target), speculative_algorithm="EAGLE", drafter_cotrain=True,
                        speculative_draft_model_path=str(tmp_path / "draft"), device="cpu",
                        enable_memory_saver=memory_saver)
    assert args.enable_draft_weights_cpu_backup is memory_saver


@pytest.mark.parametrize("draft_format, warned", [(None, True), ("auto", False)])
def test_a_dummy_load_format_warns_that_the_draft_is_random(tmp_path, caplog, draft_format, warned: bool) -> None:
    """verl starts sglang with --load-format dummy; sglang then loads the draft as dummy weights too."""
    from sglang_rl.drafter import init_drafter, save_drafter
    from test_drafter_checkpoint import write_target

    target = write_target(tmp_path / "target")
    save_drafter(init_drafter(target, seed=0), tmp_path / "draft")
    with caplog.at_level("WARNING", logger="sglang_rl.server_args"):
        RLServerArgs(model_path=str(target), speculative_algorithm="EAGLE", load_format="dummy", device="cpu",
                     speculative_draft_model_path=str(tmp_path / "draft"), speculative_draft_load_format=draft_format)
    assert ("the draft is random" in caplog.text) is warned, caplog.text


def _cotrain_args(tmp_path) -> dict:
    """ServerArgs keywords of a CPU co-training server over a tiny target and its drafter."""
    from sglang_rl.drafter import init_drafter, save_drafter
    from test_drafter_checkpoint import write_target

    target = write_target(tmp_path / "target")
    save_drafter(init_drafter(target, seed=0), tmp_path / "draft")
    return dict(model_path=str(target), speculative_algorithm="EAGLE", drafter_cotrain=True,
                speculative_draft_model_path=str(tmp_path / "draft"), device="cpu")


@pytest.mark.parametrize("other", [{"drafter_cotrain_trainer": "127.0.0.1:1"}, {"dp_size": 2}])
def test_training_in_gaps_needs_the_servers_own_trainer(tmp_path, other: dict) -> None:
    """The idle signal reaches only a trainer process this scheduler started itself."""
    common = _cotrain_args(tmp_path)
    args = RLServerArgs(**common, drafter_cotrain_train_in_gaps=True, drafter_cotrain_gap_max_wait_s=2.5)
    from sglang_rl.adapters.cotrain_config import config_from_args

    config = config_from_args(args)
    assert config.train_in_gaps is True and config.gap_max_wait_s == 2.5
    with pytest.raises(ValueError, match="--drafter-cotrain-train-in-gaps needs the server's own trainer"):
        RLServerArgs(**common, drafter_cotrain_train_in_gaps=True, **other)
    assert config_from_args(RLServerArgs(**common, drafter_cotrain_train_in_gaps=True,
                                         drafter_cotrain_gap_busy_share=0.2)).gap_busy_share == 0.2
    with pytest.raises(ValueError, match="only --drafter-cotrain-train-in-gaps tells the trainer"):
        RLServerArgs(**common, drafter_cotrain_gap_busy_share=0.2)


@pytest.mark.parametrize("change, reason", [
    ({}, None),
    ({"config": {"draft_vocab_size": None}}, "needs a draft with its own LM head"),
    ({"config": {"tie_word_embeddings": True}}, "needs a draft with its own LM head"),
    ({"args": {"tp_size": 2}}, None),
    ({"args": {"tp_size": 2}, "config": {"num_attention_heads": 3}}, "3 attention heads do not split over 2"),
])
def test_eagle3_cotraining_needs_its_own_head_and_heads_that_split(tmp_path, change: dict, reason) -> None:
    """An EAGLE3 drafter co-trains when it has a head of its own to train (as `drafter init --arch
    eagle3` writes one) and, with TP, attention heads that split over the ranks; anything else is
    refused before the server starts, with the reason."""
    import json

    from sglang_rl.drafter.cli import main
    from test_drafter_eagle3 import target as write_target

    target = write_target(tmp_path, tied=False)
    draft = tmp_path / "eagle3"
    assert main(["init", "--arch", "eagle3", "--model-path", str(target), "--out", str(draft)]) == 0
    config = json.loads((draft / "config.json").read_text())
    config.update(change.get("config", {}))
    (draft / "config.json").write_text(json.dumps(config))
    kwargs = dict(model_path=str(target), speculative_algorithm="EAGLE3", drafter_cotrain=True,
                  speculative_draft_model_path=str(draft), device="cpu", **change.get("args", {}))
    if reason is None:
        assert RLServerArgs(**kwargs).drafter_cotrain
    else:
        with pytest.raises(ValueError, match=reason):
            RLServerArgs(**kwargs)


@pytest.mark.parametrize("algorithm", [None, "EAGLE"])
def test_specforge_export_needs_an_eagle3_target(algorithm) -> None:
    """SpecForge's offline records hold the auxiliary layers only an EAGLE3 target captures."""
    with pytest.raises(ValueError, match="--specforge-export-dir needs --speculative-algorithm EAGLE3"):
        RLServerArgs(model_path="unused", speculative_algorithm=algorithm, specforge_export_dir="/tmp/unused")


def test_feature_noise_flag_reaches_the_trainer_config(tmp_path) -> None:
    from sglang_rl.adapters.cotrain_config import config_from_args

    common = _cotrain_args(tmp_path)
    assert config_from_args(RLServerArgs(**common, drafter_cotrain_feature_noise=0.1)).feature_noise == 0.1
    assert config_from_args(RLServerArgs(**common)).feature_noise == 0.0
    with pytest.raises(ValueError, match="feature_noise must be in"):
        config_from_args(RLServerArgs(**common, drafter_cotrain_feature_noise=-1.0))


@pytest.mark.parametrize("change, reason", [
    ({"speculative_algorithm": None}, "--speculative-algorithm EAGLE"),
    ({"drafter_cotrain_lr": 5.0}, r"lr must be in \(0, 1\)"),
    ({"drafter_cotrain_samples_per_round": 0}, "samples_per_round must be a positive"),
    ({"drafter_cotrain_trainer": "127.0.0.1:1"}, "drafter trainer at 127.0.0.1:1 does not answer"),
])
def test_bad_cotrain_options_are_refused(tmp_path, change: dict, reason: str) -> None:
    """What launch_server refuses at start (test/e2e/test_drafter_cotrain.py starts one such server)."""
    common = _cotrain_args(tmp_path)
    assert RLServerArgs(**common).drafter_cotrain  # the same options, without the bad one, are served
    with pytest.raises(ValueError, match=reason):
        RLServerArgs(**{**common, **change})


def test_a_bad_calibration_file_is_refused_with_the_reason(tmp_path, monkeypatch) -> None:
    """The command line as `sglang.launch_server` reads it with the plugin loaded (which puts
    RLServerArgs in the place of sglang's ServerArgs): a calibration file of another format
    version stops the server before anything starts, naming both versions."""
    import argparse
    import json

    import sglang.srt.server_args as sglang_server_args

    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"format": "sglang-rl-toploc-calibration", "version": 9}))
    monkeypatch.setattr(sglang_server_args, "ServerArgs", RLServerArgs)
    parser = argparse.ArgumentParser()
    sglang_server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "unused", "--device", "cpu", "--toploc-verification",
                              "--toploc-verification-calibration", str(bad)])
    with pytest.raises(ValueError, match="calibration version 9, this sglang-rl reads version 1"):
        sglang_server_args.ServerArgs.from_cli_args(args)
