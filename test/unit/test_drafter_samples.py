"""The drafter's training windows and its replay buffer bounded by bytes."""

from __future__ import annotations

import pytest
import torch

from sglang_rl.drafter import HiddenStateReplayBuffer, select_window


def test_window_seed_example() -> None:
    # 1500 prompt + 548 response tokens: the first 36 response tokens are cut.
    assert select_window(2048, 1500) == slice(1536, 2048)
    assert select_window(2048, 1500, window=512) == slice(1536, 2048)


def test_window_rules() -> None:
    assert select_window(300, 100) == slice(0, 300)
    assert select_window(512, 0) == slice(0, 512)
    assert select_window(0, 0) == slice(0, 0)
    # response (200 tokens) fits: whole response plus the context right before it
    assert select_window(1000, 800) == slice(488, 1000)
    # response ends before the sequence does: the window ends at the response end
    assert select_window(1000, 600, response_end=900) == slice(388, 900)
    assert select_window(1000, 100, response_end=300) == slice(0, 512)
    assert select_window(10, 4, window=3) == slice(7, 10)
    for bad in [(100, 101), (100, -1), (100, 50, 0)]:
        with pytest.raises(ValueError):
            select_window(*bad)
    with pytest.raises(ValueError):
        select_window(100, 50, response_end=120)



def _blob(nbytes: int, tag: int) -> dict:
    return {"tag": tag, "h": torch.zeros(nbytes // 4, dtype=torch.float32)}


def test_buffer_evicts_oldest_by_bytes() -> None:
    buf = HiddenStateReplayBuffer(max_bytes=1000)
    for i in range(10):
        assert buf.add(_blob(100, i))
    assert len(buf) == 10 and buf.nbytes == 1000
    assert buf.add(_blob(400, 10))
    assert [s["tag"] for s in buf.get_all()] == [4, 5, 6, 7, 8, 9, 10]
    assert buf.nbytes == 1000 and buf.evicted == 4
    # many small samples fit where few large ones do: the bound is bytes, not count
    for i in range(11, 61):
        buf.add(_blob(20, i))
    assert len(buf) == 50 and buf.nbytes == 1000
    # a sample larger than the whole budget is refused and evicts nothing
    assert not buf.add(_blob(2000, 99))
    assert buf.rejected == 1 and len(buf) == 50 and buf.nbytes <= buf.max_bytes
    buf.clear()
    assert len(buf) == 0 and buf.nbytes == 0
    with pytest.raises(ValueError):
        HiddenStateReplayBuffer(0)


def test_buffer_steps() -> None:
    buf = HiddenStateReplayBuffer(max_bytes=10_000)
    buf.add(_blob(40, 0))
    buf.increment_step()
    buf.add(_blob(40, 1))
    buf.add(_blob(40, 2))
    buf.increment_step()
    buf.add(_blob(40, 3))
    assert buf.current_step == 2
    assert [s["tag"] for s in buf.get_data_from_last_n_steps(1)] == [3]
    assert [s["tag"] for s in buf.get_data_from_last_n_steps(2)] == [1, 2, 3]
    assert [s["tag"] for s in buf.get_data_from_last_n_steps(10)] == [0, 1, 2, 3]
    assert buf.get_data_from_last_n_steps(0) == []
    buf.add(_blob(40, 4), step=5)
    assert buf.current_step == 5
    assert [s["tag"] for s in buf.get_data_from_last_n_steps(1)] == [4]
    buf.add(_blob(40, 5), step=1)
    assert [s["tag"] for s in buf.get_data_from_last_n_steps(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        buf.add(_blob(40, 6), step=-1)
