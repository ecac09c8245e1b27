"""Verify many responses on a verifier server: batched, concurrent, retried, in input order.

A verifier is an sglang-rl server started with ``--toploc-verification`` that serves the agreed
model. Each response is checked in the exact-token form: ``/generate`` with ``input_ids +
output_ids`` as the prompt, ``max_new_tokens: 0`` and the fingerprint in
``toploc_verification_fingerprint_to_validate``. Several responses go in one request (a batch, one
fingerprint per item) and several requests are in flight at once, so the server batches their
prefills.

Each response gets an ``Outcome``: the server's result (``verified`` true or false) or a one-line
``error`` when it could not be checked (a malformed item, a server that refused it, did not answer
or answered 5xx after the retries). One bad item never costs its batch: a batch refused with 4xx
is sent again item by item.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from sglang_rl_client.fingerprint import FingerprintError, decode_fingerprint
from sglang_rl_client.transport import ServerError, Transport, one_line

FINGERPRINTS_FIELD = "toploc_verification_fingerprints"
FINGERPRINT_TO_VALIDATE = "toploc_verification_fingerprint_to_validate"
EXPECT_GREEDY = "toploc_verification_expect_greedy"
EXPECT_SAMPLED = "toploc_verification_expect_sampled"
MAX_NEW_TOKENS = "toploc_verification_max_new_tokens"
EXPECT_SEEDED = "toploc_verification_expect_seeded"
# what a seeded claim may state, in sglang's sampling_params names (`seed` is sglang's sampling_seed)
SEEDED_CLAIM_KEYS = ("seed", "temperature", "top_p", "top_k", "min_p")
RESULT_FIELD = "toploc_verification_fingerprint_validation_result"
GENERATE_ENDPOINT = "/generate"

VERIFIED, FAILED, ERROR = "verified", "failed", "error"
RESERVED_KEYS = ("input_ids", "output_ids", "fingerprint", FINGERPRINTS_FIELD, "worker", "max_new_tokens",
                 "seeded_sampling")
"""The keys of a rollout record that ``Rollout.from_dict`` reads; the others are the caller's."""


class RolloutError(ValueError):
    """An item that cannot be sent for verification (missing or malformed fields)."""


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise RolloutError(f"{name} must be a list of non-negative integer token ids")
    return list(value)


@dataclass(frozen=True)
class Rollout:
    """One generated response to verify: its prompt and response token ids and its fingerprint
    (the last element of the response's ``toploc_verification_fingerprints``).

    ``expect_greedy`` / ``expect_sampled`` ask the verifier to also check how the tokens were
    chosen (argmax at temperature 0, or the sampling test at temperature 1). ``max_new_tokens``
    is the limit it was generated with: a response that ends without EOS must have reached it
    (the termination check). ``worker`` names who generated it (for worker verdicts) and ``data``
    is the caller's, carried to the outcome. ``seeded_sampling`` is the sampling a response
    generated with the seeded sampler claims (``seed`` and, as sglang names them, ``temperature``,
    ``top_p``, ``top_k``, ``min_p``): the verifier then recomputes every token (expect_seeded).
    """

    input_ids: Sequence[int]
    output_ids: Sequence[int]
    fingerprint: str
    worker: Optional[str] = None
    expect_greedy: bool = False
    expect_sampled: bool = False
    data: Mapping[str, Any] = field(default_factory=dict)
    max_new_tokens: Optional[int] = None
    seeded_sampling: Optional[Mapping[str, Any]] = None

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], worker: Optional[str] = None, **expect: bool) -> Rollout:
        """A rollout from a record with ``input_ids``, ``output_ids`` and ``fingerprint`` (or the
        response field ``toploc_verification_fingerprints``), optionally ``worker``,
        ``max_new_tokens`` and ``seeded_sampling``; the other keys become ``data``. Raises RolloutError naming what is
        missing."""
        if not isinstance(record, Mapping):
            raise RolloutError(f"expected a JSON object, got {type(record).__name__}")
        fingerprint = record.get("fingerprint")
        if fingerprint is None and isinstance(record.get(FINGERPRINTS_FIELD), list) and record[FINGERPRINTS_FIELD]:
            fingerprint = record[FINGERPRINTS_FIELD][-1]
        missing = [k for k, v in (("input_ids", record.get("input_ids")), ("output_ids", record.get("output_ids")),
                                  ("fingerprint", fingerprint)) if v is None]
        if missing:
            raise RolloutError(f"missing key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        name = worker if record.get("worker") is None else record["worker"]
        kept = {k: v for k, v in record.items() if k not in RESERVED_KEYS}
        return cls(record["input_ids"], record["output_ids"], fingerprint,
                   worker=None if name is None else str(name), data=kept,
                   max_new_tokens=record.get("max_new_tokens"), seeded_sampling=record.get("seeded_sampling"),
                   **expect)

    def check(self) -> None:
        """Refuse locally what the verifier would refuse: ids that are not token ids, a malformed
        fingerprint, one that covers another number of tokens than ``output_ids`` holds."""
        _token_ids(self.input_ids, "input_ids")
        output = _token_ids(self.output_ids, "output_ids")
        if not self.input_ids:
            raise RolloutError("input_ids is empty (the prompt holds at least one token)")
        if not isinstance(self.fingerprint, str):
            raise RolloutError(f"fingerprint must be a string, got {type(self.fingerprint).__name__}")
        try:
            fp = decode_fingerprint(self.fingerprint)
        except FingerprintError as exc:
            raise RolloutError(f"invalid fingerprint: {exc}") from None
        if fp.n_rows != len(output):
            raise RolloutError(f"the fingerprint covers {fp.n_rows} tokens, output_ids holds {len(output)}")
        if self.expect_greedy and self.expect_sampled:
            raise RolloutError("expect_greedy and expect_sampled exclude each other")
        limit = self.max_new_tokens
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RolloutError(f"max_new_tokens must be a positive integer, got {limit!r}")
        if self.seeded_sampling is not None:
            self._check_seeded_claim()

    def _check_seeded_claim(self) -> None:
        claim = self.seeded_sampling
        if not isinstance(claim, Mapping):
            raise RolloutError(f"seeded_sampling must be an object, got {type(claim).__name__}")
        unknown = sorted(set(claim) - set(SEEDED_CLAIM_KEYS))
        if unknown:
            raise RolloutError(f"seeded_sampling has unknown key(s) {', '.join(unknown)} "
                               f"(known: {', '.join(SEEDED_CLAIM_KEYS)})")
        seed = claim.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise RolloutError(f"seeded_sampling needs an integer seed, got {seed!r}")
        if self.expect_greedy or self.expect_sampled:
            raise RolloutError("seeded_sampling excludes expect_greedy and expect_sampled")

    def sampling_params(self) -> dict[str, Any]:
        """The item's sampling parameters in a verification request."""
        params: dict[str, Any] = {"max_new_tokens": 0}
        if self.expect_greedy:
            params[EXPECT_GREEDY] = True
        if self.expect_sampled:
            params[EXPECT_SAMPLED] = True
        if self.max_new_tokens is not None:
            params[MAX_NEW_TOKENS] = self.max_new_tokens
        if self.seeded_sampling is not None:
            params[EXPECT_SEEDED] = True
            for key, value in self.seeded_sampling.items():
                params["sampling_seed" if key == "seed" else key] = value
        return params


@dataclass
class Outcome:
    """What became of one item: the server's ``result`` or a one-line ``error``.

    ``index`` is the item's position in the input, ``rollout`` the item (None when the caller
    passed an error in its place).
    """

    index: int
    rollout: Optional[Rollout]
    result: Optional[dict[str, Any]] = None
    error: Optional[str] = None

    @property
    def verified(self) -> Optional[bool]:
        """The server's verdict; None when the item could not be checked."""
        return None if self.result is None else self.result.get("verified") is True

    @property
    def band(self) -> Optional[str]:
        """The server's verdict band (pass, suspect, fail); None when the item could not be
        checked or the check did not run."""
        from sglang_rl_client.bands import band_of_report

        return None if self.result is None else band_of_report(self.result)

    @property
    def status(self) -> str:
        """``verified``, ``failed`` (the server checked it: not verified) or ``error``."""
        if self.result is None:
            return ERROR
        return VERIFIED if self.verified else FAILED


def request_body(rollouts: Sequence[Rollout]) -> dict[str, Any]:
    """The /generate body that verifies these rollouts (one item, or a batch of them)."""
    ids = [list(r.input_ids) + list(r.output_ids) for r in rollouts]
    params = [r.sampling_params() for r in rollouts]
    fps = [r.fingerprint for r in rollouts]
    if len(rollouts) == 1:
        return {"input_ids": ids[0], "sampling_params": params[0], FINGERPRINT_TO_VALIDATE: fps[0]}
    return {"input_ids": ids, "sampling_params": params, FINGERPRINT_TO_VALIDATE: fps}


def results_of(answer: Any, count: int) -> list[dict[str, Any]]:
    """The parsed results in a /generate answer to ``count`` verification items."""
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != count:
        raise ServerError(f"the verifier answered {len(items)} items for {count}")
    out = []
    for item in items:
        raw = item.get("meta_info", {}).get(RESULT_FIELD) if isinstance(item, dict) else None
        if raw is None:
            raise ServerError(f"the verifier's answer has no {RESULT_FIELD} "
                              "(is it an sglang-rl server with --toploc-verification?)")
        result = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(result, dict):
            raise ServerError(f"the verifier's {RESULT_FIELD} is not an object")
        out.append(result)
    return out


Item = Union[Rollout, BaseException]


class VerifierClient:
    """A verifier server, asked about responses in batches of ``batch_size`` with ``concurrency``
    requests in flight (see the module docstring); ``transport`` options (``api_key``,
    ``timeout``, ``retries``, ``backoff``) are keyword arguments of the constructor."""

    def __init__(self, url: str, *, batch_size: int = 8, concurrency: int = 4, **transport: Any) -> None:
        if batch_size < 1 or concurrency < 1:
            raise ValueError("batch_size and concurrency must be at least 1")
        self.transport = Transport(url, **transport)
        self.batch_size = batch_size
        self.concurrency = concurrency

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self.transport.url

    def verify(self, rollout: Rollout) -> dict[str, Any]:
        """The server's result for one rollout; raises RolloutError or ServerError."""
        rollout.check()
        return results_of(self.transport.post(GENERATE_ENDPOINT, request_body([rollout])), 1)[0]

    def verify_batch(self, rollouts: Sequence[Rollout], first_index: int = 0) -> list[Outcome]:
        """One outcome per rollout, in order: checked locally, sent as one request, and sent again
        one by one if the server refused the batch (4xx), so that the bad item alone fails."""
        outcomes = [Outcome(first_index + i, r) for i, r in enumerate(rollouts)]
        ready = []
        for outcome in outcomes:
            try:
                outcome.rollout.check()
                ready.append(outcome)
            except RolloutError as exc:
                outcome.error = str(exc)
        if not ready:
            return outcomes
        try:
            body = request_body([o.rollout for o in ready])
            for outcome, result in zip(ready, results_of(self.transport.post(GENERATE_ENDPOINT, body), len(ready))):
                outcome.result = result
        except ServerError as exc:
            if len(ready) > 1 and exc.status is not None and 400 <= exc.status < 500:
                for outcome in ready:  # so that only the item the server refuses fails
                    alone = self.verify_batch([outcome.rollout], outcome.index)[0]
                    outcome.result, outcome.error = alone.result, alone.error
            else:
                for outcome in ready:
                    outcome.error = str(exc)
        return outcomes

    def verify_many(self, items: Iterable[Item]) -> Iterator[Outcome]:
        """Outcomes of all items, in input order, while later batches are still in flight.

        An item may be an exception instead of a Rollout (a record the caller could not read):
        its outcome is that error, in its place. Reading ``items`` is lazy, a bounded number of
        batches ahead of the outcomes handed out.
        """
        pending: deque[Future] = deque()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="verify") as pool:
            try:
                for batch in self._batches(items):
                    pending.append(pool.submit(self._run, batch))
                    while len(pending) >= 2 * self.concurrency:
                        yield from pending.popleft().result()
                while pending:
                    yield from pending.popleft().result()
            finally:
                for future in pending:  # the caller stopped early: do not send the rest
                    future.cancel()

    def _batches(self, items: Iterable[Item]) -> Iterator[list[tuple[int, Item]]]:
        """Consecutive items in groups of ``batch_size`` (an error item travels alone)."""
        batch: list[tuple[int, Item]] = []
        for index, item in enumerate(items):
            if isinstance(item, BaseException):
                if batch:
                    yield batch
                    batch = []
                yield [(index, item)]
                continue
            batch.append((index, item))
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def _run(self, batch: list[tuple[int, Item]]) -> list[Outcome]:
        first, item = batch[0]
        if isinstance(item, BaseException):
            return [Outcome(first, None, error=one_line(item) or type(item).__name__)]
        return self.verify_batch([r for _, r in batch], first)  # type: ignore[misc]


def verify_rollouts(url: str, rollouts: Iterable[Rollout], **options: Any) -> list[Outcome]:
    """All outcomes of ``rollouts`` on the verifier at ``url`` (options: those of VerifierClient)."""
    return list(VerifierClient(url, **options).verify_many(rollouts))
