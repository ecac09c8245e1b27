"""The sglang-rl flags refuse combinations they cannot serve before the server starts."""

from __future__ import annotations

import pytest

from sglang_rl.server_args import RLServerArgs


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE"])
def test_toploc_refuses_speculative_algorithms_it_cannot_follow(algorithm: str) -> None:
    """EAGLE, NEXTN and NGRAM are served (test/e2e/test_toploc_speculative.py); the others are
    refused before anything starts, with the reason."""
    with pytest.raises(ValueError, match=f"--speculative-algorithm {algorithm}: .*supported: EAGLE, NEXTN, NGRAM"):
        RLServerArgs(model_path="unused", toploc_verification=True, speculative_algorithm=algorithm)


@pytest.mark.parametrize("topk", [0, 4097])
def test_toploc_topk_range(topk: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 4096"):
        RLServerArgs(model_path="unused", toploc_verification=True, toploc_verification_topk=topk)
