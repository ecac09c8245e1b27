"""GPU tests: `make test-gpu` on a machine with CUDA (sglang, toploc and the plugin installed).
Skipped where torch sees no CUDA device; `make test` never collects this folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer() -> Path:
    """The default model's tokenizer files (or SGLANG_RL_MODEL_DIR's folder)."""
    from sglang_rl.default_model import ensure_default_model

    return ensure_default_model()
