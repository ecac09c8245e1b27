"""Place one generation's hidden-state rows on the columns of verl's padded batch row.

verl's rollout builds ``input_ids = cat(prompts, responses)`` where ``prompts`` is
left-padded to ``max_prompt_len`` (P) and ``responses`` right-padded to
``max_response_len`` (R). For a sample with ``prompt_len`` prompt tokens the real tokens
therefore sit contiguously in columns ``P - prompt_len .. P + response_len - 1``, so
sequence position ``p`` (into ``prompt_ids + response_ids``) maps to column
``P - prompt_len + p`` whether ``p`` is in the prompt or the response.

Rows are placed by their explicit positions, never by counting from either end, and any
sample whose rows cannot be placed unambiguously is refused with a named reason instead
of being silently shifted (the off-by-one and dropped-prefill-row failures described in
the project notes all show up as one of these reasons).
"""

from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from sglang_rl.drafter.sample import AlignedSample

__all__ = [
    "REFUSAL_REASONS",
    "AlignmentRefused",
    "AlignmentStats",
    "AlignedSample",
    "GenerationRows",
    "align_sample",
    "align_batch",
]

REFUSAL_REASONS: tuple[str, ...] = (
    "row_count_mismatch",
    "hidden_size_mismatch",
    "no_rows",
    "position_out_of_range",
    "duplicate_positions",
    "unsorted_positions",
    "non_contiguous_positions",
    "empty_prompt",
    "prompt_too_long",
    "response_too_long",
    "prompt_mismatch",
    "response_mismatch",
    "attention_mask_mismatch",
    "non_finite_rows",
)


class AlignmentRefused(ValueError):
    """A sample's rows cannot be aligned; ``reason`` is one of :data:`REFUSAL_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class AlignmentStats:
    """Counts of accepted samples and of refusals by reason, for logging and metrics."""

    accepted: int = 0
    refused: Counter = field(default_factory=Counter)

    def record_accepted(self) -> None:
        """Count one aligned sample."""
        self.accepted += 1

    def record_refused(self, reason: str) -> None:
        """Count one refused sample under ``reason``."""
        self.refused[reason] += 1

    @property
    def total_refused(self) -> int:
        """Number of refused samples over all reasons."""
        return sum(self.refused.values())

    def as_dict(self) -> dict[str, int]:
        """Flat metrics dict: ``accepted`` plus ``refused/<reason>`` entries."""
        out = {"accepted": self.accepted}
        out.update({f"refused/{reason}": n for reason, n in sorted(self.refused.items())})
        return out


class GenerationRows(NamedTuple):
    """What one generation returned: its token ids and hidden-state rows with positions."""

    prompt_ids: Any
    response_ids: Any
    rows: torch.Tensor
    positions: Sequence[int]


def _as_ids(ids: Any) -> torch.Tensor:
    """Token ids (list or tensor) as a 1-D int64 CPU tensor."""
    return torch.as_tensor(ids, dtype=torch.long).detach().to("cpu").reshape(-1)


def _as_int(value: Any) -> int | None:
    """An integer position (Python/numpy int or integer scalar tensor), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not value.is_floating_point()
        and value.dtype != torch.bool
    ):
        return int(value)
    return None


def _check_positions(positions: Sequence[int], total: int) -> list[int]:
    """Positions must be integers, in range, strictly increasing and gap-free."""
    pos = []
    for p in positions:
        value = _as_int(p)
        if value is None:
            raise AlignmentRefused("position_out_of_range", f"position {p!r} is not an integer")
        pos.append(value)
    if not pos:
        raise AlignmentRefused("no_rows", "the sample has no rows")
    if min(pos) < 0 or max(pos) >= total:
        raise AlignmentRefused(
            "position_out_of_range",
            f"positions span [{min(pos)}, {max(pos)}] but the sample has {total} tokens",
        )
    if len(set(pos)) != len(pos):
        raise AlignmentRefused("duplicate_positions", "a position occurs more than once")
    if any(b < a for a, b in zip(pos, pos[1:])):
        raise AlignmentRefused("unsorted_positions", "positions are not ascending")
    if pos[-1] - pos[0] + 1 != len(pos):
        raise AlignmentRefused(
            "non_contiguous_positions",
            f"{len(pos)} rows spread over positions {pos[0]}..{pos[-1]} (rows were dropped)",
        )
    return pos


def align_sample(
    prompt_ids: Any,
    response_ids: Any,
    rows: torch.Tensor,
    positions: Sequence[int],
    batch_input_ids: torch.Tensor,
    max_prompt_len: int,
    attention_mask: torch.Tensor | None = None,
    hidden_size: int | None = None,
) -> AlignedSample:
    """Align one generation to its verl batch row ``batch_input_ids`` (``[P + R]``).

    ``prompt_ids``/``response_ids`` are the tokens the engine saw and produced,
    ``rows[i]`` is the row at sequence position ``positions[i]``. If ``attention_mask``
    (the batch row's) is given, it must be 1 exactly on the sample's real tokens.

    Raises:
        AlignmentRefused: with the reason the sample cannot be aligned.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] != len(positions):
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise AlignmentRefused(
            "row_count_mismatch", f"rows {shape} do not match {len(positions)} positions"
        )
    if hidden_size is not None and rows.shape[1] != hidden_size:
        raise AlignmentRefused(
            "hidden_size_mismatch", f"rows have width {rows.shape[1]}, expected {hidden_size}"
        )
    prompt = _as_ids(prompt_ids)
    response = _as_ids(response_ids)
    row_ids = _as_ids(batch_input_ids)
    n_prompt, n_resp = prompt.numel(), response.numel()
    total = n_prompt + n_resp
    pos = _check_positions(positions, total)

    if n_prompt == 0:
        raise AlignmentRefused("empty_prompt", "the prompt has no tokens")
    if n_prompt > max_prompt_len:
        raise AlignmentRefused(
            "prompt_too_long", f"{n_prompt} prompt tokens exceed max_prompt_len {max_prompt_len}"
        )
    max_resp_len = row_ids.numel() - max_prompt_len
    if n_resp > max_resp_len:
        raise AlignmentRefused(
            "response_too_long", f"{n_resp} response tokens exceed max_response_len {max_resp_len}"
        )

    offset = max_prompt_len - n_prompt
    end = max_prompt_len + n_resp
    if not torch.equal(row_ids[offset:max_prompt_len], prompt):
        raise AlignmentRefused("prompt_mismatch", "prompt tokens differ from the batch row")
    if not torch.equal(row_ids[max_prompt_len:end], response):
        raise AlignmentRefused("response_mismatch", "response tokens differ from the batch row")
    if attention_mask is not None:
        expected = torch.zeros(row_ids.numel(), dtype=torch.bool)
        expected[offset:end] = True
        got = torch.as_tensor(attention_mask).detach().to("cpu").reshape(-1) != 0
        if not torch.equal(got, expected):
            raise AlignmentRefused(
                "attention_mask_mismatch",
                f"attention mask does not cover exactly columns {offset}..{end - 1}",
            )

    rows = rows.detach().to("cpu")
    if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
        raise AlignmentRefused("non_finite_rows", "rows contain NaN or infinity")

    seq_len = row_ids.numel()
    hidden = torch.zeros(seq_len, rows.shape[1], dtype=torch.bfloat16)
    first_col = offset + pos[0]
    hidden[first_col : first_col + len(pos)] = rows.to(torch.bfloat16)
    row_mask = torch.zeros(seq_len, dtype=torch.bool)
    row_mask[first_col : first_col + len(pos)] = True
    is_response = torch.zeros(seq_len, dtype=torch.bool)
    is_response[max_prompt_len:end] = True
    loss_mask = (row_mask & is_response).to(torch.float32)
    return AlignedSample(
        input_ids=row_ids.clone(),
        hidden_states=hidden,
        row_mask=row_mask,
        loss_mask=loss_mask,
        token_start=offset,
        token_end=end,
        response_start=max_prompt_len,
    )


def align_batch(
    batch: Mapping[str, torch.Tensor],
    outputs: Sequence[GenerationRows],
    stats: AlignmentStats | None = None,
    hidden_size: int | None = None,
) -> list[tuple[int, AlignedSample]]:
    """Align every generation of a verl-style batch; refused samples are counted, not raised.

    ``batch`` needs ``input_ids`` ``[B, P + R]`` and either ``prompts`` ``[B, P]`` or
    ``responses`` ``[B, R]`` (to learn P); ``attention_mask`` is checked when present.
    Returns ``(batch_index, sample)`` for the accepted samples, in batch order.
    """
    input_ids = batch["input_ids"]
    if "prompts" in batch:
        max_prompt_len = int(batch["prompts"].shape[-1])
    elif "responses" in batch:
        max_prompt_len = int(input_ids.shape[-1] - batch["responses"].shape[-1])
    else:
        raise KeyError("batch needs 'prompts' or 'responses' to find the prompt/response boundary")
    if len(outputs) != input_ids.shape[0]:
        raise ValueError(f"{len(outputs)} outputs for a batch of {input_ids.shape[0]} rows")
    attention = batch.get("attention_mask")
    stats = stats if stats is not None else AlignmentStats()
    accepted: list[tuple[int, AlignedSample]] = []
    for i, out in enumerate(outputs):
        try:
            sample = align_sample(
                out.prompt_ids,
                out.response_ids,
                out.rows,
                out.positions,
                input_ids[i],
                max_prompt_len,
                attention_mask=None if attention is None else attention[i],
                hidden_size=hidden_size,
            )
        except AlignmentRefused as refusal:
            stats.record_refused(refusal.reason)
            continue
        stats.record_accepted()
        accepted.append((i, sample))
    return accepted
