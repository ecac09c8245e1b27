"""return_final_hidden_state under speculative decoding, streamed (adapters/scheduler.py:
update_finish_state_around, decode_result_around, stream_output_before), with sglang's own `Req`
and stream accumulator and stand-ins only for the batch and its result.

The final row's extra decode step keeps a request unfinished for one more step, and sglang
streams unfinished requests at every step. When the last verify run went past the finish (an
overshoot that finished_len cuts), that step must still stream only the returned tokens: the
client's ids must be exactly those whose rows (plus the final row) the response delivers.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.output_streamer import _GenerationStreamAccumulator
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_rl.adapters import hidden_states, hidden_states_api, scheduler, transport
from sglang_rl.hidden_states import HiddenStatesFormat, HiddenStatesMode, HiddenStatesOptions, HiddenStatesScope

PROMPT = [1, 2, 3, 4]
MAX_NEW = 6
STRIDE = 6  # speculative_num_draft_tokens: rows per request per verify step
HIDDEN = 8


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_RL_SHM_DIR", str(tmp_path))
    args = SimpleNamespace(toploc_verification=False, return_hidden_states_mode="full", drafter_cotrain=False,
                           device="cpu")
    monkeypatch.setattr(scheduler, "get_server_args", lambda: args)
    return SimpleNamespace(server_args=args, is_generation=True)


def _request(scope: HiddenStatesScope, last_n: int | None) -> Req:
    params = SamplingParams(max_new_tokens=MAX_NEW)
    params.normalize(None)
    req = Req("r", "", array("q", PROMPT), params, stream=True, vocab_size=1000)
    opts = HiddenStatesOptions(mode=HiddenStatesMode.FULL, format=HiddenStatesFormat.TENSOR, scope=scope,
                               last_n=last_n, final_row=True)
    collector = hidden_states.RowCollector(opts, len(PROMPT), MAX_NEW)
    collector.add_prefill(_rows_at(range(len(PROMPT))), last_chunk=True)
    collector.adopt(req)
    return req


def _rows_at(positions) -> torch.Tensor:
    """Rows whose values name their position, so a delivered row shows where it came from."""
    return torch.tensor([[float(p)] * HIDDEN for p in positions])


def _step(processor, req: Req, tokens: list[int], streamed: list[int], payload: dict) -> None:
    """One verify step that commits `tokens`: the row hook, then sglang's processing of the
    request (skipped once it is finished, as under the overlap schedule), then its streaming:
    the ids sent go to `streamed`, the request's sglang-rl payload to `payload`."""
    start = len(PROMPT) + len(req.output_ids) - 1  # the input position of the step's first row
    rows = torch.zeros(STRIDE, HIDDEN)
    rows[:len(tokens)] = _rows_at(range(start, start + len(tokens)))
    batch = SimpleNamespace(reqs=[req], return_hidden_states=True)
    result = SimpleNamespace(copy_done=None, logits_output=SimpleNamespace(hidden_states=rows),
                             speculative_num_draft_tokens=STRIDE, accept_lens=torch.tensor([len(tokens)]))

    def process(processor, batch, result) -> None:
        if not req.finished():
            req.output_ids.extend(tokens)
            scheduler.update_finish_state_around(Req.update_finish_state, req, len(tokens))
        hooked = scheduler.stream_output_before(None, [req], False)
        reqs = hooked[0][1] if hooked is not None else [req]
        acc = _GenerationStreamAccumulator(
            return_logprob=False, return_hidden_states=False, return_routed_experts=False,
            return_indexer_topk=False, spec_algorithm=SpeculativeAlgorithm.NGRAM,
            disaggregation_mode=DisaggregationMode.NULL, default_stream_interval=1,
            default_force_stream_interval=50, get_cached_tokens_details=lambda r: None)
        for r in reqs:
            if not (r.finished() and r.finished_output):
                scheduler.output_accept_around(_GenerationStreamAccumulator.accept, acc, req=r)
        for ids in acc.output_ids:
            streamed.extend(ids)
        for entries in acc.customized_info.get(transport.KEY, []):
            for sent in entries:
                payload.update(sent)

    scheduler.decode_result_around(process, processor, batch, result)


@pytest.mark.parametrize("runs", [[3, 2, 1], [3, 3, 1], [2, 5, 1]],
                         ids=["ends-on-the-finish", "overshoots-by-one", "overshoots-by-two"])
@pytest.mark.parametrize("scope, last_n", [(HiddenStatesScope.ALL, None), (HiddenStatesScope.LAST_N, 5)])
def test_streamed_ids_are_those_whose_rows_are_delivered(server, runs, scope, last_n) -> None:
    req = _request(scope, last_n)
    streamed: list[int] = []
    payload: dict = {}
    req.output_ids.append(100)  # the prefill's token
    token = 101
    for n in runs:
        _step(server, req, list(range(token, token + n)), streamed, payload)
        token += n
    assert req.finished() and req.finished_len == MAX_NEW
    out = hidden_states_api.deliver(payload[hidden_states_api.PAYLOAD_KEY])

    # the client gets the returned tokens only, never the overshoot of the last verify run
    assert streamed == list(req.output_ids[:MAX_NEW]) == list(range(100, 100 + MAX_NEW))
    # ... and the rows of exactly those tokens' positions, the final row (position L + n - 1) included
    end = len(PROMPT) + len(streamed)
    expected = list(range(end)) if scope is HiddenStatesScope.ALL else list(range(end - last_n, end))
    assert out["hidden_states_positions"] == expected
    assert torch.equal(out["hidden_states_rows"], _rows_at(expected))
