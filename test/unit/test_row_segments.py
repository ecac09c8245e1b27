"""Shared-memory row files: rows written in one process come back bit-exact in another, files are
unlinked once read or discarded, growth spans several files, and a full directory falls back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang_rl.hidden_states import HiddenStatesFormat, HiddenStatesMode, HiddenStatesOptions, HiddenStatesScope
from sglang_rl.hidden_states import row_segments
from sglang_rl.hidden_states.row_segments import RowSegments, read_rows


@pytest.fixture
def shm(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_RL_SHM_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("load", [False, True], ids=["mapped", "read"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_round_trip_across_growing_files(shm, dtype, load):
    rows = torch.randn(37, 24).to(dtype)
    seg = RowSegments(first_capacity=4)
    seg.append(rows[:5], range(10, 15))  # a prefill block bigger than the first file
    for i in range(5, 37):
        seg.append(rows[i], [10 + i])  # decode rows, one at a time
    assert len(os.listdir(shm)) >= 3
    got, positions = read_rows(seg.handoff(), load=load)
    assert got.dtype == dtype and torch.equal(got, rows)
    assert positions == list(range(10, 47))
    assert os.listdir(shm) == []


def test_reader_in_another_process(shm):
    rows = torch.randn(9, 16, dtype=torch.bfloat16)
    seg = RowSegments()
    seg.append(rows, range(9))
    handle = seg.handoff()
    code = (
        "import sys, torch; from sglang_rl.hidden_states.row_segments import read_rows; "
        f"r, p = read_rows({handle!r}); torch.save((r.clone(), p), sys.argv[1])"
    )
    out = shm / "out.pt"
    subprocess.run([sys.executable, "-c", code, str(out)], check=True)
    got, positions = torch.load(out)
    assert torch.equal(got, rows) and positions == list(range(9))
    assert os.listdir(shm) == ["out.pt"]


def test_discard_unlinks(shm):
    seg = RowSegments(first_capacity=2)
    seg.append(torch.ones(5, 8), range(5))
    assert os.listdir(shm)
    seg.discard()
    assert os.listdir(shm) == []


def test_stale_handed_files_are_reaped(shm, monkeypatch):
    seg = RowSegments()
    seg.append(torch.ones(2, 8), range(2))
    seg.handoff()  # never read
    first = os.listdir(shm)
    assert len(first) == 1
    monkeypatch.setattr(row_segments, "STALE_AFTER_S", -1.0)
    other = RowSegments()
    other.append(torch.ones(1, 8), [0])
    handle = other.handoff()  # reaps the unclaimed first one
    assert os.listdir(shm) == [os.path.basename(handle["files"][0][0])]
    read_rows(handle)
    assert os.listdir(shm) == []


def test_collector_falls_back_to_memory_when_shared_memory_fails(shm, monkeypatch):
    from sglang_rl.adapters.decode_step import add_decode_rows
    from sglang_rl.adapters.hidden_states import PAYLOAD_KEY, RowCollector
    from sglang_rl.adapters.hidden_states_api import deliver

    opts = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR,
                               scope=HiddenStatesScope.ALL)
    collector = RowCollector(opts, prompt_len=4, max_new_tokens=3)
    collector.segments = RowSegments(first_capacity=4)  # the prompt fills the first file
    rows = torch.randn(6, 8)
    collector.add_prefill(rows[:4], last_chunk=True)
    monkeypatch.setenv("SGLANG_RL_SHM_DIR", str(shm / "missing"))  # the next file cannot be made
    add_decode_rows([(collector, 4, 1, 4)], rows)
    add_decode_rows([(collector, 5, 1, 5)], rows)
    assert collector.segments is None
    out = deliver(collector.finish(output_len=3)[PAYLOAD_KEY])
    assert out["hidden_states_positions"] == list(range(6))
    assert torch.equal(out["hidden_states_rows"][:4], rows[:4]) and torch.equal(out["hidden_states_rows"][4:], rows[4:])
    assert os.listdir(shm) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_steps_for_mixed_collectors(shm, monkeypatch, dtype):
    """`add_decode_rows` (the scheduler's per-step path) gives each collector its own row: FULL
    collectors through their files, LAST ones in memory; a file that cannot be made mid-run
    moves that collector to memory without losing rows."""
    from sglang_rl.adapters.decode_step import add_decode_rows
    from sglang_rl.adapters.hidden_states import PAYLOAD_KEY, RowCollector
    from sglang_rl.adapters.hidden_states_api import deliver

    full = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR,
                               scope=HiddenStatesScope.ALL)
    last = HiddenStatesOptions(mode=HiddenStatesMode.LAST, format=HiddenStatesFormat.TENSOR)
    prompt_len, steps, hidden = 3, 9, 16
    a = RowCollector(full, prompt_len, max_new_tokens=steps)
    b = RowCollector(last, prompt_len, max_new_tokens=steps)
    c = RowCollector(full, prompt_len, max_new_tokens=steps)
    c.segments = RowSegments(first_capacity=2)  # files of 3 then 6 rows: a third is needed at step 6
    prompts = {id(x): torch.randn(prompt_len, hidden).to(dtype) for x in (a, c)}
    for x in (a, c):
        x.add_prefill(prompts[id(x)], last_chunk=True)
    step_rows = torch.randn(steps, 3, hidden).to(dtype)
    for s in range(steps):
        if s == 3:
            monkeypatch.setenv("SGLANG_RL_SHM_DIR", str(shm / "missing"))  # no new file from here
        add_decode_rows([(a, 0, 1, prompt_len + s), (b, 1, 1, prompt_len + s), (c, 2, 1, prompt_len + s)],
                        step_rows[s])
    assert c.segments is None and a.segments is not None
    monkeypatch.setenv("SGLANG_RL_SHM_DIR", str(shm))
    out_a = deliver(a.finish(output_len=steps + 1)[PAYLOAD_KEY])
    out_b = deliver(b.finish(output_len=steps + 1)[PAYLOAD_KEY])
    out_c = deliver(c.finish(output_len=steps + 1)[PAYLOAD_KEY])
    positions = list(range(prompt_len + steps))
    assert out_a["hidden_states_positions"] == positions == out_c["hidden_states_positions"]
    assert torch.equal(out_a["hidden_states_rows"], torch.cat([prompts[id(a)], step_rows[:, 0]]))
    assert torch.equal(out_c["hidden_states_rows"], torch.cat([prompts[id(c)], step_rows[:, 2]]))
    assert out_b["hidden_states_positions"] == [prompt_len + steps - 1]
    assert torch.equal(out_b["hidden_states_rows"], step_rows[-1, 1:2])
    assert os.listdir(shm) == []


@pytest.mark.parametrize("n_steps", range(30, 42))
def test_speculative_steps_commit_runs_of_rows(shm, n_steps):
    """Under speculative decoding a step gives each request a run of rows (its accepted tokens,
    first in its block of `stride` rows), and the last step may run past the finish that sglang
    decides afterwards: every scope must still deliver exactly the rows of committed positions,
    LAST after many trims included, and in-memory collectors must not keep whole steps alive."""
    from sglang_rl.adapters.decode_step import add_decode_rows
    from sglang_rl.adapters.hidden_states import PAYLOAD_KEY, RowCollector
    from sglang_rl.adapters.hidden_states_api import deliver

    full = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR,
                               scope=HiddenStatesScope.ALL)
    last = HiddenStatesOptions(mode=HiddenStatesMode.LAST, format=HiddenStatesFormat.TENSOR)
    tail = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR,
                               scope=HiddenStatesScope.LAST_N, last_n=5)
    prompt_len, stride, hidden = 3, 4, 8
    collectors = [RowCollector(opts, prompt_len, max_new_tokens=200) for opts in (full, last, tail)]
    prompt = torch.randn(prompt_len, hidden)
    for collector in collectors:
        collector.add_prefill(prompt, last_chunk=True)
    truth = {p: prompt[p] for p in range(prompt_len)}  # row of each position, as computed
    generated = 1  # the prefill produced the first token
    counts = [1 + (s * 7) % stride for s in range(n_steps - 1)] + [stride]  # runs of 1..4 tokens
    for count in counts:
        step = torch.randn(len(collectors) * stride, hidden)
        position = prompt_len + generated - 1
        for i in range(1, len(collectors)):  # every request gets the same run as request 0
            step[i * stride:i * stride + count] = step[:count]
        step[count:stride] = float("nan")  # rows of rejected drafts: never delivered
        items = [(collector, i * stride, count, position) for i, collector in enumerate(collectors)]
        add_decode_rows(items, step)
        for j in range(count):
            truth[position + j] = step[j]
        generated += count
    output_len = generated - 3  # the last step ran 3 tokens past the finish
    expect_all = list(range(prompt_len + output_len - 1))
    outs = [deliver(c.finish(output_len=output_len)[PAYLOAD_KEY]) for c in collectors]
    for out, expect in zip(outs, (expect_all, expect_all[-1:], expect_all[-5:])):
        assert out["hidden_states_positions"] == expect
        assert torch.equal(out["hidden_states_rows"], torch.stack([truth[p] for p in expect]))
    assert os.listdir(shm) == []


def test_in_memory_rows_are_bounded(shm):
    """A last_n request copies its rows out of each step (it never holds a whole step's rows), and
    LAST holds references to at most a few recent steps."""
    from sglang_rl.adapters.decode_step import add_decode_rows
    from sglang_rl.adapters.hidden_states import TRIM_SLACK, RowCollector

    tail = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR,
                               scope=HiddenStatesScope.LAST_N, last_n=3)
    last = HiddenStatesOptions(mode=HiddenStatesMode.LAST, format=HiddenStatesFormat.TENSOR)
    a, b = RowCollector(tail, 2, max_new_tokens=500), RowCollector(last, 2, max_new_tokens=500)
    steps = []
    for s in range(300):
        steps.append(torch.randn(64, 8))
        add_decode_rows([(a, 0, 1, 2 + s), (b, 1, 1, 2 + s)], steps[-1])
    assert len(a.rows) <= 3 + 2 * TRIM_SLACK and len(b.rows) <= 1 + 2 * TRIM_SLACK
    assert all(block.shape[0] == 1 for block, _ in a.rows)
    held = {id(block) for block, _ in b.rows}
    assert len(held) <= 1 + 2 * TRIM_SLACK and held <= {id(t) for t in steps[-(1 + 2 * TRIM_SLACK):]}
    a.discard(), b.discard()


def test_encoded_deliveries_do_not_share_the_reused_buffer(shm):
    """base64 and list deliveries read into one reusable buffer per thread: each result must stay
    its own after the next delivery overwrites that buffer."""
    from sglang_rl.adapters.hidden_states import PAYLOAD_KEY, RowCollector
    from sglang_rl.adapters.hidden_states_api import deliver
    from sglang_rl.hidden_states import decode_rows

    results, expected = [], []
    for n, fmt in enumerate([HiddenStatesFormat.BASE64, HiddenStatesFormat.LIST, HiddenStatesFormat.BASE64]):
        opts = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=fmt, scope=HiddenStatesScope.ALL)
        collector = RowCollector(opts, prompt_len=5 + n, max_new_tokens=1)
        rows = torch.randn(5 + n, 16)
        collector.add_prefill(rows, last_chunk=True)
        results.append((fmt, deliver(collector.finish(output_len=0)[PAYLOAD_KEY])))
        expected.append(rows)
    for (fmt, out), rows in zip(results, expected):
        got = decode_rows(out["hidden_states_rows"])[0] if fmt is HiddenStatesFormat.BASE64 else torch.tensor(out["hidden_states_rows"])
        assert torch.equal(got, rows)


def test_outputs_of_requests_whose_state_is_gone_unlink_their_files(shm):
    """sglang's tokenizer manager drops an output whose request state was deleted (the client
    went away): the hook before it unlinks that output's row files, and only those."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import wrap_as_pickle

    from sglang_rl.adapters import transport
    from sglang_rl.adapters.hidden_states_api import PAYLOAD_KEY, orphaned_output_before

    handles = {}
    for rid in ("gone", "alive"):
        seg = RowSegments(first_capacity=2)
        seg.append(torch.ones(5, 8), range(5))
        handles[rid] = seg.handoff()
    files = {rid: [path for path, _ in h["files"]] for rid, h in handles.items()}
    entries = [[{PAYLOAD_KEY: {"format": "base64", "wanted": [], "handle": handles[rid]}}] for rid in handles]
    recv = SimpleNamespace(rids=list(handles), customized_info=wrap_as_pickle({transport.KEY: entries}))
    manager = SimpleNamespace(rid_to_state={"alive": object()})
    assert orphaned_output_before(manager, recv) is None
    assert not any(os.path.exists(p) for p in files["gone"])
    assert all(os.path.exists(p) for p in files["alive"])
    got, _ = read_rows(handles["alive"])
    assert torch.equal(got, torch.ones(5, 8))
    no_payload = SimpleNamespace(rids=["gone"], customized_info=None)
    assert orphaned_output_before(manager, no_payload) is None
