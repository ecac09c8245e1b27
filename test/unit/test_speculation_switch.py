"""The speculation switch's decision core (sglang_rl.speculation): table lookups and per-step decisions."""

from __future__ import annotations

import json

import pytest

from sglang_rl.speculation import DEFAULT_TABLE, BreakEvenTable, SpeculationSwitch, SwitchConfig

TABLE = BreakEvenTable({1: 1.5, 8: 1.8, 32: 2.6, 64: None})


def test_break_even_interpolates_and_is_off_past_the_last_drafting_entry() -> None:
    assert TABLE.break_even(1) == 1.5 and TABLE.break_even(8) == 1.8 and TABLE.break_even(32) == 2.6
    assert TABLE.break_even(20) == pytest.approx(1.8 + (2.6 - 1.8) * 12 / 24)
    assert TABLE.break_even(4) == pytest.approx(1.5 + 0.3 * 3 / 7)
    assert TABLE.break_even(33) is None and TABLE.break_even(64) is None and TABLE.break_even(256) is None
    assert BreakEvenTable({4: 2.0}).break_even(1) == 2.0  # below the first entry: the first holds


def test_table_file_round_trip_and_the_shipped_table(tmp_path) -> None:
    path = tmp_path / "t.json"
    TABLE.save(path)
    again = BreakEvenTable.load(path)
    assert again.entries == TABLE.entries
    shipped = BreakEvenTable.load()
    assert json.loads(json.dumps(DEFAULT_TABLE)) == DEFAULT_TABLE  # what --speculative-switch-table files hold
    assert shipped.break_even(1) == 1.51 and shipped.break_even(64) is None and shipped.max_drafting_batch == 32


@pytest.mark.parametrize("bad", [{}, {0: 1.5}, {1: -1.0}, {1: float("nan")}])
def test_bad_tables_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        BreakEvenTable(bad)


def run(switch: SpeculationSwitch, batch: int, steps: int, accept: float | None) -> list[bool]:
    """`steps` decode steps; each drafting step records `accept` tokens for every request."""
    out = []
    for _ in range(steps):
        on = switch.decide(batch)
        out.append(on)
        if on and accept is not None:
            switch.record([accept] * batch)
    return out


def test_unknown_acceptance_probes_then_stays_on_where_it_pays() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=4, probe_interval=10, probe_steps=3))
    assert run(switch, 1, 12, 2.0) == [True] * 12
    assert switch.acceptance() == 2.0 and switch.probes == 1 and switch.flips == 1


def test_low_acceptance_turns_off_and_probes_every_interval() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=4, probe_interval=5, probe_steps=2, probe_backoff=1,
                                                   probe_reach=1.0))
    assert run(switch, 8, 16, 1.2) == [True, True] + [False] * 5 + [True, True] + [False] * 5 + [True, True]
    assert switch.probes == 3 and switch.steps_on == 6 and switch.steps_off == 10


def test_failed_probes_back_off_until_the_drafter_changes() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=4, probe_interval=5, probe_steps=2, probe_backoff=4,
                                                   probe_reach=1.0))
    got = run(switch, 8, 2 + 5 + 2 + 10 + 2 + 20 + 2 + 20 + 2, 1.2)
    probes = [i for i, on in enumerate(got) if on and (i == 0 or not got[i - 1])]
    assert probes == [0, 7, 19, 41, 63]  # waits 5, 10, 20, then capped at 4 intervals
    assert switch.stats()["probe_wait"] == 20 and run(switch, 8, 19, 1.2) == [False] * 19
    switch.drafter_changed()  # new draft weights: measured at once, then the usual interval again
    assert switch.stats()["probe_wait"] == 5 and switch.acceptance() == 1.2  # the last measurement until the probe
    assert run(switch, 8, 6, 3.0) == [True] * 6  # the probe measured 3.0 >= 1.8: drafting stays on


def test_no_probe_where_the_last_acceptance_is_out_of_reach() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=4, probe_interval=3, probe_steps=2, probe_reach=0.5))
    assert run(switch, 1, 5, 1.4) == [True, True, False, False, False]  # measured 1.4 < 1.5 at batch 1
    assert run(switch, 32, 10, 1.4) == [False] * 10  # 1.4 + 0.5 < 2.6: no probe at batch 32
    assert run(switch, 8, 3, 1.4) == [True, True, False]  # 1.4 + 0.5 >= 1.8: the overdue probe at batch 8
    assert switch.probes == 2


def test_a_probe_lasts_until_its_steps_are_measured() -> None:
    """Under the overlap scheduler a step's accept lengths arrive after the next step is decided;
    a catch-up step is measured not at all: the probe drafts until it has its measurements."""
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=4, probe_interval=3, probe_steps=2))
    assert [switch.decide(8) for _ in range(4)] == [True] * 4  # nothing measured yet
    switch.record([1, 1])
    assert switch.decide(8)
    switch.record([1, 2])
    assert not switch.decide(8) and switch.acceptance() == 1.25 and not switch.stats()["probing"]


def test_a_better_drafter_is_switched_back_on_by_a_probe() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=2, probe_interval=4, probe_steps=2, probe_reach=1.0))
    assert run(switch, 8, 6, 1.0)[-4:] == [False] * 4
    assert run(switch, 8, 6, 3.0) == [True] * 6  # the probe measured 3.0 >= 1.8: drafting stays on
    assert switch.acceptance() == 3.0


def test_new_draft_weights_are_measured_at_once() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=2, probe_interval=100, probe_steps=2))
    assert run(switch, 8, 6, 1.0)[-4:] == [False] * 4  # 1.0 + 0.5 < 1.8: no probe would come at batch 8
    switch.drafter_changed()  # a co-training round
    assert run(switch, 8, 6, 3.0) == [True] * 6 and switch.probes == 2


def test_batch_size_decides_with_the_same_acceptance() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=8, probe_interval=100, probe_steps=1))
    switch.decide(1)
    switch.record([2.2])
    assert switch.decide(8) and switch.decide(20)  # break-evens 1.8 and 2.2
    assert not switch.decide(32)  # 2.6 > 2.2
    assert not switch.decide(128)  # never pays: no probe either
    assert switch.probes == 1 and switch.decide(8)


def test_hysteresis_keeps_drafting_on_just_below_the_break_even() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=1, probe_interval=100, probe_steps=1, hysteresis=0.1))
    switch.decide(8)
    switch.record([1.75])
    assert switch.decide(8)  # on: 1.75 >= 1.8 - 0.1
    switch.record([1.65])
    assert not switch.decide(8)
    switch.record([1.75])  # a late result of the last drafting step
    assert not switch.decide(8)  # off: needs the full 1.8 to come back


def test_rolling_window_and_stats() -> None:
    switch = SpeculationSwitch(TABLE, SwitchConfig(window=2, probe_interval=100, probe_steps=1))
    switch.decide(1)
    for lens in ([1, 1], [3, 3], [2, 4]):
        switch.record(lens)
    assert switch.acceptance() == pytest.approx(3.0)  # the first step fell out of the window
    stats = switch.stats()
    assert stats["on"] and stats["steps_on"] == 1 and stats["verify_steps"] == 3 and stats["acceptance"] == 3.0
    assert stats["table"] == {"1": 1.5, "8": 1.8, "32": 2.6, "64": None}


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        SwitchConfig(window=0)
    with pytest.raises(ValueError):
        SwitchConfig(probe_steps=0)
    with pytest.raises(ValueError):
        SwitchConfig(probe_backoff=0)
    with pytest.raises(ValueError):
        SwitchConfig(probe_reach=-1.0)
