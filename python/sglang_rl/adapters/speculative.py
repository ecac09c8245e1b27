"""Hidden-state rows under speculative decoding.

A verify step computes one row per draft token: `speculative_num_draft_tokens` rows per request,
in tree order. The scheduler hook (`scheduler.decode_result_around`) takes a request's first
`accept_lens[i]` rows as the rows of its committed tokens, which holds when the accepted path
sits at the front of the request's block:
* EAGLE / NEXTN: the worker moves the accepted path to the front itself;
* NGRAM: it does not (its drafts form a tree with side branches), so `ngram_sample_around`
  does that move right after the verify step's sampling, when rows were captured.
Fingerprints (TOPLOC) take the same runs. Other algorithms are refused: for hidden-state requests
(`check_rows_supported`) and, with --toploc-verification, at start-up (`unsupported_reason`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from sglang_rl.request_options import RequestOptionError

SUPPORTED = ("EAGLE", "NEXTN", "NGRAM")
_REFUSALS = {
    "EAGLE3": "an EAGLE3 target captures auxiliary layers for its draft, not the last layer",
    "STANDALONE": "a STANDALONE target does not capture rows in its prefill",
}


def unsupported_reason(algorithm: Optional[str]) -> Optional[str]:
    """Why a server's speculative rows cannot follow the committed tokens, or None when they do
    (also None without speculative decoding)."""
    if not algorithm or str(algorithm).upper() in SUPPORTED:
        return None
    name = str(algorithm).upper()
    reason = _REFUSALS.get(name, "its verify step's rows are not known to follow the committed tokens")
    return f"{reason} (supported: {', '.join(SUPPORTED)})"


def check_rows_supported(algorithm: Optional[str]) -> None:
    """Refuse hidden-state fields on a server whose speculative rows cannot follow the committed
    tokens (None: no speculative decoding)."""
    reason = unsupported_reason(algorithm)
    if reason is not None:
        raise RequestOptionError(
            f"hidden_states_* fields are not supported with --speculative-algorithm "
            f"{str(algorithm).upper()}: {reason}"
        )


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
