"""The installed `sglang-rl` command: its subcommands, one-line errors, exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_rl.cli import COMMANDS, main

SGLANG_RL = Path(sys.executable).parent / "sglang-rl"  # the console script pip installed beside python


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SGLANG_RL), *args], capture_output=True, text=True, timeout=300)


def test_the_command_lists_every_subcommand() -> None:
    res = run("--help")
    assert res.returncode == 0, res.stderr
    for name in COMMANDS:
        assert f"  {name} " in res.stdout, res.stdout
    assert run().returncode == 2
    res = run("frobnicate")
    assert res.returncode == 2 and res.stderr.strip() == (
        "sglang-rl: error: unknown command 'frobnicate' (one of: " + ", ".join(COMMANDS) + ")")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_help_and_refuses_an_unknown_flag_in_one_line(name: str, monkeypatch, capsys) -> None:
    # --help in this process (an interpreter less per subcommand); the refusal in the installed
    # command, where whatever the subcommand's imports print to stderr would show
    monkeypatch.setattr(sys, "argv", [str(SGLANG_RL), name, "--help"])
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    out = capsys.readouterr()
    assert exited.value.code == 0 and f"usage: sglang-rl {name}" in out.out, out.out + out.err
    res = run(name, "--no-such-flag")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"sglang-rl {name}"), res.stderr


def test_a_missing_model_folder_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    for args in (("calibrate", "--model-path", str(tmp_path / "none"), "--out", str(tmp_path / "c.json")),
                 ("calibrate-server", "--generator", "http://127.0.0.1:9", "--verifier", "http://127.0.0.1:9",
                  "--model-path", str(tmp_path / "none"), "--config", "x", "--out", str(tmp_path / "r.jsonl")),
                 ("drafter", "init", "--model-path", str(tmp_path / "none"), "--out", str(tmp_path / "d"))):
        res = run(*args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert "Traceback" not in res.stderr and str(tmp_path / "none") in lines[0], res.stderr


def test_model_prints_the_default_model_folder(model_path: str) -> None:
    res = run("model")
    assert res.returncode == 0 and res.stdout.strip() == model_path, res.stdout + res.stderr
    assert (Path(res.stdout.strip()) / "config.json").is_file()


def test_drafter_widen_is_routed_to_the_widen_package(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", [str(SGLANG_RL)])  # main names the program in argv[0]
    with pytest.raises(SystemExit) as exited:
        main(["drafter", "widen", "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and "usage: sglang-rl drafter widen" in out and "--drafter-path" in out, out
    assert main(["drafter", "widen", "--drafter-path", "/nonexistent", "--model-path", "/nonexistent",
                 "--out", "/tmp/unused"]) == 2
