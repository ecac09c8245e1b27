"""The speculative-decoding pieces of hidden-state delivery: which algorithms are refused, the
move of each request's accepted rows to the front of its block (NGRAM's draft trees), and the cut
of an EAGLE prefill's rows to each request's last row when no request wants more."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from sglang_rl.adapters.speculative import accepted_rows_to_front, prefill_rows_around
from sglang_rl.request_options import RequestOptionError, check_rows_supported


@pytest.mark.parametrize("algorithm", [None, "", "EAGLE", "EAGLE3", "NEXTN", "NGRAM", "eagle"])
def test_algorithms_whose_rows_follow_committed_tokens(algorithm) -> None:
    check_rows_supported(algorithm)


@pytest.mark.parametrize("algorithm,reason", [
    ("STANDALONE", "prefill"), ("DFLASH", "not known"),
])
def test_other_algorithms_are_refused_with_the_reason(algorithm, reason) -> None:
    with pytest.raises(RequestOptionError) as err:
        check_rows_supported(algorithm)
    assert algorithm in str(err.value) and reason in str(err.value) and "supported: EAGLE" in str(err.value)


def test_accepted_rows_move_to_the_front_of_their_block() -> None:
    """Against a plain loop: request i's j-th accepted row lands at row i*block + j; rows past the
    accepted run keep what they held."""
    gen = torch.Generator().manual_seed(0)
    block, width, n_req = 6, 4, 5
    rows = torch.randn(n_req * block, 3, generator=gen)
    accept = torch.full((n_req, width), -1, dtype=torch.int32)
    for i in range(n_req):
        # a root, then a path down the tree: increasing node indices within the block, skipping
        # side branches
        run = 1 + i % width
        nodes = [0] + sorted(torch.randperm(block - 1, generator=gen)[:run - 1].add(1).tolist())
        accept[i, :run] = torch.tensor([i * block + n for n in nodes], dtype=torch.int32)
    out = accepted_rows_to_front(rows, accept, block)
    expect = rows.clone()
    for i in range(n_req):
        for j in range(width):
            if accept[i, j] >= 0:
                expect[i * block + j] = rows[int(accept[i, j])]
    assert torch.equal(out, expect)
    assert not torch.equal(out, rows)  # some request did take a side branch


def _prefill(lengths: list[int], mode: CaptureHiddenMode, user_rows: object = False, wanted: bool = True):
    """An EAGLE prefill's batch and the worker's result: every prompt row captured (FULL)."""
    rows = torch.randn(sum(lengths), 8, generator=torch.Generator().manual_seed(len(lengths)))
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, extend_lens=lengths, return_hidden_states=wanted,
        return_hidden_states_mode=mode,
        reqs=[SimpleNamespace(return_hidden_states=user_rows if i == 0 else False) for i in range(len(lengths))])
    result = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=rows))
    return batch, result, rows


@pytest.mark.parametrize("as_tensor", [False, True])
def test_an_eagle_prefill_keeps_each_requests_last_row_when_no_request_wants_more(as_tensor: bool) -> None:
    lengths = [5, 1, 9, 3]
    batch, result, rows = _prefill(lengths, CaptureHiddenMode.LAST)
    if as_tensor:
        batch.extend_lens = torch.tensor(lengths)
    out = prefill_rows_around(lambda worker, b: result, None, batch)
    assert out is result
    assert torch.equal(result.logits_output.hidden_states, rows[[4, 5, 14, 17]])


@pytest.mark.parametrize("case", ["a request wants every prompt row", "sglang returns a request's rows",
                                  "no request wants rows"])
def test_an_eagle_prefill_keeps_every_row_when_a_request_needs_them(case: str) -> None:
    mode = CaptureHiddenMode.FULL if case == "a request wants every prompt row" else CaptureHiddenMode.LAST
    user_rows = "last" if case == "sglang returns a request's rows" else False
    batch, result, rows = _prefill([5, 1, 9], mode, user_rows, wanted=case != "no request wants rows")
    prefill_rows_around(lambda worker, b: result, None, batch)
    assert result.logits_output.hidden_states is rows


def _batch_result(rows: torch.Tensor):
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    output = LogitsProcessorOutput(next_token_logits=None, hidden_states=rows)
    result = GenerationBatchResult(logits_output=output, next_token_ids=torch.tensor([5, 6]))
    result.copy_done = torch.cpu.Event()  # as the scheduler sets it before the copy
    return result


@pytest.mark.parametrize("collects", [False, True])
def test_a_result_keeps_its_rows_on_the_stores_device_only_when_fingerprints_alone_read_them(
        monkeypatch: pytest.MonkeyPatch, collects: bool) -> None:
    """The rows of a step stay where the row store is (no host copy and back) on a server whose
    rows only fingerprints read; a server with hidden-state fields gets sglang's host copy. The
    store's device stands in as `meta` here: sglang's host copy of a meta tensor fails, so only
    a skipped copy lets the first case through."""
    from sglang.srt.managers.utils import GenerationBatchResult

    from sglang_rl.adapters import scheduler, toploc

    worker = SimpleNamespace()  # a worker of a scheduler whose store is on the `meta` device
    setattr(worker, toploc.ATTR, toploc.new_pipeline(torch.device("meta")))
    args = SimpleNamespace(toploc_verification=True, return_hidden_states_mode="last" if collects else None,
                           drafter_cotrain=False)
    monkeypatch.setattr(scheduler, "get_server_args", lambda: args)
    rows = torch.empty(4, 8, device="meta")
    result = toploc.worker_forward_after(_batch_result(rows), worker)  # as the worker returns it
    copy = lambda: scheduler.copy_to_cpu_around(GenerationBatchResult.copy_to_cpu, result,
                                                return_logprob=False, return_hidden_states=True)
    if collects:
        with pytest.raises(NotImplementedError):
            copy()
        return
    copy()
    kept = result.logits_output.hidden_states
    assert kept.device.type == "meta" and kept is not rows and kept.shape == rows.shape
    assert result.next_token_ids.tolist() == [5, 6]  # the rest of sglang's copy still ran

    host_rows = torch.randn(4, 8)
    result = toploc.worker_forward_after(_batch_result(host_rows), worker)
    scheduler.copy_to_cpu_around(GenerationBatchResult.copy_to_cpu, result, False, True)
    assert torch.equal(result.logits_output.hidden_states, host_rows)  # a CPU server: sglang's path


def test_last_layer_rows_move_with_a_tree_steps_accepted_path(monkeypatch) -> None:
    """A tree step (topk > 1) moves each request's accepted path to the front of its block
    (sglang's `_finalize_accept_tree_path`, its KV move stubbed here): an EAGLE3 target's
    last-layer rows, carried beside the captured ones, land where a plain loop puts them."""
    from types import SimpleNamespace

    from sglang.srt.speculative import eagle_worker_common as common

    from sglang_rl.adapters.last_layer_rows import ATTR, accept_tree_path_around

    monkeypatch.setattr(common, "move_accept_tokens_to_target_kvcache", lambda *args, **kwargs: None)
    gen = torch.Generator().manual_seed(0)
    bs, block, width = 3, 6, 3
    accept = torch.tensor([[0, 2, 5], [6, 7, -1], [12, 15, 16]], dtype=torch.int32)
    captured, last = torch.randn(bs * block, 12, generator=gen), torch.randn(bs * block, 4, generator=gen)
    output = SimpleNamespace(hidden_states=captured.clone(), **{ATTR: last.clone()})
    predict = torch.arange(bs * block)
    accept_tree_path_around(common._finalize_accept_tree_path, None, accept, torch.tensor([3, 2, 3]), predict,
                            output, bs, token_to_kv_pool_allocator=None, num_draft_tokens=block)
    want = last.clone()
    for i in range(bs):
        for j in range(width):
            if accept[i, j] >= 0:
                want[i * block + j] = last[accept[i, j]]
    moved = getattr(output, ATTR)
    for i, n in enumerate((3, 2, 3)):  # the accepted runs (rows past them are never read)
        assert torch.equal(moved[i * block:i * block + n], want[i * block:i * block + n])
    assert torch.equal(output.hidden_states[block:block + 2], captured[[6, 7]])  # sglang moved its own rows
