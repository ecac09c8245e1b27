"""Acceptance of a co-trained drafter per round, counted from what sglang measures per request.

Committed tokens over `spec_verify_ct` of the requests that finished while a round's weights
served. Requests that opted out of co-training (held-out evaluation traffic) are counted
separately, so a caller can measure acceptance on prompts the drafter never trained on. Each
count also keeps sglang's per-request histogram of accepted drafts per verify step (per-position
acceptance: the share of verify steps that accepted at least k drafts) and is split by the
request's sampling temperature ("greedy", "0.7", "1"), so a caller reads held-out acceptance at
T = 0.7.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sglang_rl.drafter.acceptance import at_least_rates, merge_histograms


@dataclasses.dataclass
class Acceptance:
    tokens: int = 0
    verify_steps: int = 0
    histogram: list = dataclasses.field(default_factory=list)  # verify steps by accepted drafts

    def add(self, tokens: int, steps: int, histogram: Any = ()) -> None:
        self.tokens += tokens
        self.verify_steps += steps
        self.histogram = merge_histograms([self.histogram, histogram])

    @property
    def length(self) -> Optional[float]:
        return self.tokens / self.verify_steps if self.verify_steps else None

    def summary(self) -> dict:
        return {"acceptance_length": self.length, "tokens": self.tokens, "verify_steps": self.verify_steps,
                "histogram": self.histogram, "position_acceptance": at_least_rates(self.histogram)}


class RoundCounts:
    """One round's acceptance: all requests, and per sampling-temperature bucket."""

    def __init__(self) -> None:
        self.all = Acceptance()
        self.by_temperature: dict[str, Acceptance] = {}

    def add(self, req: Any, tokens: int, steps: int) -> None:
        histogram = list(getattr(req, "spec_correct_drafts_histogram", None) or ())
        self.all.add(tokens, steps, histogram)
        bucket = temperature_bucket(getattr(req, "sampling_params", None))
        if bucket is not None:
            self.by_temperature.setdefault(bucket, Acceptance()).add(tokens, steps, histogram)


def temperature_bucket(params: Any) -> Optional[str]:
    """"greedy" (sglang normalises temperature 0 to top_k 1), else the temperature ("0.7", "1");
    None when the request carries no sampling parameters."""
    temperature = getattr(params, "temperature", None)
    if temperature is None:
        return None
    if getattr(params, "top_k", None) == 1 or temperature <= 0:
        return "greedy"
    return f"{round(float(temperature), 2):g}"


def _per_round(rounds: list[RoundCounts], keys: tuple[str, str, str, str, str]) -> dict:
    length, tokens, steps, positions, by_temperature = keys
    return {length: [a.all.length for a in rounds], tokens: [a.all.tokens for a in rounds],
            steps: [a.all.verify_steps for a in rounds],
            positions: [at_least_rates(a.all.histogram) for a in rounds],
            by_temperature: [{k: v.summary() for k, v in a.by_temperature.items()} for a in rounds]}


def acceptance_stats(rollouts: list[RoundCounts], held_out: list[RoundCounts]) -> dict:
    """The acceptance fields of GET /drafter_cotrain_stats (one list entry per round)."""
    return {**_per_round(rollouts, ("acceptance_length", "acceptance_tokens", "acceptance_verify_steps",
                                    "position_acceptance", "acceptance_by_temperature")),
            **_per_round(held_out, ("held_out_acceptance_length", "held_out_tokens", "held_out_verify_steps",
                                    "held_out_position_acceptance", "held_out_by_temperature"))}
