"""What a draft-only weight update may carry, checked in full before anything is loaded.

A drafter checkpoint names its tensors ``fc.weight``, ``layers.0.self_attn.q_proj.weight`` and so
on, while sglang's draft model holds them under other names: it prefixes them, and it fuses q/k/v
into one ``qkv_proj`` parameter and gate/up into one ``gate_up_proj``. A `DraftWeightSpec` maps
every checkpoint name the draft model can load to its full (unsharded) shape and to the rows of
the model parameter that hold it. `check_update` compares an update with it and raises one
`DraftWeightError` that lists every problem, so that a bad request never half-applies.

Nothing here imports sglang: the adapter (`sglang_rl.adapters.drafter_weights`) describes the
live draft model as `ParamInfo` rows, and the checks are unit-tested on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

# fused parameter -> the checkpoint tensors stacked in it along dim 0, in order
STACKED: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_MAX_LISTED = 8


class DraftWeightError(ValueError):
    """An update or checkpoint that does not fit the draft model; the message says why."""


class ParamInfo(NamedTuple):
    """One parameter of the draft model, described in checkpoint terms.

    ``name``: the parameter's name as a checkpoint spells it (fused names stay fused here,
    e.g. ``layers.0.self_attn.qkv_proj.weight``); ``shape``: its full, unsharded shape;
    ``parts`` / ``local_parts``: for a fused parameter, the full and this rank's sizes of its
    pieces along dim 0 (None otherwise)."""

    name: str
    shape: tuple[int, ...]
    parts: Optional[tuple[int, ...]] = None
    local_parts: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class WeightSlot:
    """Where a checkpoint tensor goes: the fused-or-plain parameter ``param`` (checkpoint
    spelling), the full ``shape`` the tensor must have, and ``rows``, the [start, end) rows of
    this rank's parameter holding it (None: the whole parameter)."""

    param: str
    shape: tuple[int, ...]
    rows: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class DraftWeightSpec:
    """The loadable tensors of a draft model (``slots``) and the ones it takes from the target
    (``shared``: checkpoint name -> why it cannot be updated here)."""

    slots: Mapping[str, WeightSlot]
    shared: Mapping[str, str]

    @classmethod
    def from_params(cls, params: Iterable[ParamInfo], shared: Mapping[str, str]) -> "DraftWeightSpec":
        slots: dict[str, WeightSlot] = {}
        for info in params:
            if info.name in shared:
                continue
            slots.update(expand_param(info))
        return cls(slots=slots, shared=dict(shared))


def expand_param(info: ParamInfo) -> dict[str, WeightSlot]:
    """The checkpoint tensors that one draft parameter receives (several for a fused one)."""
    shape = tuple(int(d) for d in info.shape)
    fused = _fused_part(info.name)
    if info.parts is None or fused is None:
        return {info.name: WeightSlot(param=info.name, shape=shape)}
    pieces = STACKED[fused]
    if len(info.parts) != len(pieces) or len(info.local_parts or ()) != len(pieces):
        raise ValueError(f"{info.name}: {len(pieces)} pieces expected, got {info.parts} / {info.local_parts}")
    out: dict[str, WeightSlot] = {}
    start = 0
    for piece, full, local in zip(pieces, info.parts, info.local_parts):
        name = info.name.replace(f".{fused}.", f".{piece}.")
        out[name] = WeightSlot(param=info.name, shape=(int(full), *shape[1:]), rows=(start, start + int(local)))
        start += int(local)
    return out


def _fused_part(name: str) -> Optional[str]:
    parts = name.split(".")
    for fused in STACKED:
        if fused in parts:
            return fused
    return None


class TensorInfo(NamedTuple):
    """What the checks need to know of one incoming tensor."""

    name: str
    shape: tuple[int, ...]
    is_floating: bool = True


def check_update(spec: DraftWeightSpec, tensors: Sequence[TensorInfo], require_all: bool = False) -> None:
    """Raise `DraftWeightError` unless every tensor has a loadable name, the right shape and a
    floating dtype, and no name comes twice (and, with ``require_all``, every slot is covered)."""
    problems: list[str] = []
    if not tensors:
        problems.append("the update holds no tensors")
    seen: set[str] = set()
    duplicates, shared, unknown, wrong_shape, not_float = [], [], [], [], []
    for t in tensors:
        if t.name in seen:
            duplicates.append(t.name)
        seen.add(t.name)
        if t.name in spec.shared:
            shared.append(t.name)
        elif t.name not in spec.slots:
            unknown.append(t.name)
        else:
            expected = spec.slots[t.name].shape
            if tuple(t.shape) != expected:
                wrong_shape.append(f"{t.name} {list(t.shape)} (expected {list(expected)})")
            if not t.is_floating:
                not_float.append(t.name)
    if duplicates:
        problems.append(f"names given more than once: {_listing(duplicates)}")
    if shared:
        reasons = sorted({spec.shared[n] for n in shared})
        problems.append(f"tensors the draft shares with the target: {_listing(shared)} ({'; '.join(reasons)})")
    if unknown:
        problems.append(f"names the draft model does not have: {_listing(unknown)}{_naming_hint(unknown, spec)}")
    if wrong_shape:
        problems.append(f"wrong shapes: {_listing(wrong_shape)}")
    if not_float:
        problems.append(f"tensors that are not floating point: {_listing(not_float)}")
    if require_all:
        missing = sorted(set(spec.slots) - seen)
        if missing:
            problems.append(f"missing draft weights: {_listing(missing)}")
    if problems:
        raise DraftWeightError("draft weight update refused, nothing was loaded: " + "; ".join(problems))


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _naming_hint(unknown: Sequence[str], spec: DraftWeightSpec) -> str:
    expected = ", ".join(sorted(spec.slots)[:3])
    return f" (draft checkpoint names look like {expected}, ...)" if expected else ""


# --- drafter checkpoint folders ---------------------------------------------------------------


class CheckpointEntry(NamedTuple):
    """One tensor of a safetensors checkpoint, read from the file header only."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def checkpoint_entries(folder: str | Path) -> list[CheckpointEntry]:
    """Names, shapes and dtypes of the tensors in ``folder/*.safetensors`` (from the file
    headers: no tensor data is read)."""
    from safetensors import safe_open

    path = Path(folder)
    if not path.is_dir():
        raise DraftWeightError(f"model_path {str(folder)!r} is not a directory on the server")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftWeightError(f"model_path {str(folder)!r} holds no *.safetensors file")
    entries: list[CheckpointEntry] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    entries.append(CheckpointEntry(name, tuple(piece.get_shape()), piece.get_dtype(), file))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the caller's input error
            raise DraftWeightError(f"{file} is not a readable safetensors file: {exc}") from exc
    return entries


def plan_checkpoint_load(spec: DraftWeightSpec, entries: Sequence[CheckpointEntry]) -> tuple[list[CheckpointEntry], list[str]]:
    """Which tensors of a drafter checkpoint to load, and which names to skip.

    Like sglang's own draft loader at start-up, a checkpoint may hold tensors the draft takes from
    the target (embedding, LM head) or does not have (e.g. layer 0's input_layernorm): those are
    skipped. Every loadable draft weight must be present with its shape, so that a wrong folder
    (the target's checkpoint, another model's drafter) is refused before anything is loaded."""
    load = [e for e in entries if e.name in spec.slots]
    skipped = sorted(e.name for e in entries if e.name not in spec.slots)
    try:
        check_update(spec, [TensorInfo(e.name, e.shape, e.dtype in _FLOAT_DTYPES) for e in load], require_all=True)
    except DraftWeightError as exc:
        if skipped:
            raise DraftWeightError(f"{exc}; the folder's other names: {_listing(skipped)}") from None
        raise
    return load, skipped
