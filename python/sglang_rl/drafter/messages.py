"""The co-training messages: what a server and its drafter trainer send each other, and their form
on the wire.

The trainer is the co-training process a server spawns (`cotrain.cotrain_main`, behind two
multiprocessing queues) or a shared trainer behind a connection (`trainer_server.TrainerHub`, whose
servers hold a `trainer_client.RemoteTrainer`); both carry the same messages, pickled.

* server -> trainer (the inbox): `Sample`, a finished rollout; `TargetHead`, the target's new
  embedding and LM head after an RL step; `Stop` (a shared trainer takes only `TO_SHARED_TRAINER`);
* trainer -> server (the outbox): `Ready`; `Round`, new draft weights and the round's metrics;
  `Held`, a round the swap check kept from the server; `Error`, a traceback or a lost connection;
* a server's own trainer hub answers its start with `HubPort` or an `Error`.

Tensors travel as plain bytes (`to_wire`): queues carry no torch tensors, because their
shared-memory file-descriptor handoff stopped delivering inside sglang's scheduler process after
the first round, while plain bytes always arrive. Engine-agnostic: no sglang import.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["Error", "FROM_TRAINER", "Held", "HubPort", "Ready", "RolloutSample", "Round", "Sample", "Stop",
           "TO_SHARED_TRAINER", "TargetHead", "Wire", "from_wire", "to_wire"]

Wire = tuple[str, tuple[int, ...], bytes]
"""A tensor on the wire: (dtype name, shape, raw bytes)."""


def to_wire(tensor: torch.Tensor) -> Wire:
    """A tensor as plain bytes for a multiprocessing pipe."""
    t = tensor.detach().to("cpu").contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def from_wire(wire: Wire) -> torch.Tensor:
    dtype, shape, data = wire
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


@dataclasses.dataclass
class RolloutSample:
    """One finished generation: ``input_ids[i]`` has the target's row ``rows[i]``; the response
    starts at ``response_start``. ``policy_version`` counts the target weight updates seen."""

    input_ids: torch.Tensor
    rows: torch.Tensor
    response_start: int
    policy_version: int


# --- server -> trainer ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    """A finished rollout, its tensors on the wire."""

    input_ids: Wire
    rows: Wire
    response_start: int
    policy_version: int

    @classmethod
    def of(cls, sample: RolloutSample) -> "Sample":
        return cls(to_wire(sample.input_ids), to_wire(sample.rows), sample.response_start, sample.policy_version)

    def rollout(self) -> RolloutSample:
        return RolloutSample(input_ids=from_wire(self.input_ids), rows=from_wire(self.rows),
                             response_start=int(self.response_start), policy_version=int(self.policy_version))


@dataclasses.dataclass(frozen=True)
class TargetHead:
    """The target's embedding and LM head after an RL step changed them (``head`` None: tied, or
    an EAGLE3 drafter, which trains its own head)."""

    embed: Wire
    head: Optional[Wire] = None


@dataclasses.dataclass(frozen=True)
class Stop:
    """The server shuts down: its own co-training process ends."""


TO_SHARED_TRAINER = (Sample, TargetHead)
"""What a server may send a shared trainer; anything else is dropped (no one server stops it)."""


# --- trainer -> server ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ready:
    """The trainer loaded its drafter and takes samples."""


@dataclasses.dataclass(frozen=True)
class Round:
    """A trained round: the draft's new weights by sglang name, and the round's metrics."""

    weights: list[tuple[str, Wire]]
    metrics: dict


@dataclasses.dataclass(frozen=True)
class Held:
    """A round the swap check kept from the server (``metrics["swap_check"]`` says why)."""

    metrics: dict


@dataclasses.dataclass(frozen=True)
class Error:
    """What went wrong, as text (a traceback, a dropped sample, a lost connection)."""

    text: str


FROM_TRAINER = (Ready, Round, Held, Error)
"""What a server takes from its trainer."""


@dataclasses.dataclass(frozen=True)
class HubPort:
    """A server's own trainer hub started: it listens on this loopback port."""

    port: int
