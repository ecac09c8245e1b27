"""Per-step decision of the speculation switch: draft or decode plainly.

Drafting is on for a decode step when the server's rolling acceptance (tokens per verify step,
over the last `window` drafting steps) reaches the break-even of the step's batch size. While
off, a probe every `probe_interval` off steps drafts until `probe_steps` drafting steps have been
measured (their results arrive a step late under an overlapping scheduler), re-measuring the
acceptance from scratch, so a drafter that got better (co-training) is switched back on. Each probe
that leaves drafting off doubles the wait before the next (up to `probe_backoff` intervals): a probe
costs drafting steps and a catch-up, and the acceptance rarely jumps. A probe starts only at a batch
size whose break-even is within `probe_reach` of the last measured acceptance (a drafter measured at
1.5 tokens per step is not probed where drafting needs 2.6). New draft weights (`drafter_changed`)
are probed at the next step that may draft, and the backoff starts over. A batch size where drafting
never pays (above the table's last drafting entry) is off and never probed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from sglang_rl.speculation.table import BreakEvenTable


@dataclass(frozen=True)
class SwitchConfig:
    window: int = 32
    """drafting (verify) steps in the rolling acceptance"""
    probe_interval: int = 256
    """off steps between two probes"""
    probe_steps: int = 8
    """measured drafting steps of a probe"""
    hysteresis: float = 0.05
    """tokens per step below the break-even before drafting that is on goes off"""
    probe_backoff: int = 8
    """the longest wait between probes, in probe intervals (after probes that left drafting off)"""
    probe_reach: float = 0.5
    """tokens per step the break-even may exceed the last measured acceptance where a probe starts"""

    def __post_init__(self) -> None:
        if (self.window < 1 or self.probe_interval < 1 or self.probe_steps < 1 or self.hysteresis < 0
                or self.probe_backoff < 1 or self.probe_reach < 0):
            raise ValueError(f"bad speculation switch config: {self}")


class SpeculationSwitch:
    """The switch of one server (one scheduler): `decide` once per decode step, `record` each
    drafting step's accepted lengths (bonus token included) once they are on the host."""

    def __init__(self, table: BreakEvenTable, config: SwitchConfig = SwitchConfig()) -> None:
        self.table = table
        self.config = config
        self.on = False
        self.steps_on = 0
        self.steps_off = 0
        self.flips = 0
        self.probes = 0
        self._probe_until: Optional[int] = None  # verify_steps at which the running probe ends
        self._off_run = 0
        self._failed_probes = 0  # probes in a row that left drafting off
        self._probe_due = False  # new draft weights wait to be measured
        self._window: deque[tuple[int, int]] = deque(maxlen=config.window)
        self.verify_steps = 0

    def acceptance(self) -> Optional[float]:
        """Rolling tokens per verify step (per request), None before any drafting step."""
        requests = sum(n for _, n in self._window)
        return sum(t for t, _ in self._window) / requests if requests else None

    def record(self, accept_lens: Iterable[int]) -> None:
        """One drafting step's accepted lengths, one per request (each >= 1: the bonus token)."""
        lens = list(accept_lens)
        if lens:
            self._window.append((sum(lens), len(lens)))
            self.verify_steps += 1

    def decide(self, batch_size: int) -> bool:
        """Draft in this decode step of `batch_size` requests?"""
        on = self._decide(batch_size)
        if on != self.on:
            self.flips += 1
        self.on = on
        if on:
            self.steps_on += 1
            self._off_run = 0
        else:
            self.steps_off += 1
            self._off_run += 1
        return on

    def _decide(self, batch_size: int) -> bool:
        even = self.table.break_even(batch_size)
        if even is None:
            return False
        probe_ended = False
        if self._probe_until is not None:
            if self.verify_steps < self._probe_until:
                return True
            self._probe_until, probe_ended = None, True
        accepted = self.acceptance()
        if accepted is None or (not self.on and (self._probe_due or (
                self._off_run >= self.probe_wait() and accepted + self.config.probe_reach >= even))):
            return self._start_probe()
        self._probe_due = False  # drafting is on: its window measures new weights as they serve
        on = accepted >= (even - self.config.hysteresis if self.on else even)
        if probe_ended:
            self._failed_probes = 0 if on else self._failed_probes + 1
        return on

    def probe_wait(self) -> int:
        """Off steps before the next probe: the interval, doubled for each failed probe after the first."""
        return self.config.probe_interval * min(2 ** max(self._failed_probes - 1, 0), self.config.probe_backoff)

    def drafter_changed(self) -> None:
        """New draft weights (a co-training round, a draft-only update): measure them at the next
        step that may draft, and probe at the usual interval again."""
        self._failed_probes = 0
        self._probe_due = True

    def _start_probe(self) -> bool:
        self._probe_due = False
        self._window.clear()  # the probe measures the drafter as it is now
        self.probes += 1
        self._probe_until = self.verify_steps + self.config.probe_steps
        return True

    def stats(self) -> dict:
        """State for /get_server_info and the metrics."""
        accepted = self.acceptance()
        return {"on": self.on, "probing": self._probe_until is not None, "steps_on": self.steps_on,
                "steps_off": self.steps_off, "flips": self.flips, "probes": self.probes,
                "probe_wait": self.probe_wait(), "verify_steps": self.verify_steps,
                "acceptance": None if accepted is None else round(accepted, 4),
                "table": self.table.to_dict()["break_even_tokens_per_step"],
                "config": {"window": self.config.window, "probe_interval": self.config.probe_interval,
                           "probe_steps": self.config.probe_steps, "hysteresis": self.config.hysteresis,
                           "probe_backoff": self.config.probe_backoff, "probe_reach": self.config.probe_reach}}
