"""Co-training's per-request row windows fed the way the scheduler feeds them: several requests
share each decode step's rows, a speculative step commits 1..4 of a request's rows, and a
finished request's sample holds exactly the rows of its positions, in order, as bf16."""

from __future__ import annotations

import random

import torch

from sglang_rl.adapters.cotrain_rows import CotrainRows
from sglang_rl.adapters.decode_step import add_decode_rows
from sglang_rl.adapters.hidden_states import RowCollector
from sglang_rl.hidden_states import HiddenStatesFormat, HiddenStatesMode, HiddenStatesOptions, HiddenStatesScope

H = 8
STRIDE = 4  # rows per request per step (speculative_num_draft_tokens)


class _Req:
    def __init__(self, prompt: int) -> None:
        self.origin_input_ids = list(range(100, 100 + prompt))
        self.output_ids_through_stop: list[int] = []


def _row(position: int, request: int) -> torch.Tensor:
    """A row that names its request and position (small integers: exact in bf16)."""
    return torch.tensor([request, position] + [position % 7] * (H - 2), dtype=torch.float32)


def _run(window: int, steps: int, seed: int) -> tuple[list[_Req], list[CotrainRows]]:
    rng = random.Random(seed)
    reqs = [_Req(prompt) for prompt in (5, 9, 3)]
    windows = [CotrainRows(len(r.origin_input_ids), window) for r in reqs]
    for _ in range(steps):
        rows = torch.full((len(reqs) * STRIDE, H), -1.0)  # rows past each accepted run are junk
        items = []
        for i, (req, rows_of) in enumerate(zip(reqs, windows)):
            count = rng.randint(1, STRIDE)
            position = len(req.origin_input_ids) + len(req.output_ids_through_stop)
            for j in range(count):
                rows[i * STRIDE + j] = _row(position + j, i)
            items.append((rows_of, i * STRIDE, count, position))
            req.output_ids_through_stop += [7] * count
        add_decode_rows(items, rows)
    return reqs, windows


def test_samples_hold_each_positions_row_in_order_as_bf16() -> None:
    reqs, windows = _run(window=512, steps=30, seed=0)
    for i, (req, rows_of) in enumerate(zip(reqs, windows)):
        sample = _sample(rows_of, req, 3)
        prompt = len(req.origin_input_ids)
        end = prompt + len(req.output_ids_through_stop) - 1  # the last token's row predicts nothing
        first = prompt  # no prefill rows here: the first decode step's rows start at the prompt's end
        assert sample.rows.dtype == torch.bfloat16 and sample.policy_version == 3
        assert sample.input_ids.tolist() == (req.origin_input_ids + req.output_ids_through_stop)[first:end]
        assert torch.equal(sample.rows.float(), torch.stack([_row(p, i) for p in range(first, end)]))
        assert sample.response_start == 0
        assert not rows_of.runs and rows_of.done  # the window lets its rows go


def test_a_window_keeps_the_newest_rows() -> None:
    reqs, windows = _run(window=16, steps=40, seed=1)
    for i, (req, rows_of) in enumerate(zip(reqs, windows)):
        sample = _sample(rows_of, req, 0)
        end = len(req.origin_input_ids) + len(req.output_ids_through_stop) - 1
        assert sample.rows.shape == (16, H)
        assert torch.equal(sample.rows.float(), torch.stack([_row(p, i) for p in range(end - 16, end)]))


def test_requests_sharing_a_step_each_get_their_own_rows() -> None:
    """A user's last_n rows and a co-training window in one step share its one copy of the kept
    rows; each gets its own run, and the junk rows past the runs go to neither."""
    options = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR,
                                  scope=HiddenStatesScope.LAST_N, last_n=4)
    user = RowCollector(options, 2, stores=True)
    window = CotrainRows(2, 512)
    rows = torch.stack([_row(2, 0), _row(3, 0), _row(99, 9), _row(99, 9), _row(2, 1), _row(99, 9)])
    add_decode_rows([(user, 0, 2, 2), (window, 4, 1, 2)], rows)
    assert user.segments is None and user.positions == [2, 3] and [run[3] for run in window.runs] == [2]
    assert [block[j].tolist() for block, j in user.rows] == [_row(2, 0).tolist(), _row(3, 0).tolist()]
    assert _window_rows(window) == [_row(2, 1).tolist()]
    rows.fill_(0.0)  # the step's tensor is sglang's to reuse: the kept rows are a copy
    assert [block[j].tolist() for block, j in user.rows] == [_row(2, 0).tolist(), _row(3, 0).tolist()]
    assert _window_rows(window) == [_row(2, 1).tolist()]


def _sample(window: CotrainRows, req: _Req, policy_version: int):
    window.close(req, policy_version)
    return window.sample()


def _window_rows(window: CotrainRows) -> list:
    return [row.tolist() for block, first, count, _ in window.runs for row in block[first:first + count]]


def test_a_sample_drops_rows_past_the_finish_and_takes_recomputed_rows_after_a_retraction() -> None:
    """Prompt rows from a prefill, decode runs whose last rows overshoot the finish, then a
    retraction: the request's prompt and output are prefilled again, so positions repeat with new
    rows (request number 1). The sample ends at the last committed token's input and takes the
    newest row of every position."""
    req = _Req(4)
    window = CotrainRows(4, 512)
    window.add_prefill(torch.stack([_row(p, 0) for p in range(4)]), True)
    for position, count in ((4, 3), (7, 2)):
        window.keep_run(torch.stack([_row(position + j, 0) for j in range(STRIDE)]), 0, count, position)
    req.output_ids_through_stop = [7] * 5  # committed tokens at positions 4..8
    window.add_prefill(torch.stack([_row(p, 1) for p in range(8)]), True, end=8)  # a retraction's prefill
    window.keep_run(torch.stack([_row(8, 1), _row(9, 1), _row(99, 9), _row(99, 9)]), 0, 2, 8)  # 9: past the finish
    sample = _sample(window, req, 0)
    assert sample.input_ids.tolist() == (req.origin_input_ids + req.output_ids_through_stop)[:8]
    assert torch.equal(sample.rows.float(), torch.stack([_row(p, 1) for p in range(8)]))
    assert sample.response_start == 4


def test_a_sample_stops_at_a_gap_and_is_none_without_the_last_row() -> None:
    req = _Req(2)
    req.output_ids_through_stop = [7] * 6  # positions 2..7; the sample wants rows 0..6
    window = CotrainRows(2, 512)
    window.keep_run(torch.stack([_row(p, 0) for p in range(3)]), 0, 3, 0)
    window.keep_run(torch.stack([_row(p, 0) for p in range(4, 7)]), 0, 3, 4)  # position 3 is missing
    sample = _sample(window, req, 0)
    assert torch.equal(sample.rows.float(), torch.stack([_row(p, 0) for p in range(4, 7)]))
    late = CotrainRows(2, 512)
    late.keep_run(torch.stack([_row(p, 0) for p in range(3)]), 0, 3, 0)
    assert _sample(late, req, 0) is None
