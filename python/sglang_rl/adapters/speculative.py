"""Hidden-state rows under speculative decoding.

A verify step computes one row per draft token: `speculative_num_draft_tokens` rows per request,
in tree order. The scheduler hook (`scheduler.decode_result_around`) takes a request's first
`accept_lens[i]` rows as the rows of its committed tokens, which holds when the accepted path
sits at the front of the request's block:
* EAGLE / NEXTN: the worker moves the accepted path to the front itself;
* NGRAM: it does not (its drafts form a tree with side branches), so `ngram_sample_around`
  does that move right after the verify step's sampling, when rows were captured.
Fingerprints (TOPLOC) take the same runs. Other algorithms are refused (request_options:
`check_rows_supported` for hidden-state requests, `unsupported_reason` at start-up with
--toploc-verification).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sglang_rl.adapters import last_layer_rows
from sglang_rl.fingerprint.device_prover import device_index

def accepted_rows_to_front(rows: torch.Tensor, accept_index: torch.Tensor, block: int) -> torch.Tensor:
    """Rows `[bs * block, H]` with each request's accepted rows moved to the front of its block.

    `accept_index[i, j]` is the flat row index of request i's j-th accepted token (-1 past its
    accepted run). Returns a new tensor; the rest of each block keeps its old rows."""
    index = accept_index.to(torch.long)
    valid = index >= 0
    n_req, width = index.shape
    dest = torch.arange(n_req, device=index.device).unsqueeze(1) * block + torch.arange(width, device=index.device)
    out = rows.clone()
    out[dest[valid]] = rows[index[valid]]
    return out


def ngram_sample_around(original: Callable, verify_input: Any, batch: Any, logits_output: Any,
                        *args: Any, **kwargs: Any) -> Any:
    """AROUND eagle_utils.eagle_sample: after an NGRAM verify step, put each request's accepted
    rows first in its block, as EAGLE's worker does (only when rows were captured)."""
    result = original(verify_input, batch, logits_output, *args, **kwargs)
    rows = getattr(logits_output, "hidden_states", None)
    if rows is None or type(verify_input).__name__ != "NgramVerifyInput":
        return result
    _, _, accept_index = result
    logits_output.hidden_states = accepted_rows_to_front(rows, accept_index, verify_input.draft_token_num)
    return result


def last_rows_of_runs(rows: torch.Tensor, lengths: list[int] | torch.Tensor) -> torch.Tensor:
    """The last row of each run of `rows` [sum(lengths), H] (run i has lengths[i] rows), in a new
    tensor on the rows' device: what a LAST capture of the same extend would hold. The run ends
    are summed on the rows' device (no wait for the host when the lengths are already there)."""
    if not isinstance(lengths, torch.Tensor):
        lengths = device_index(lengths, rows.device)
    ends = torch.cumsum(lengths.to(rows.device, torch.long), 0) - 1
    return rows.index_select(0, ends.clamp_(0, rows.shape[0] - 1))


def prefill_rows_around(original: Callable, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND EAGLEWorkerV2.forward_batch_generation: an EAGLE prefill captures every prompt row
    of its target for the draft, and sglang then copies all of them to the host when any request
    wants rows. When no request of the batch wants more than its last row (fingerprints,
    co-training and LAST hidden-state requests; no sglang return_hidden_states), the result keeps
    only each request's last row: a LAST layout, which the result processing reads as such, and
    a copy of [requests, H] instead of [prompt tokens, H] (64 MB for 64 x 128 tokens at 4096)."""
    result = original(worker, batch, *args, **kwargs)
    if not getattr(batch, "return_hidden_states", False):
        return result  # sglang copies no rows of this batch
    output = getattr(result, "logits_output", None)
    rows = getattr(output, "hidden_states", None)
    lengths = getattr(batch, "extend_lens", None)
    mode = getattr(batch, "return_hidden_states_mode", None)
    if (rows is None or lengths is None or mode is None or mode > CaptureHiddenMode.LAST
            or not batch.forward_mode.is_extend() or any(req.return_hidden_states for req in batch.reqs)):
        return result
    count = lengths.numel() if isinstance(lengths, torch.Tensor) else len(lengths)
    if count == 0 or count >= rows.shape[0] or (isinstance(lengths, list) and sum(lengths) != rows.shape[0]):
        return result
    output.hidden_states = last_rows_of_runs(rows, lengths)
    last = getattr(output, last_layer_rows.ATTR, None)  # an EAGLE3 target's, beside its auxiliary rows
    if last is not None:
        setattr(output, last_layer_rows.ATTR, last_rows_of_runs(last, lengths))
    return result
