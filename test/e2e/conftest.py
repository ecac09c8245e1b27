"""Fixtures of the end-to-end suite: real servers on the CPU, started the way these tests need.

Every server of this suite runs with `--sleep-on-idle` and OMP_NUM_THREADS=1 (unless the caller's
environment sets it): on CPU an idle sglang scheduler otherwise busy-polls a whole core, and on the
shared 2-core test machine a 2-thread OpenMP pool in each server made batches 5-30x slower. Neither
changes what the server computes beyond float summation order, which TOPLOC tolerates by design.
`toploc_server` overrides the fixture of test/conftest.py for this directory only.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from e2e_servers import Server, start_server
from hidden_states_fixtures import hf, hs_noradix_server, hs_server, refusal_server  # noqa: F401 - fixtures


@pytest.fixture(scope="session")
def toploc_server(model_path: str) -> Iterator[Server]:
    """The main test server: --toploc-verification, radix cache on, default chunked prefill."""
    server = start_server(model_path, "--toploc-verification", log_name="toploc")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_server(model_path: str) -> Iterator[Server]:
    """The plugin loaded (through its entry point) but no sglang-rl flag given. Stopped early, at
    the end of test_toploc_hostile.py (the last module using it), to free memory."""
    server = start_server(model_path, log_name="plain")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
