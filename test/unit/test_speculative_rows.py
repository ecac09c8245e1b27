"""The speculative-decoding pieces of hidden-state delivery: which algorithms are refused, and the
move of each request's accepted rows to the front of its block (NGRAM's draft trees)."""

from __future__ import annotations

import pytest
import torch

from sglang_rl.adapters.speculative import accepted_rows_to_front, check_rows_supported
from sglang_rl.request_options import RequestOptionError


@pytest.mark.parametrize("algorithm", [None, "", "EAGLE", "NEXTN", "NGRAM", "eagle"])
def test_algorithms_whose_rows_follow_committed_tokens(algorithm) -> None:
    check_rows_supported(algorithm)


@pytest.mark.parametrize("algorithm,reason", [
    ("EAGLE3", "auxiliary layers"), ("STANDALONE", "prefill"), ("DFLASH", "not known"),
])
def test_other_algorithms_are_refused_with_the_reason(algorithm, reason) -> None:
    with pytest.raises(RequestOptionError) as err:
        check_rows_supported(algorithm)
    assert algorithm in str(err.value) and reason in str(err.value) and "supported: EAGLE" in str(err.value)


def test_accepted_rows_move_to_the_front_of_their_block() -> None:
    """Against a plain loop: request i's j-th accepted row lands at row i*block + j; rows past the
    accepted run keep what they held."""
    gen = torch.Generator().manual_seed(0)
    block, width, n_req = 6, 4, 5
    rows = torch.randn(n_req * block, 3, generator=gen)
    accept = torch.full((n_req, width), -1, dtype=torch.int32)
    for i in range(n_req):
        # a root, then a path down the tree: increasing node indices within the block, skipping
        # side branches
        run = 1 + i % width
        nodes = [0] + sorted(torch.randperm(block - 1, generator=gen)[:run - 1].add(1).tolist())
        accept[i, :run] = torch.tensor([i * block + n for n in nodes], dtype=torch.int32)
    out = accepted_rows_to_front(rows, accept, block)
    expect = rows.clone()
    for i in range(n_req):
        for j in range(width):
            if accept[i, j] >= 0:
                expect[i * block + j] = rows[int(accept[i, j])]
    assert torch.equal(out, expect)
    assert not torch.equal(out, rows)  # some request did take a side branch
