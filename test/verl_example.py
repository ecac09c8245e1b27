"""Test access to examples/verl: its scripts, and verl's config as its launcher composes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from omegaconf import DictConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verl"


def example(name: str) -> ModuleType:
    """A script of examples/verl, imported by path."""
    spec = importlib.util.spec_from_file_location(f"verl_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_config(arm: str, model_path: str, drafter_path: str | None, data_dir: str = "/data",
                   **options: object) -> DictConfig:
    """verl's whole config as examples/verl/run_grpo.py composes it for `arm`."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        overrides = example("run_grpo").overrides(arm, model_path, data_dir, drafter_path, **options)
        return compose("ppo_trainer", overrides=overrides)
