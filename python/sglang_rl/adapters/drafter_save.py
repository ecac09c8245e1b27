"""Saving the served draft model in sglang's scheduler (`POST /save_draft_weights`).

One scheduler request, `SaveDraftWeightsReqInput`, registered as an IPC type and in the
scheduler's request dispatcher (see hooks.py). The scheduler holds the draft's parameters, so it
writes the folder itself, between batches: the tensors of the live EAGLE draft, unfused back
into drafter checkpoint names (`adapters/eagle_draft.draft_spec`), in the dtype it serves, with
the config.json sglang loaded the draft from (an EAGLE3 draft in SpecForge's names, `midlayer.*`,
with its draft vocabulary mapping `d2t`/`t2d`). The folder is written by
`sglang_rl.drafter.saved_folder.write_drafter_folder` (atomic, refusals with the reason).

The reply travels as a GetWeightsByName output (like the co-training statistics), so no new IPC
channel is needed: ``{"success": true, "saved": {...}}`` or ``{"success": false, "status": 400 or
500, "message": reason}``. On a co-training server, the save records itself in the statistics
(``saved``) and the metadata names the round and policy version saved.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
from sglang.srt.managers.io_struct import GetWeightsByNameReqInput, GetWeightsByNameReqOutput

from sglang_rl.adapters.eagle_draft import draft_spec, find_eagle_draft, is_eagle3
from sglang_rl.drafter.config import dtype_name
from sglang_rl.drafter.saved_folder import DraftSaveError, write_drafter_folder

logger = logging.getLogger(__name__)

SAVE_NAME = "__sglang_rl_save_draft_weights__"


class SaveDraftWeightsReqInput(GetWeightsByNameReqInput, kw_only=True):
    """Write the served draft to ``path`` (absolute, on the server); ``name`` is SAVE_NAME (the
    GetWeightsByName communicator carries the reply)."""

    path: str
    overwrite: bool = False


def served_tensors(eagle: Any) -> dict[str, torch.Tensor]:
    """The draft's own tensors under drafter checkpoint names (fused q/k/v and gate/up split
    back), as CPU copies; the target's embedding (and an EAGLE-1/2 draft's LM head, also the
    target's) is not saved."""
    spec, params = draft_spec(eagle)
    out = {}
    for name, slot in sorted(spec.slots.items()):
        tensor = params[slot.param].data
        if slot.rows is not None:
            tensor = tensor[slot.rows[0]:slot.rows[1]]
        if name == "lm_head.weight" and tensor.shape[0] > slot.shape[0]:
            tensor = tensor[:slot.shape[0]]  # an EAGLE3 head's vocabulary padding
        if tuple(tensor.shape) != slot.shape:  # a TP shard: refused before, checked again here
            raise DraftSaveError(f"{name}: this rank holds {list(tensor.shape)} of {list(slot.shape)}")
        out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def eagle3_layout(eagle: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An EAGLE3 draft's tensors as its folder holds them: the layer under SpecForge's name
    (``midlayer.``) and the draft vocabulary mapping the server reads at start (``d2t``, ``t2d``)."""
    from sglang_rl.drafter.eagle3 import specforge_name, vocab_map

    out = {specforge_name(name): t for name, t in tensors.items()}
    hot = getattr(eagle, "hot_token_id", None)
    vocab = int(eagle.target_worker.model_runner.model_config.vocab_size)
    ids = torch.arange(out["lm_head.weight"].shape[0]) if hot is None else hot.detach().to("cpu")
    out["d2t"], out["t2d"] = vocab_map(ids, vocab)
    return out


def served_config(eagle: Any, dtype: torch.dtype) -> dict:
    """config.json of the draft as sglang loaded it (its folder's file when there is one, else
    the parsed config), with ``dtype`` the dtype of the saved tensors."""
    model_config = eagle.draft_runner.model_config
    file = Path(str(getattr(model_config, "model_path", ""))) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        config = model_config.hf_config.to_dict()
    name = dtype_name(dtype)
    config["dtype"] = name
    config["torch_dtype"] = name
    return config


def _version(scheduler: Any) -> dict:
    """The co-training version of the served draft (None fields without --drafter-cotrain)."""
    from sglang_rl.adapters.cotrain import runtime_of

    rt = runtime_of(scheduler)
    if rt is None:
        return {"policy_version": None, "round": None, "round_policy_version": None}
    rt.poll(scheduler)  # apply finished rounds first: the save is the newest drafter
    last = rt.rounds[-1]["policy_version"] if rt.rounds else None
    return {"policy_version": rt.policy_version, "round": rt.draft_round, "round_policy_version": last}


def save_served_drafter(scheduler: Any, path: str, overwrite: bool = False) -> dict:
    """Write this scheduler's draft model to ``path``; returns what was saved (path, version,
    tensors, seconds). DraftSaveError with the reason for a refused save."""
    from sglang_rl.adapters.cotrain import runtime_of

    eagle, why = find_eagle_draft(getattr(scheduler, "draft_worker", None))
    if eagle is None:
        raise DraftSaveError(f"cannot save the draft: {why}")
    args = getattr(scheduler, "server_args", None)
    sizes = {flag: int(getattr(args, attr, 1) or 1) for flag, attr in (("--tp-size", "tp_size"), ("--dp-size", "dp_size"))}
    parallel = [f"{flag} {n}" for flag, n in sizes.items() if n != 1]
    if parallel:
        # every rank would write its own shard (tp) or its own copy (dp) to the same folder
        raise DraftSaveError(f"saving the draft needs one scheduler (this server runs {', '.join(parallel)})")
    start = time.perf_counter()
    version = _version(scheduler)
    tensors = served_tensors(eagle)
    dtype = next(iter(tensors.values())).dtype
    if is_eagle3(eagle):
        tensors = eagle3_layout(eagle, tensors)
    metadata = {**version, "source": str(getattr(eagle.draft_runner.model_config, "model_path", "")),
                "dtype": dtype_name(dtype), "tensors": sorted(tensors)}
    folder = write_drafter_folder(path, served_config(eagle, dtype), tensors, metadata, overwrite=overwrite)
    saved = {"path": str(folder), **version, "tensors": len(tensors),
             "seconds": round(time.perf_counter() - start, 3)}
    rt = runtime_of(scheduler)
    if rt is not None:
        rt.saved = saved
    return saved


def save_request(scheduler: Any, req: SaveDraftWeightsReqInput) -> GetWeightsByNameReqOutput:
    """Scheduler handler: save, or say why not (the scheduler keeps serving either way)."""
    reply: dict[str, Any]
    try:
        reply = {"success": True, "saved": save_served_drafter(scheduler, req.path, req.overwrite)}
    except DraftSaveError as exc:
        reply = {"success": False, "status": 400, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the caller; the scheduler keeps serving
        logger.exception("saving the draft model failed")
        reply = {"success": False, "status": 500, "message": f"saving the draft failed: {type(exc).__name__}: {exc}"}
    return GetWeightsByNameReqOutput(parameter=reply)


def saved_message(saved: dict) -> str:
    """One line describing a save, for logs and HTTP replies."""
    version = "" if saved.get("round") is None else (
        f" (co-training round {saved['round']}, policy version {saved['policy_version']})")
    return f"saved {saved['tensors']} draft tensors to {saved['path']} in {saved['seconds']}s{version}"


def reply_of(parameter: Any) -> Optional[dict]:
    """The scheduler's reply (the first one when several data-parallel schedulers answered)."""
    if isinstance(parameter, list):
        parameter = parameter[0] if parameter else None
    return parameter if isinstance(parameter, dict) else None


# --- hooks ---------------------------------------------------------------------------------------


def request_dispatcher_after(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.init_request_dispatcher: decode the save request and answer it here."""
    from sglang.srt.managers.io_struct import hook_custom_types
    from sglang.utils import TypeBasedDispatcher

    hook_custom_types(SaveDraftWeightsReqInput)
    scheduler._request_dispatcher += TypeBasedDispatcher([(SaveDraftWeightsReqInput, partial(save_request, scheduler))])
