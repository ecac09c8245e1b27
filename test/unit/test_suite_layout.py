"""The test suites share one pytest session (`make test` collects test/unit and test/e2e
together), and pytest's default import mode needs every test module's basename to be unique."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TEST_ROOT = Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique_across_the_suites() -> None:
    names = Counter(path.name for suite in ("unit", "e2e", "gpu") for path in (TEST_ROOT / suite).glob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
