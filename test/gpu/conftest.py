"""GPU tests: `make test-gpu` on a machine with CUDA (sglang, toploc and the plugin installed).
Skipped where torch sees no CUDA device; `make test` never collects this folder."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        item.add_marker(skip)
