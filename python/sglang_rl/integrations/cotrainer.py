"""Client-side drafter co-training (FastRL style): train the drafter where the caller wants, on rows the
server returns, and push each round into the server's draft model.

`CoTrainer` takes generation outputs that carry hidden-state rows, either the in-process Engine's
tensor format or HTTP's base64 format, with `input_ids` and `output_ids`. It feeds them to the same
`CotrainLoop` the server-side co-training uses, and after each round calls `push(weights)`.
`engine_push(engine)` and `http_push(url)` are the two pushes; both go through the draft-only
weight update, so the target is never touched.

Request rows with scope "all" (or "last_n" >= the window) and `return_final_hidden_state` off:
sample i is then (token i, row i) for every position up to the last sampled token's input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from sglang_rl.drafter.cotrain import CotrainConfig, CotrainLoop
from sglang_rl.drafter.messages import RolloutSample
from sglang_rl.hidden_states import decode_rows
from sglang_rl.request_options import HIDDEN_STATES_POSITIONS_FIELD as POSITIONS_FIELD
from sglang_rl.request_options import HIDDEN_STATES_ROWS_FIELD as ROWS_FIELD

__all__ = ["CoTrainer", "engine_push", "http_push", "sample_from_output"]

Push = Callable[[list[tuple[str, torch.Tensor]]], Any]


def _fields(output: Mapping[str, Any]) -> Mapping[str, Any]:
    """The response fields of one output: /generate or Engine meta_info, or an OpenAI choice /
    message (already a mapping of the fields)."""
    meta = output.get("meta_info")
    return meta if isinstance(meta, Mapping) else output


def sample_from_output(output: Mapping[str, Any], policy_version: int = 0) -> Optional[RolloutSample]:
    """A training sample from one output with rows, input_ids and output_ids (None when it has
    fewer than two consecutive rows ending at the last sampled token's input)."""
    fields = _fields(output)
    for name in ("input_ids", "output_ids", ROWS_FIELD):
        if name not in fields:
            raise ValueError(f"the output has no {name}: request it (return_input_ids, return_output_ids, "
                             "return_hidden_states with hidden_states_format base64 or tensor)")
    rows = fields[ROWS_FIELD]
    if isinstance(rows, Mapping):
        rows, positions = decode_rows(rows)
    else:
        positions = list(fields.get(POSITIONS_FIELD) or [])
        rows = torch.as_tensor(rows)
    ids = list(fields["input_ids"]) + list(fields["output_ids"])
    end = len(ids) - 1
    index = {int(p): i for i, p in enumerate(positions)}
    if end - 1 not in index:
        return None
    first = end - 1
    while first - 1 in index:
        first -= 1
    pick = torch.tensor([index[p] for p in range(first, end)])
    return RolloutSample(input_ids=torch.tensor(ids[first:end], dtype=torch.long),
                         rows=rows.index_select(0, pick).float(),
                         response_start=max(len(fields["input_ids"]) - first, 0),
                         policy_version=policy_version)


class CoTrainer:
    """Feed outputs with `add`; every `samples_per_round` outputs a round trains and is pushed."""

    def __init__(self, config: CotrainConfig, push: Optional[Push] = None) -> None:
        self.loop = CotrainLoop(config)
        self.push = push
        self.policy_version = 0
        self.history: list[dict] = []

    def policy_updated(self) -> None:
        """Call after each target weight update (RL step): new samples train first."""
        self.policy_version += 1

    def add(self, output: Mapping[str, Any]) -> Optional[dict]:
        """Add one output; returns the round's metrics when this output completed a round."""
        sample = sample_from_output(output, self.policy_version)
        if sample is not None:
            self.loop.add(sample)
        if not self.loop.due():
            return None
        weights, metrics = self.loop.train_round()
        if self.push is not None and weights is not None:  # None: the swap check held the round
            metrics["push"] = self.push(weights)
        self.history.append(metrics)
        return metrics


def engine_push(engine: Any) -> Push:
    """Push into an in-process sgl.Engine with the plugin loaded."""
    def push(weights: list[tuple[str, torch.Tensor]]) -> Any:
        ok, message = engine.update_draft_weights_from_tensor(weights)
        if not ok:
            raise RuntimeError(f"draft update refused: {message}")
        return message

    return push


def http_push(url: str, folder: Optional[str] = None, timeout: float = 300.0) -> Push:
    """Push to a server that can read `folder` (same host or shared filesystem): each round is
    written there as safetensors and loaded with POST /update_draft_weights_from_disk. (sglang's
    tensor serialisation of CPU tensors hands over shared memory only within the server's own
    process tree, so another process cannot use /update_draft_weights_from_tensor with them.)"""
    import tempfile

    target = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="sglang-rl-draft-push-"))

    def push(weights: list[tuple[str, torch.Tensor]]) -> Any:
        import requests
        from safetensors.torch import save_file

        target.mkdir(parents=True, exist_ok=True)
        tmp = target / "model.safetensors.tmp"
        save_file({name: t.contiguous() for name, t in weights}, str(tmp))
        tmp.replace(target / "model.safetensors")
        resp = requests.post(url.rstrip("/") + "/update_draft_weights_from_disk",
                             json={"model_path": str(target), "flush_cache": False}, timeout=timeout)
        if resp.status_code != 200:
            raise RuntimeError(f"draft update refused ({resp.status_code}): {resp.text[:500]}")
        return resp.json().get("message")

    return push
