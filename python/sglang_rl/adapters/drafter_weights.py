"""Draft-only weight updates in sglang's scheduler, and target updates that leave the draft alone.

sglang 0.5.17 has no call that updates only the draft model. This adapter adds three scheduler
requests (registered as IPC types and in the scheduler's request dispatcher, see hooks.py):

* `DraftWeightsFromTensorReqInput`: the fields of sglang's UpdateWeightsFromTensorReqInput, with
  drafter checkpoint names (``fc.weight``, ``layers.0.self_attn.q_proj.weight``...);
* `DraftWeightsFromDiskReqInput`: a drafter folder (``*.safetensors``) on the server;
* `DraftWeightsByNameReqInput`: read a draft weight back (like sglang's get_weights_by_name).

An update is checked in full against the live draft model (`sglang_rl.draft_weight_check`, with
the model described by `adapters/eagle_draft.py`) and refused with the reason before anything is
loaded. The draft's embedding and LM head are the
target's own tensors, so a draft update may not carry them. The update does not wait for running
requests: their tokens are verified by the unchanged target, so a new draft changes only how many
draft tokens are accepted, never the output. The cache is flushed only when the server is idle.

On a server with an EAGLE draft, sglang's own target updates would also feed the target's
tensors to the draft model (eagle_worker_v2 loads the same names into both; update_weights_from_disk
reads the target's checkpoint into the draft). The draft's loader prefixes the names once more
(``model.model.layers...``) and ignores them, so the default format corrupts nothing, but every
update is read twice and logs a warning per tensor (272 for SmolLM2's checkpoint from disk), the
disk update repoints the draft's model_path at the target's folder, and ``load_format="direct"``
(the model's own parameter names) writes target layer-0 tensors into the draft's layer 0 or kills
the scheduler (KeyError on a name the draft lacks). `target_update_from_tensor_around` /
`target_update_from_disk_around` send such updates to the target only (a request that sets
``disable_draft_model`` keeps sglang's routing), then make sure the draft still sees the target's
embedding and head.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from multiprocessing import AuthenticationError
from typing import Any, Callable

import torch
from sglang.srt.managers.io_struct import (
    BaseReq,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    hook_custom_types,
)

from sglang_rl.adapters.eagle_draft import draft_spec, find_eagle_draft, is_eagle3, resync_shared_tensors
from sglang_rl.adapters.speculative_switch import drafter_changed
from sglang_rl.draft_weight_check import (
    DraftWeightError,
    TensorInfo,
    check_update,
    checkpoint_entries,
    plan_checkpoint_load,
)
from sglang_rl.drafter.eagle3 import sglang_name

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "flattened_bucket")


class DraftWeightsFromTensorReqInput(UpdateWeightsFromTensorReqInput, kw_only=True):
    """sglang's tensor update, addressed to the draft model only (its own type, so that the
    scheduler dispatches it here and never to sglang's handler)."""


class DraftWeightsFromDiskReqInput(BaseReq, kw_only=True):
    """Load a drafter folder (config.json + *.safetensors) from the server's disk into the draft."""

    model_path: str
    flush_cache: bool = True


class DraftWeightsByNameReqInput(GetWeightsByNameReqInput, kw_only=True):
    """Read back the first rows of one draft weight, by its checkpoint name."""


REQUEST_TYPES = (DraftWeightsFromTensorReqInput, DraftWeightsFromDiskReqInput, DraftWeightsByNameReqInput)


# --- incoming tensors ----------------------------------------------------------------------------


def _own_payload(scheduler: Any, req: UpdateWeightsFromTensorReqInput) -> Any:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    rank = scheduler.ps.tp_rank
    payloads = req.serialized_named_tensors
    if not payloads or len(payloads) <= rank:
        raise DraftWeightError(f"serialized_named_tensors needs one payload per TP rank (rank {rank} has none)")
    monkey_patch_torch_reductions()
    try:
        return MultiprocessingSerializer.deserialize(payloads[rank])
    except Exception as exc:  # noqa: BLE001 - any undecodable payload is the caller's input error
        hint = ""
        if isinstance(exc, AuthenticationError):
            hint = (" (CPU tensors serialized with MultiprocessingSerializer can only be opened by the "
                    "sender's own child processes; over HTTP send base64(pickle.dumps(named_tensors)))")
        raise DraftWeightError(
            f"serialized_named_tensors could not be deserialized: {type(exc).__name__}: {exc}{hint}") from exc


def _named_tensors(scheduler: Any, req: UpdateWeightsFromTensorReqInput) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an update, on the host or device where the sender put them."""
    if req.load_format not in LOAD_FORMATS:
        raise DraftWeightError(f"load_format {req.load_format!r} is not supported for draft-only updates "
                               f"(use one of {list(LOAD_FORMATS)})")
    payload = _own_payload(scheduler, req)
    if req.load_format == "flattened_bucket":
        return _bucket_tensors(payload)
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    if not isinstance(payload, (list, tuple)):
        raise DraftWeightError(f"the payload must be a list of (name, tensor) pairs, got {type(payload).__name__}")
    out = []
    for item in payload:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise DraftWeightError("the payload must be a list of (name, tensor) pairs")
        name, tensor = item
        if isinstance(tensor, LocalSerializedTensor):
            tensor = tensor.get(scheduler.ps.tp_rank)
        if not isinstance(tensor, torch.Tensor):
            raise DraftWeightError(f"{name}: not a tensor ({type(tensor).__name__})")
        out.append((name, tensor))
    return out


def _bucket_tensors(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a flattened bucket, after checking that its metadata fits its bytes."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
        raise DraftWeightError("a flattened_bucket payload is a dict with flattened_tensor and metadata")
    flat, metadata = payload["flattened_tensor"], list(payload["metadata"])
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise DraftWeightError("flattened_tensor must be a 1-D tensor")
    nbytes = flat.numel() * flat.element_size()
    for meta in metadata:
        try:
            size = math.prod(meta.shape) * meta.dtype.itemsize
            fits = meta.end_idx - meta.start_idx == meta.numel == size and 0 <= meta.start_idx <= meta.end_idx <= nbytes
        except (AttributeError, TypeError) as exc:
            raise DraftWeightError(f"flattened_bucket metadata is malformed: {exc}") from exc
        if not fits or not isinstance(meta.name, str):
            raise DraftWeightError(f"{meta.name}: flattened_bucket metadata does not match its bytes")
    return FlattenedTensorBucket(flattened_tensor=flat.view(torch.uint8), metadata=metadata).reconstruct_tensors()


# --- loading -------------------------------------------------------------------------------------


def _load(eagle: Any, named: list[tuple[str, torch.Tensor]], scheduler: Any) -> None:
    """Copy checked tensors into the draft's parameters, in place (CUDA graphs keep working), and
    tell the speculation switch (if any) that the drafter changed."""
    runner = eagle.draft_runner
    # A forward still in flight (overlap scheduling) finishes reading the old weights first.
    torch.get_device_module(runner.device).synchronize()
    ok, message = runner.weight_updater.update_weights_from_tensor(named_tensors=named, load_format=None)
    if not ok:
        raise RuntimeError(message)
    drafter_changed(scheduler.draft_worker)


def _flush(scheduler: Any, flush_cache: bool, empty_cache: bool = False) -> str:
    if not flush_cache:
        return "cache kept (flush_cache=false)"
    if scheduler.flush_cache(empty_cache=empty_cache):
        return "cache flushed"
    return ("cache not flushed: requests are running (cached prefixes keep draft entries of the old "
            "draft, which costs acceptance, not correctness)")


def _reply(scheduler: Any, run: Callable[[], str]) -> UpdateWeightsFromTensorReqOutput:
    """Run one update; input errors and failures become success=False with the reason. All TP
    ranks meet at a barrier afterwards, as in sglang's own weight updates."""
    try:
        return UpdateWeightsFromTensorReqOutput(success=True, message=run())
    except DraftWeightError as exc:
        return UpdateWeightsFromTensorReqOutput(success=False, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the caller; the scheduler keeps serving
        logger.exception("draft weight update failed")
        return UpdateWeightsFromTensorReqOutput(success=False, message=f"draft weight update failed: {exc}")
    finally:
        torch.distributed.barrier(group=scheduler.tp_cpu_group)


def _eagle_or_refuse(scheduler: Any) -> Any:
    eagle, why = find_eagle_draft(scheduler.draft_worker)
    if eagle is None:
        raise DraftWeightError(why)
    return eagle


def load_draft_tensors(scheduler: Any, named: list[tuple[str, torch.Tensor]]) -> str:
    """Check ``named`` (drafter checkpoint names) against this scheduler's draft model and load
    it; the in-process API (co-training rounds use it between batches). Raises DraftWeightError
    with the reason, before anything is loaded, for a bad update or a server without a draft."""
    eagle = _eagle_or_refuse(scheduler)
    spec, _ = draft_spec(eagle)
    check_update(spec, [TensorInfo(n, tuple(t.shape), t.is_floating_point()) for n, t in named])
    start = time.perf_counter()
    _load(eagle, named, scheduler)
    return f"loaded {len(named)} draft tensors in {time.perf_counter() - start:.3f}s"


def update_from_tensor(scheduler: Any, req: DraftWeightsFromTensorReqInput) -> UpdateWeightsFromTensorReqOutput:
    """Scheduler handler of a draft-only tensor update."""

    def run() -> str:
        refused = [f for f, bad in (("abort_all_requests", req.abort_all_requests),
                                    ("weight_version", req.weight_version is not None),
                                    ("disable_draft_model", bool(req.disable_draft_model))) if bad]
        if refused:
            raise DraftWeightError(f"{', '.join(refused)} cannot be used with a draft-only update "
                                   "(it never aborts requests and leaves the target's weight version as it is)")
        _eagle_or_refuse(scheduler)
        message = load_draft_tensors(scheduler, _named_tensors(scheduler, req))
        return f"{message}; {_flush(scheduler, req.flush_cache, req.torch_empty_cache)}"

    return _reply(scheduler, run)


def update_from_disk(scheduler: Any, req: DraftWeightsFromDiskReqInput) -> UpdateWeightsFromTensorReqOutput:
    """Scheduler handler of a draft-only update from a drafter folder."""

    def run() -> str:
        from safetensors import safe_open

        eagle = _eagle_or_refuse(scheduler)
        spec, _ = draft_spec(eagle)
        # an EAGLE3 folder names its layer as SpecForge does (midlayer.*); sglang's draft, layers.0.*
        rename = sglang_name if is_eagle3(eagle) else (lambda n: n)
        entries = [e._replace(name=rename(e.name)) for e in checkpoint_entries(req.model_path)]
        load, skipped = plan_checkpoint_load(spec, entries)
        named = []
        for file in sorted({e.file for e in load}):
            wanted = {e.name for e in load if e.file == file}
            with safe_open(str(file), framework="pt") as f:
                named.extend((rename(key), f.get_tensor(key)) for key in f.keys() if rename(key) in wanted)
        start = time.perf_counter()
        _load(eagle, named, scheduler)
        took = time.perf_counter() - start
        note = f"; skipped {len(skipped)} names the draft does not load ({', '.join(skipped[:8])})" if skipped else ""
        return (f"loaded {len(named)} draft tensors from {req.model_path} in {took:.3f}s{note}; "
                f"{_flush(scheduler, req.flush_cache)}")

    return _reply(scheduler, run)


def get_by_name(scheduler: Any, req: DraftWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
    """Scheduler handler: the first ``truncate_size`` rows of a draft weight (None if unknown)."""
    eagle, _ = find_eagle_draft(scheduler.draft_worker)
    if eagle is None:
        return GetWeightsByNameReqOutput(parameter=None)
    spec, params = draft_spec(eagle)
    slot = spec.slots.get(req.name)
    if slot is not None:
        tensor = params[slot.param].data
        if slot.rows is not None:
            tensor = tensor[slot.rows[0]:slot.rows[1]]
    elif req.name in spec.shared:
        tensor = params[req.name].data
    else:
        return GetWeightsByNameReqOutput(parameter=None)
    return GetWeightsByNameReqOutput(parameter=tensor[: req.truncate_size].float().cpu().tolist())


# --- hooks ---------------------------------------------------------------------------------------


def request_dispatcher_after(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.init_request_dispatcher: decode our request types from the tokenizer's IPC
    and dispatch them to the handlers above (exact types: sglang's handlers never see them)."""
    from sglang.utils import TypeBasedDispatcher

    hook_custom_types(*REQUEST_TYPES)
    scheduler._request_dispatcher += TypeBasedDispatcher([
        (DraftWeightsFromTensorReqInput, partial(update_from_tensor, scheduler)),
        (DraftWeightsFromDiskReqInput, partial(update_from_disk, scheduler)),
        (DraftWeightsByNameReqInput, partial(get_by_name, scheduler)),
    ])


def target_update_from_tensor_around(original: Callable, manager: Any, recv_req: Any) -> Any:
    """AROUND SchedulerWeightUpdaterManager.update_weights_from_tensor: with an EAGLE draft,
    an update that does not choose (disable_draft_model unset) goes to the target only."""
    eagle, _ = find_eagle_draft(manager.draft_worker)
    if eagle is None:
        return original(manager, recv_req)
    if recv_req.disable_draft_model is None:
        recv_req.disable_draft_model = True
    result = original(manager, recv_req)
    if result.success:
        resync_shared_tensors(eagle)
    return result


def target_update_from_disk_around(original: Callable, manager: Any, recv_req: Any) -> Any:
    """AROUND SchedulerWeightUpdaterManager.update_weights_from_disk: with an EAGLE draft, the
    target's checkpoint is loaded into the target only (the draft keeps its weights and path)."""
    eagle, _ = find_eagle_draft(manager.draft_worker)
    if eagle is None:
        return original(manager, recv_req)
    # the manager itself, its draft hidden for the call: a copy (dataclasses.replace) fails once
    # a memory resume has deleted one of its fields (stashed_model_static_state)
    draft_worker, manager.draft_worker = manager.draft_worker, None
    try:
        result = original(manager, recv_req)
    finally:
        manager.draft_worker = draft_worker
    if result.success:
        resync_shared_tensors(eagle)
    return result
