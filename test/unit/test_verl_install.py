"""The GPU install route for verl that docs/verl.md gives: it resolves, and it is what `make test` runs.

`scripts/setup_cpu.sh` resolves `requirements/verl-gpu.txt` with uv's overrides from PyPI's metadata
for CUDA Linux (no download of the packages) into `.venv/verl-resolution.txt`; when the resolution
fails it leaves uv's error in `.venv/verl-resolution.err` instead. The CPU environment installs
verl with `--no-deps`, so the versions its verl tests run on are compared with the resolved ones.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESOLUTION = ROOT / ".venv" / "verl-resolution.txt"
ERROR = ROOT / ".venv" / "verl-resolution.err"
INSTALL = "uv pip install --override requirements/verl-overrides.txt -r requirements/verl-gpu.txt"
# what verl imports on its rollout-server and trainer path in the CPU tests; torch is not here:
# the CPU environment runs a CPU build of another torch, the route installs sglang's CUDA one
VERL_RUNTIME = ("verl", "sglang", "transformers", "ray", "tensordict", "transferqueue", "datasets", "torchdata", "peft")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _resolution() -> tuple[dict[str, str], list[str]]:
    """The resolved pins (name -> version) and the local directories of the resolution file."""
    if not RESOLUTION.exists():
        why = ERROR.read_text()[-3000:] if ERROR.exists() else "no resolution was run"
        raise AssertionError(f"the verl GPU route did not resolve (scripts/setup_cpu.sh):\n{why}")
    pins: dict[str, str] = {}
    local: list[str] = []
    for line in RESOLUTION.read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            pins[_norm(match[1])] = match[2]
        elif line.startswith("./"):
            local.append(line.strip())
    return pins, local


def test_the_route_resolves_verl_sglang_and_the_plugin_together() -> None:
    pins, local = _resolution()
    assert pins.get("verl") == "0.9.1" and pins.get("sglang") == "0.5.17", pins
    # sglang's pin wins over verl's cap, and sglang's CUDA torch comes with it
    assert pins.get("transformers") == "5.12.1" and pins.get("torch") == "2.11.0", pins
    # verl's sglang rollout needs TransferQueue (verl-core), the plugin needs toploc
    assert "transferqueue" in pins and pins.get("toploc") == "0.1.6", pins
    assert local == ["./python", "./client"], local


def test_the_overrides_lift_only_verls_transformers_cap() -> None:
    lines = (ROOT / "requirements" / "verl-overrides.txt").read_text().splitlines()
    overrides = [line for line in lines if line.strip() and not line.startswith("#")]
    assert overrides == ["transformers==5.12.1"], overrides


def test_the_cpu_tests_run_verl_on_the_resolved_versions() -> None:
    pins, _ = _resolution()
    differ = {}
    for name in VERL_RUNTIME:
        installed = importlib.metadata.version(name)
        if installed != pins.get(name):
            differ[name] = (installed, pins.get(name))
    assert not differ, f"installed in .venv vs resolved for the GPU route: {differ}"


def test_the_docs_give_the_command_that_is_resolved() -> None:
    docs = (ROOT / "docs" / "verl.md").read_text()
    install = docs.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert INSTALL in install
