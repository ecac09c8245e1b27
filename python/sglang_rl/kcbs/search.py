"""The state of one k-CBS search between two steps, and the candidates it returns."""

from __future__ import annotations

from typing import Callable, Optional


class Beam:
    """One candidate: its tokens, its cumulative renormalised (`score`) and raw log-probs, and
    whether (and why: "stop" or "length") it has finished."""

    __slots__ = ("tokens", "score", "raw", "finished", "reason")

    def __init__(self, tokens: list[int], score: float, raw: float, finished: bool, reason: str) -> None:
        self.tokens, self.score, self.raw, self.finished, self.reason = tokens, score, raw, finished, reason


class BeamSearch:
    """One k-CBS search: width `k`, at most `steps` steps, and the beams kept so far, best first.

    `parents[j]` is the index, among the beams before the last step, of the beam that beam j
    extends. With `keep_all` the last step keeps every candidate instead of the k best."""

    def __init__(self, k: int, steps: int, keep_all: bool) -> None:
        self.k = k
        self.steps = steps
        self.keep_all = keep_all
        self.step = 0
        self.beams: list[Beam] = [Beam([], 0.0, 0.0, False, "length")]
        self.parents: list[int] = []

    def eos_ids(self) -> set[int]:
        """The tokens that end a beam: none here; a search bound to a request knows its own."""
        return set()

    def over(self) -> bool:
        """T steps done, or every candidate has finished."""
        return self.step >= self.steps or all(b.finished for b in self.beams)

    def results(self) -> list[Beam]:
        """The candidates the search returns, best first: all of them with `keep_all`, else the k best."""
        return self.beams if self.keep_all else self.beams[: self.k]


def candidate_fields(beams: list[Beam], decode: Optional[Callable[[list[int]], str]]) -> list[dict]:
    """The candidates as the response lists them (`text` is empty without a decoder)."""
    return [
        {
            "token_ids": list(b.tokens),
            "text": decode(b.tokens) if decode is not None else "",
            "logprob": b.score,
            "raw_logprob": b.raw,
            "finish_reason": b.reason,
        }
        for b in beams
    ]
