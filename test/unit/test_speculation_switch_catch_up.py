"""The catch-up layout of the speculation switch (sglang_rl.speculation.catch_up): which kept rows
each draft extend gets, written out independently here as the list of (position, row) pairs a
request's draft KV must end with."""

from __future__ import annotations

import torch

from sglang_rl.speculation import OffRows, plan_chunks


def test_chunks_cover_every_kept_token_once_oldest_first_ending_at_the_newest() -> None:
    width = 4
    counts = torch.tensor([1, 2, 4, 5, 8, 9, 13])
    chunks = plan_chunks(counts, width, int(counts.max()))
    assert len(chunks) == 4
    for i, count in enumerate(counts.tolist()):
        written = []  # ages in the order their draft KV is last written with their own input
        for chunk in chunks:
            n, top = int(chunk.count[i]), int(chunk.newest_age[i])
            assert 1 <= n <= width and list(chunk.ages[i, :n]) == list(range(top, top - n, -1))
            written += [a for a in range(top, top - n, -1) if a not in written[-1:]]
        assert written == list(range(count - 1, -1, -1)), (count, written)
        assert int(chunks[-1].newest_age[i]) == min(count - 1, width - 1) and int(chunks[-1].ages[i, int(chunks[-1].count[i]) - 1]) == 0


def test_padding_slots_repeat_a_valid_age_of_their_chunk() -> None:
    chunks = plan_chunks(torch.tensor([6]), 4, 6)
    assert [c.ages[0].tolist() for c in chunks] == [[5, 4, 4, 4], [3, 2, 1, 0]]
    assert [int(c.count[0]) for c in chunks] == [2, 4]


def step(pool, pos, h=3):
    pool, pos = torch.tensor(pool), torch.tensor(pos)
    rows = pos[:, None].float() * 10 + pool[:, None].float() + torch.zeros(len(pool), h)
    return pool, pos, rows, pos + 1000  # token: x_{p+1}, tagged by position


def test_gathered_rows_follow_each_request_back_until_it_is_missing() -> None:
    kept = OffRows(capacity=3)
    kept.add(*step([0, 1], [10, 20]))  # oldest
    kept.add(*step([1, 0], [21, 11]))  # order inside a batch changes
    kept.add(*step([0, 2], [12, 5]))  # request 1 missing (retracted), request 2 joined
    kept.add(*step([0, 1, 2], [13, 22, 6]))  # newest kept; capacity 3 drops the oldest
    now_pool, now_pos, now_rows, now_tokens = step([2, 1, 0], [7, 23, 14])
    rows, tokens, counts = kept.gather(now_pool, now_pos, now_rows, now_tokens)
    assert counts.tolist() == [3, 2, 4]  # request 0: 14 (now), 13, 12, 11 (10 was dropped)
    for i, (pool, pos) in enumerate(zip(now_pool.tolist(), now_pos.tolist())):
        for age in range(int(counts[i])):
            assert rows[age, i].tolist() == [(pos - age) * 10.0 + pool] * 3
            assert int(tokens[age, i]) == pos - age + 1000
    assert len(kept) == 3
    kept.clear()
    assert kept.gather(now_pool, now_pos, now_rows, now_tokens)[2].tolist() == [1, 1, 1]


def test_no_capacity_keeps_nothing() -> None:
    kept = OffRows(capacity=0)
    kept.add(*step([0], [3]))
    assert len(kept) == 0
