"""Rows placed on verl's left-padded batch rows, and the drafter batches and buffer fed from them.

The batches are built by hand the way verl's rollout builds them: prompts left-padded to
P, responses right-padded to R, ``input_ids = cat(prompts, responses)``.
"""

from __future__ import annotations

import pytest
import torch

from sglang_rl.hidden_states import HiddenStatesOptions, decode_rows, encode_rows, select_positions
from sglang_rl.drafter import HiddenStateReplayBuffer, build_eagle_batch, tensor_nbytes
from sglang_rl.integrations.verl import (
    REFUSAL_REASONS,
    AlignmentRefused,
    AlignmentStats,
    GenerationRows,
    align_batch,
    align_sample,
)

PAD = 0
HIDDEN = 8


def _rows_for(positions: list[int], hidden: int = HIDDEN) -> torch.Tensor:
    """Rows that identify their position exactly in bf16 (p // 64 and p % 64 in the first
    two columns, small distinct values elsewhere)."""
    pos = torch.tensor(positions, dtype=torch.float32).reshape(-1, 1)
    rows = (torch.arange(hidden, dtype=torch.float32) / 8.0 + 0.5).repeat(len(positions), 1)
    rows[:, :1] = torch.div(pos, 64, rounding_mode="floor") + 1.0
    rows[:, 1:2] = torch.remainder(pos, 64) + 1.0
    return rows.to(torch.bfloat16)


def _verl_batch(samples: list[tuple[list[int], list[int]]], max_prompt: int, max_resp: int) -> dict:
    """Left-pad prompts, right-pad responses, concatenate: verl's rollout layout."""
    prompts, responses, masks = [], [], []
    for prompt, response in samples:
        prompts.append([PAD] * (max_prompt - len(prompt)) + prompt)
        responses.append(response + [PAD] * (max_resp - len(response)))
        masks.append(
            [0] * (max_prompt - len(prompt))
            + [1] * (len(prompt) + len(response))
            + [0] * (max_resp - len(response))
        )
    prompts_t = torch.tensor(prompts)
    responses_t = torch.tensor(responses)
    return {
        "prompts": prompts_t,
        "responses": responses_t,
        "input_ids": torch.cat([prompts_t, responses_t], dim=1),
        "attention_mask": torch.tensor(masks),
    }


def _generation(prompt: list[int], response: list[int], options, final: bool) -> GenerationRows:
    """What the engine returns, sent through the base64 wire format and back."""
    positions = select_positions(len(prompt), len(response), options, has_final_row=final)
    rows, positions = decode_rows(encode_rows(_rows_for(positions), positions))
    return GenerationRows(prompt, response, rows, positions)


ALL = HiddenStatesOptions.from_request(True)
RESPONSE = HiddenStatesOptions.from_request(True, "base64", "response")

# P = 6, R = 5
SAMPLE_A = ([11, 12, 13], [21, 22, 23, 24])  # short prompt: 3 columns of left padding
SAMPLE_B = ([31, 32, 33, 34, 35, 36], [41, 42, 43, 44, 45])  # fills P and R exactly


def _aligned_ab():
    batch = _verl_batch([SAMPLE_A, SAMPLE_B], 6, 5)
    outputs = [
        _generation(*SAMPLE_A, ALL, final=False),
        _generation(*SAMPLE_B, RESPONSE, final=True),
    ]
    stats = AlignmentStats()
    aligned = align_batch(batch, outputs, stats, hidden_size=HIDDEN)
    return batch, aligned, stats


# --- alignment ---------------------------------------------------------------------------


def test_alignment_places_rows_on_left_padded_columns() -> None:
    batch, aligned, stats = _aligned_ab()
    assert stats.accepted == 2 and stats.total_refused == 0
    (ia, a), (ib, b) = aligned
    assert (ia, ib) == (0, 1)

    # Sample A: offset 3, rows at positions 0..5 (token 6, the last sampled one, has none).
    assert a.input_ids.tolist() == [0, 0, 0, 11, 12, 13, 21, 22, 23, 24, 0]
    assert a.hidden_states.shape == (11, HIDDEN) and a.hidden_states.dtype == torch.bfloat16
    assert a.row_mask.tolist() == [False] * 3 + [True] * 6 + [False] * 2
    assert a.loss_mask.tolist() == [0.0] * 6 + [1.0] * 3 + [0.0] * 2
    assert torch.equal(a.hidden_states[3:9], _rows_for(list(range(6))))
    assert not a.hidden_states[:3].any() and not a.hidden_states[9:].any()
    assert (a.token_start, a.token_end, a.response_start) == (3, 10, 6)
    assert a.row_span == (3, 9)

    # Sample B: no padding, response scope with the final row: positions 6..10 = columns 6..10.
    assert torch.equal(b.input_ids, batch["input_ids"][1])
    assert b.row_mask.tolist() == [False] * 6 + [True] * 5
    assert b.loss_mask.tolist() == [0.0] * 6 + [1.0] * 5
    assert torch.equal(b.hidden_states[6:], _rows_for(list(range(6, 11))))


def test_trimmed_sample_drops_padding() -> None:
    _, aligned, _ = _aligned_ab()
    a = aligned[0][1]
    t = a.trimmed()
    assert t.input_ids.tolist() == [11, 12, 13, 21, 22, 23, 24]
    assert (t.token_start, t.token_end, t.response_start) == (0, 7, 3)
    assert torch.equal(t.hidden_states, a.hidden_states[3:10])
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0]
    assert t.nbytes < a.nbytes


def _refusal(prompt, response, rows, positions, batch_row, P=6, **kw) -> str:
    with pytest.raises(AlignmentRefused) as info:
        align_sample(prompt, response, rows, positions, batch_row, P, **kw)
    assert info.value.reason in REFUSAL_REASONS
    return info.value.reason


def test_each_refusal_reason() -> None:
    batch = _verl_batch([SAMPLE_A], 6, 5)
    row = batch["input_ids"][0]
    mask = batch["attention_mask"][0]
    p, r = SAMPLE_A
    ok = list(range(6))
    rows = _rows_for(ok)

    assert _refusal(p, r, rows[:5], ok, row) == "row_count_mismatch"
    assert _refusal(p, r, rows, ok, row, hidden_size=16) == "hidden_size_mismatch"
    assert _refusal(p, r, rows[:0], [], row) == "no_rows"
    past_end = [2, 3, 4, 5, 6, 7]
    assert _refusal(p, r, _rows_for(past_end), past_end, row) == "position_out_of_range"
    assert _refusal(p, r, rows, [0, 1, 2, 2, 3, 4], row) == "duplicate_positions"
    assert _refusal(p, r, rows, [0, 2, 1, 3, 4, 5], row) == "unsorted_positions"
    assert _refusal(p, r, rows[:5], [0, 1, 3, 4, 5], row) == "non_contiguous_positions"
    assert _refusal([], r, rows[:3], [0, 1, 2], row) == "empty_prompt"
    assert _refusal(list(range(1, 8)), r, rows, ok, row) == "prompt_too_long"
    assert _refusal(p, r + [25, 26], rows, ok, row) == "response_too_long"
    assert _refusal([11, 12, 99], r, rows, ok, row) == "prompt_mismatch"
    assert _refusal(p, [21, 22, 23, 99], rows, ok, row) == "response_mismatch"
    bad_mask = mask.clone()
    bad_mask[2] = 1
    assert _refusal(p, r, rows, ok, row, attention_mask=bad_mask) == "attention_mask_mismatch"
    nan_rows = rows.clone()
    nan_rows[1, 0] = float("nan")
    assert _refusal(p, r, nan_rows, ok, row) == "non_finite_rows"
    align_sample(p, r, rows, ok, row, 6, attention_mask=mask, hidden_size=HIDDEN)


def test_refusals_are_counted_per_reason() -> None:
    samples = [SAMPLE_A, SAMPLE_B, SAMPLE_A, SAMPLE_B, SAMPLE_A]
    batch = _verl_batch(samples, 6, 5)
    good_a = _generation(*SAMPLE_A, ALL, final=False)
    good_b = _generation(*SAMPLE_B, ALL, final=True)
    dropped_prefill_row = GenerationRows(
        SAMPLE_B[0], SAMPLE_B[1], torch.cat([good_b.rows[:2], good_b.rows[3:]]),
        good_b.positions[:2] + good_b.positions[3:],
    )
    shifted = [p + 2 for p in good_a.positions]
    shifted_past_end = GenerationRows(SAMPLE_A[0], SAMPLE_A[1], good_a.rows, shifted)
    wrong_prompt = GenerationRows([11, 12, 14], SAMPLE_A[1], good_a.rows, good_a.positions)
    outputs = [good_a, dropped_prefill_row, shifted_past_end, good_b, wrong_prompt]
    stats = AlignmentStats()
    aligned = align_batch(batch, outputs, stats)
    assert [i for i, _ in aligned] == [0, 3]
    assert stats.accepted == 2
    assert stats.refused == {
        "non_contiguous_positions": 1,
        "position_out_of_range": 1,
        "prompt_mismatch": 1,
    }
    assert stats.as_dict() == {
        "accepted": 2,
        "refused/non_contiguous_positions": 1,
        "refused/position_out_of_range": 1,
        "refused/prompt_mismatch": 1,
    }
    align_batch(batch, outputs, stats)
    assert stats.accepted == 4 and stats.total_refused == 6


def test_align_batch_without_prompts_key_uses_responses_width() -> None:
    batch = _verl_batch([SAMPLE_A], 6, 5)
    del batch["prompts"]
    aligned = align_batch(batch, [_generation(*SAMPLE_A, ALL, final=False)])
    assert aligned[0][1].response_start == 6
    with pytest.raises(ValueError):
        align_batch(batch, [])


# --- batch -------------------------------------------------------------------------------


def test_batch_shapes_and_shift() -> None:
    _, aligned, _ = _aligned_ab()
    batch = build_eagle_batch([s for _, s in aligned])
    assert batch is not None
    keys = {"input_ids", "hidden_states", "target", "loss_mask", "position_ids", "cu_seqlens"}
    assert set(batch) == keys
    # A: 6 rows (positions 0..5) -> 5 pairs; B: 5 rows (positions 6..10) -> 4 pairs.
    L = 9
    assert batch["input_ids"].shape == (1, L) and batch["input_ids"].dtype == torch.long
    assert batch["hidden_states"].shape == (1, L, HIDDEN)
    assert batch["target"].shape == (1, L, HIDDEN)
    assert batch["hidden_states"].dtype == batch["target"].dtype == torch.bfloat16
    assert batch["loss_mask"].shape == (1, L) and batch["loss_mask"].dtype == torch.float32
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert batch["cu_seqlens"].tolist() == [0, 5, 9] and batch["cu_seqlens"].dtype == torch.int32

    # pair i: hidden = row p, input token = token p + 1 (sampled from row p), target = row p + 1
    assert batch["input_ids"].tolist() == [[12, 13, 21, 22, 23, 42, 43, 44, 45]]
    assert torch.equal(batch["hidden_states"][0, :5], _rows_for([0, 1, 2, 3, 4]))
    assert torch.equal(batch["target"][0, :5], _rows_for([1, 2, 3, 4, 5]))
    assert torch.equal(batch["hidden_states"][0, 5:], _rows_for([6, 7, 8, 9]))
    assert torch.equal(batch["target"][0, 5:], _rows_for([7, 8, 9, 10]))
    # no pair straddles the two samples
    assert torch.equal(batch["target"][0, 4], _rows_for([5])[0])
    assert torch.equal(batch["hidden_states"][0, 5], _rows_for([6])[0])
    # loss only where the target row belongs to a response token; the pair from the last
    # prompt row to the first response row counts.
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1]]


def test_batch_window_limits_pairs_and_skips_short_samples() -> None:
    prompt = list(range(1, 1501))
    response = list(range(2001, 2549))
    batch_tensors = _verl_batch([(prompt, response), ([7], [8])], 1500, 548)
    outputs = [
        _generation(prompt, response, ALL, final=True),
        _generation([7], [8], ALL, final=False),  # a single row: no pair to train on
    ]
    aligned = [s.trimmed() for _, s in align_batch(batch_tensors, outputs)]
    assert len(aligned) == 2
    batch = build_eagle_batch(aligned, window=512)
    assert batch["cu_seqlens"].tolist() == [0, 511]
    assert batch["hidden_states"].shape == (1, 511, HIDDEN)
    assert torch.equal(batch["hidden_states"][0, 0], _rows_for([1536])[0])
    assert torch.equal(batch["target"][0, -1], _rows_for([2047])[0])
    assert batch["input_ids"][0, -1].item() == response[-1]
    assert batch["loss_mask"].sum().item() == 511
    assert build_eagle_batch([aligned[1]]) is None
    assert build_eagle_batch([]) is None


# --- replay buffer -----------------------------------------------------------------------


def test_buffer_budgets_aligned_samples() -> None:
    _, aligned, _ = _aligned_ab()
    a, b = aligned[0][1].trimmed(), aligned[1][1].trimmed()
    assert tensor_nbytes(a) == a.nbytes == 7 * 8 + 7 * HIDDEN * 2 + 7 * 1 + 7 * 4
    buf = HiddenStateReplayBuffer(max_bytes=a.nbytes + b.nbytes)
    buf.add(a)
    buf.add(b)
    assert buf.nbytes == a.nbytes + b.nbytes
    buf.add(a)
    assert buf.get_all()[0] is b and len(buf) == 2


def test_audit_counts_verified_rollouts_per_rl_step() -> None:
    from sglang_rl.integrations.verl.audit import by_step

    results = [({"global_steps": 2}, {"verified": True}), ({"global_steps": 1}, {"verified": False}),
               ({"global_steps": 2}, {"error": "timeout"}), ({"global_steps": 1}, {"verified": True}),
               ({}, {"verified": True})]
    assert by_step(results) == {1: (1, 2), 2: (1, 2), None: (1, 1)}
