"""Last-layer rows beside an EAGLE3 target's auxiliary rows.

An EAGLE3 target captures the rows of a low, a middle and a high layer, concatenated, as
`logits_output.hidden_states`: what its draft reads. Fingerprints (TOPLOC) and hidden-state fields
are defined on the last layer (the lm_head input), which sglang's logits processor also holds at
that point. These hooks keep those rows, in the layout of the captured ones (FULL or LAST, the same
pruning), on the logits output beside them (`ATTR`); the scheduler hooks read them with
`last_layer_rows`, and co-training keeps reading the auxiliary rows its EAGLE3 draft trains on.

A graph replay rebuilds the logits output with sglang's own fields only, so a server that needs
these rows runs its target without CUDA graphs (`server_args.RLServerArgs` refuses the rest).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from sglang.srt.runtime_context import get_server_args

ATTR = "sglang_rl_last_layer_rows"
_PENDING = "_sglang_rl_pending_last_layer_rows"


def server_needs_them(args: Any) -> bool:
    """Whether an EAGLE3 server's requests can need last-layer rows (fingerprints, fields, the
    SpecForge export)."""
    return (str(getattr(args, "speculative_algorithm", None) or "").upper() == "EAGLE3"
            and bool(getattr(args, "toploc_verification", False) or args.return_hidden_states_mode
                     or getattr(args, "specforge_export_dir", None)))


def store_rows_around(original: Callable, processor: Any, hidden_states: torch.Tensor,
                      hidden_states_before_norm: Optional[torch.Tensor], aux_hidden_states: Any,
                      pruned_states: torch.Tensor, pruned_states_before_norm: Optional[torch.Tensor],
                      aux_pruned_states: Any, sample_indices: Optional[torch.Tensor],
                      logits_metadata: Any) -> Optional[torch.Tensor]:
    """AROUND LogitsProcessor._get_hidden_states_to_store: with auxiliary layers, also pick the
    last layer's rows the way sglang picks rows without them, for the forward to attach."""
    stored = original(processor, hidden_states, hidden_states_before_norm, aux_hidden_states, pruned_states,
                      pruned_states_before_norm, aux_pruned_states, sample_indices, logits_metadata)
    if stored is not None and aux_hidden_states is not None and server_needs_them(get_server_args()):
        processor.__dict__[_PENDING] = original(
            processor, hidden_states, hidden_states_before_norm, None, pruned_states,
            pruned_states_before_norm, None, sample_indices, logits_metadata)
    return stored


def logits_forward_after(result: Any, processor: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER LogitsProcessor.forward: the last-layer rows picked in this forward go on its output."""
    rows = processor.__dict__.pop(_PENDING, None)
    if rows is not None and result is not None:
        setattr(result, ATTR, rows)
    return result


def last_layer_rows(logits_output: Any) -> Optional[torch.Tensor]:
    """The last layer's rows of a step: the EAGLE3 target's kept ones, else the captured rows."""
    if logits_output is None:
        return None
    rows = getattr(logits_output, ATTR, None)
    return logits_output.hidden_states if rows is None else rows


def set_last_layer_rows(logits_output: Any, rows: torch.Tensor) -> None:
    """Replace the step's last-layer rows (wherever `last_layer_rows` found them)."""
    if getattr(logits_output, ATTR, None) is not None:
        setattr(logits_output, ATTR, rows)
    else:
        logits_output.hidden_states = rows


def accept_tree_path_around(original: Callable, batch: Any, accept_index: torch.Tensor, accept_lens: torch.Tensor,
                            predict: torch.Tensor, logits_output: Any, bs: int, *args: Any, **kwargs: Any) -> Any:
    """AROUND eagle_worker_common._finalize_accept_tree_path: a tree step (topk > 1) moves each
    request's accepted path to the front of its block; the last-layer rows move with it."""
    from sglang.srt.speculative.eagle_worker_common import _compact_accept_to_front

    result = original(batch, accept_index, accept_lens, predict, logits_output, bs, *args, **kwargs)
    rows = getattr(logits_output, ATTR, None)
    if rows is not None:
        setattr(logits_output, ATTR, _compact_accept_to_front(
            rows, accept_index, bs, num_draft_tokens=kwargs["num_draft_tokens"]))
    return result
