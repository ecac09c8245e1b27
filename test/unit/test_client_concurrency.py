"""The client's concurrency against the tiny local verifier of test_client.py: `concurrency`
requests really are in flight together (and never more), outcomes keep the input order when later
batches answer first, the input is read a bounded number of batches ahead, a failing batch costs
only its own lines, and sglang-rl-verify's exit codes hold at every concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sglang_rl_client import Rollout, VerifierClient
from sglang_rl_client import cli
from test_client import CHEAT, FAILS, HONEST, REFUSED, FakeVerifier, rollout_line, run_cli, verifier  # noqa: F401

# a first token id the fake verifier below answers 503 for, every time (a batch the server cannot take)
BROKEN = 5


def refuse_broken(body: dict) -> bool:
    """The fake verifier's hook: False (503) for a request that holds a BROKEN item."""
    ids = body["input_ids"]
    return not any(item[0] == BROKEN for item in (ids if isinstance(ids[0], list) else [ids]))


def rollouts(kinds: list[int]) -> list[Rollout]:
    """One rollout per kind; the i-th has 1 + i response tokens (so each outcome names its item)."""
    return [Rollout.from_dict(rollout_line(kind, n=1 + i)) for i, kind in enumerate(kinds)]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_exactly_concurrency_requests_are_in_flight(verifier: FakeVerifier, concurrency: int) -> None:
    # every request waits at a barrier of `concurrency` parties: fewer in flight breaks it (503 -> error)
    barrier = threading.Barrier(concurrency, timeout=10)

    def wait_for_the_others(body: dict) -> bool:
        try:
            barrier.wait()
            return True
        except threading.BrokenBarrierError:
            return False

    verifier.before_answer = wait_for_the_others
    items = rollouts([HONEST] * (4 * concurrency * 2))
    outcomes = list(VerifierClient(verifier.url, batch_size=2, concurrency=concurrency, retries=0).verify_many(items))
    assert [o.status for o in outcomes] == ["verified"] * len(items), [o.error for o in outcomes if o.error]
    assert len(verifier.requests) == 4 * concurrency and verifier.peak == concurrency


def test_order_is_kept_when_later_batches_answer_first(verifier: FakeVerifier) -> None:
    # batch k (its first item has k * 3 + 1 response tokens) answers after batch k + 1 has answered
    answered: list[int] = []
    cond = threading.Condition()

    def in_reverse(body: dict) -> bool:
        k = (len(body["input_ids"][0]) - 4) // 3  # prompt of 3 tokens, then 3k + 1 response tokens
        with cond:
            ok = cond.wait_for(lambda: k == 3 or k + 1 in answered, timeout=10)
            answered.append(k)
            cond.notify_all()
        return ok  # False (503): the client did not have the batches in flight together

    verifier.before_answer = in_reverse
    kinds = [(HONEST, CHEAT, FAILS)[i % 3] for i in range(12)]
    client = VerifierClient(verifier.url, batch_size=3, concurrency=4, retries=0)
    outcomes = list(client.verify_many(rollouts(kinds)))
    assert answered == [3, 2, 1, 0]
    assert [o.index for o in outcomes] == list(range(12))
    assert [o.result["response_tokens"] for o in outcomes] == [1 + i for i in range(12)]
    assert [o.result["echo"] for o in outcomes] == kinds


def test_the_input_is_read_a_bounded_number_of_batches_ahead(verifier: FakeVerifier) -> None:
    read = 0

    def items():
        nonlocal read
        for item in rollouts([HONEST] * 100):
            read += 1
            yield item

    seen_at_first = None
    for outcome in VerifierClient(verifier.url, batch_size=4, concurrency=3).verify_many(items()):
        if seen_at_first is None:
            seen_at_first = read
    assert seen_at_first == 2 * 3 * 4  # twice the batches in flight, then the first outcome
    assert read == 100


def test_stopping_early_sends_no_more_batches(verifier: FakeVerifier) -> None:
    outcomes = VerifierClient(verifier.url, batch_size=2, concurrency=2).verify_many(rollouts([HONEST] * 40))
    first = next(outcomes)
    outcomes.close()  # cancels the queued batches, waits for those in flight
    assert first.index == 0 and len(verifier.requests) <= 2 * 2


def test_a_failing_batch_costs_only_its_own_lines(verifier: FakeVerifier) -> None:
    verifier.before_answer = refuse_broken
    kinds = [HONEST, HONEST, BROKEN, HONEST, REFUSED, FAILS, HONEST, CHEAT, HONEST]
    client = VerifierClient(verifier.url, batch_size=3, concurrency=3, retries=1, backoff=0.0)
    outcomes = list(client.verify_many(rollouts(kinds)))
    # batch 0 holds the 503 one (every item an error after the retry); batch 1 the refused one (alone)
    assert [o.status for o in outcomes] == ["error"] * 3 + ["verified", "error", "failed", "verified", "verified",
                                                            "verified"]
    assert all("HTTP 503" in o.error and "after 2 attempts" in o.error for o in outcomes[:3])
    assert outcomes[4].error.startswith("HTTP 400")
    assert [o.index for o in outcomes] == list(range(len(kinds)))


@pytest.mark.parametrize("concurrency", ["1", "4"])
def test_exit_codes_at_any_concurrency(tmp_path: Path, verifier: FakeVerifier, concurrency: str) -> None:
    verifier.before_answer = refuse_broken
    flags = ("--concurrency", concurrency, "--batch-size", "2")
    honest = [rollout_line(HONEST, n=1 + i) for i in range(9)]
    assert run_cli(tmp_path, verifier.url, honest, *flags)[0] == cli.EXIT_VERIFIED
    code, records = run_cli(tmp_path, verifier.url, honest[:5] + [rollout_line(BROKEN)] + honest[5:], *flags)
    responses = [r for r in records if r["type"] == "response"]
    assert code == cli.EXIT_ERRORS and [r["line"] for r in responses] == list(range(1, 11))
    assert [r["status"] for r in responses] == ["verified"] * 4 + ["error"] * 2 + ["verified"] * 4
    code, records = run_cli(tmp_path, verifier.url, honest[:5] + [rollout_line(FAILS)] + honest[5:], *flags)
    assert code == cli.EXIT_FAILED and records[-1]["failed"] == 1 and records[-1]["verified"] == 9
