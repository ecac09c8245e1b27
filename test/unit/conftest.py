"""Unit tests: what every one of them shares."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """One torch intra-op thread in the test process: its ops are small, and while other processes
    (the servers `make test` starts ahead for the end-to-end tests) keep a core busy, a 2-thread
    OpenMP pool mostly waits on itself (the CPU-heavy unit files took 117-126 s with 2 threads and
    27-30 s with one, on 2 cores beside running test servers)."""
    import torch

    torch.set_num_threads(1)
