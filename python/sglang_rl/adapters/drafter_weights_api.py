"""The caller's side of draft-only weight updates: sgl.Engine methods and HTTP routes.

Each call sends one request of `sglang_rl.adapters.drafter_weights` to the schedulers through the
tokenizer manager's own communicators (the update replies are sglang's UpdateWeightsFromTensor
outputs, so they queue behind and ahead of target updates, never beside them). Unlike sglang's
target updates, a draft update does not take the model-update lock: it neither waits for running
requests nor holds back new ones, because the draft cannot change what the target outputs.

* ``Engine.update_draft_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``,
  ``Engine.update_draft_weights_from_disk(model_path, flush_cache=True)`` and
  ``Engine.get_draft_weights_by_name(name, truncate_size=100)``;
* ``POST /update_draft_weights_from_tensor`` (the body of sglang's /update_weights_from_tensor),
  ``POST /update_draft_weights_from_disk`` (``{"model_path": DIR}``) and
  ``POST /get_draft_weights_by_name`` (``{"name": ..., "truncate_size": ...}``): 200 on success,
  400 with ``{"success": false, "message": reason}`` otherwise.
"""

from __future__ import annotations

from typing import Annotated, Any, List, Optional, Tuple

from fastapi import Body
from fastapi.responses import JSONResponse
from sglang.srt.managers.communicator import FanOutCommunicator
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

from sglang_rl.adapters.drafter_weights import (
    DraftWeightsByNameReqInput,
    DraftWeightsFromDiskReqInput,
    DraftWeightsFromTensorReqInput,
)


async def send_update(tokenizer_manager: Any, obj: Any) -> Tuple[bool, str]:
    """Send a draft update to every scheduler; (all succeeded, their messages)."""
    from sglang.srt.utils import normalize_serialized_named_tensor_payloads

    tokenizer_manager.auto_create_handle_loop()
    if isinstance(obj, DraftWeightsFromTensorReqInput):
        obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
    results = await tokenizer_manager.update_weights_from_tensor_communicator(obj)
    return FanOutCommunicator.merge_results(results)


def as_draft_request(obj: UpdateWeightsFromTensorReqInput) -> DraftWeightsFromTensorReqInput:
    """sglang's tensor-update body, addressed to the draft."""
    return DraftWeightsFromTensorReqInput(**{f: getattr(obj, f) for f in obj.__struct_fields__})


# --- sgl.Engine ----------------------------------------------------------------------------------


def engine_update_draft_weights_from_tensor(self: Any, named_tensors: List[Tuple[str, Any]],
                                            load_format: Optional[str] = None,
                                            flush_cache: bool = True) -> Tuple[bool, str]:
    """Load drafter weights (checkpoint names) into the draft model only; same arguments as
    Engine.update_weights_from_tensor. Returns (success, message)."""
    obj = DraftWeightsFromTensorReqInput(
        serialized_named_tensors=self._serialize_tensors_per_rank(named_tensors, load_format),
        load_format=load_format,
        flush_cache=flush_cache,
    )
    return self.loop.run_until_complete(send_update(self.tokenizer_manager, obj))


def engine_update_draft_weights_from_disk(self: Any, model_path: str, flush_cache: bool = True) -> Tuple[bool, str]:
    """Load a drafter folder (config.json + *.safetensors) into the draft model only."""
    obj = DraftWeightsFromDiskReqInput(model_path=model_path, flush_cache=flush_cache)
    return self.loop.run_until_complete(send_update(self.tokenizer_manager, obj))


def engine_get_draft_weights_by_name(self: Any, name: str, truncate_size: int = 100) -> Optional[list]:
    """The first ``truncate_size`` rows of a draft weight (checkpoint name), or None."""
    obj = DraftWeightsByNameReqInput(name=name, truncate_size=truncate_size)
    return self.loop.run_until_complete(self.tokenizer_manager.get_weights_by_name(obj))


ENGINE_METHODS = {
    "update_draft_weights_from_tensor": engine_update_draft_weights_from_tensor,
    "update_draft_weights_from_disk": engine_update_draft_weights_from_disk,
    "get_draft_weights_by_name": engine_get_draft_weights_by_name,
}


def launch_subprocesses_after(result: Any, engine_cls: type, *args: Any, **kwargs: Any) -> None:
    """AFTER Engine._launch_subprocesses: give sgl.Engine the draft methods. sglang loads plugins
    inside Engine.__init__, after the class was chosen, so the methods are set on sglang's Engine
    class here (the first call that runs with the hooks applied)."""
    from sglang.srt.entrypoints.engine import Engine

    for name, fn in ENGINE_METHODS.items():
        if not hasattr(Engine, name):
            setattr(Engine, name, fn)


# --- HTTP ----------------------------------------------------------------------------------------


def _tokenizer_manager() -> Any:
    from sglang.srt.entrypoints.http_server import get_global_state

    return get_global_state().tokenizer_manager


def _reply(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


async def update_draft_weights_from_tensor(obj: Annotated[UpdateWeightsFromTensorReqInput, Body()]) -> JSONResponse:
    """POST /update_draft_weights_from_tensor: sglang's tensor-update body, draft model only."""
    return _reply(*await send_update(_tokenizer_manager(), as_draft_request(obj)))


async def update_draft_weights_from_disk(obj: Annotated[DraftWeightsFromDiskReqInput, Body()]) -> JSONResponse:
    """POST /update_draft_weights_from_disk {"model_path": DIR}: a drafter folder on the server."""
    return _reply(*await send_update(_tokenizer_manager(), obj))


async def get_draft_weights_by_name(obj: Annotated[DraftWeightsByNameReqInput, Body()]) -> JSONResponse:
    """POST /get_draft_weights_by_name {"name": ..., "truncate_size": ...}."""
    parameter = await _tokenizer_manager().get_weights_by_name(obj)
    if parameter is None:
        return _reply(False, f"no draft weight named {obj.name!r} (or this server has no EAGLE draft)")
    return JSONResponse(parameter, status_code=200)


ROUTES = {
    "/update_draft_weights_from_tensor": update_draft_weights_from_tensor,
    "/update_draft_weights_from_disk": update_draft_weights_from_disk,
    "/get_draft_weights_by_name": get_draft_weights_by_name,
}


def add_http_routes_after(result: Any, engine_cls: type, *args: Any, **kwargs: Any) -> None:
    """AFTER Engine._launch_subprocesses: in the HTTP launcher (the process that imported
    sglang's http_server and now starts uvicorn on its app), add the draft routes to the app, with
    the auth level of sglang's weight routes. An Engine-only process never imports http_server,
    so it skips this (hooking http_server itself would import it into every scheduler)."""
    import sys

    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http_server is None:
        return
    from sglang.srt.utils.auth import AuthLevel, auth_level

    present = {getattr(route, "path", None) for route in http_server.app.router.routes}
    for path, endpoint in ROUTES.items():
        if path not in present:
            http_server.app.add_api_route(path, auth_level(AuthLevel.ADMIN_OPTIONAL)(endpoint), methods=["POST"])
