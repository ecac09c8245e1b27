"""verl's sglang rollout server, with each rollout's sglang-rl results carried into verl's batch.

verl's `SGLangHttpServer.generate` keeps token ids, log-probs and routed experts of an output and
drops the rest of `meta_info`. This subclass changes nothing of that: after verl's own `generate`
it adds the request's record (adapters/rollout_records.py) to `TokenOutput.extra_fields`, which
verl's agent loop copies into the batch (`non_tensor_batch` in the legacy trainer, the
`extra_fields` field of the TransferQueue in the v1 trainer):

- `toploc_verification_fingerprints` on a `--toploc-verification` server;
- `spec_num_draft_tokens`, `spec_num_accepted_tokens`, `spec_num_verify_steps` with speculative
  decoding, which verl turns into `rollout/spec_accept_length` every step.

With `SGLANG_RL_ROLLOUT_SAMPLE_DIR` in the Ray workers' environment, a random sample of rollouts is
also written with their token ids for a later audit (rollout_sample.py).

`SGLangRLReplica` is verl's `SGLangReplica` whose servers are of this class; `activate.py`
registers it under verl's rollout name `sglang`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import ray
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer, SGLangReplica

from sglang_rl.adapters import rollout_records
from sglang_rl.adapters.cotrain_api import fetch_stats
from sglang_rl.integrations.verl.rollout_sample import RolloutSample


class SGLangRLHttpServer(SGLangHttpServer):
    """verl's rollout server plus the rollout records (see the module docstring)."""

    async def launch_server(self, *args: Any, **kwargs: Any) -> None:
        await super().launch_server(*args, **kwargs)
        if getattr(self, "tokenizer_manager", None) is not None:  # only the node that serves
            rollout_records.enable(self.tokenizer_manager)
        self.rollout_sample = RolloutSample.from_env(f"replica{self.replica_rank}-{os.getpid()}")

    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str,
                       *args: Any, **kwargs: Any) -> TokenOutput:
        output = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        record = rollout_records.pop(self.tokenizer_manager, request_id)
        if record:
            output.extra_fields = {**output.extra_fields, **record}
        if getattr(self, "rollout_sample", None) is not None:
            self.rollout_sample.offer(request_id, getattr(self, "global_steps", 0), prompt_ids, output.token_ids,
                                      record)
        return output

    async def drafter_cotrain_stats(self) -> Optional[dict]:
        """The server's drafter co-training statistics (None without --drafter-cotrain)."""
        return await fetch_stats(self.tokenizer_manager)


class SGLangRLReplica(SGLangReplica):
    """verl's sglang replica whose servers carry the rollout records."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(SGLangRLHttpServer)
