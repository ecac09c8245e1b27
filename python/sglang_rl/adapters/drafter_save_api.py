"""The caller's side of saving the served drafter: `POST /save_draft_weights` and
`sgl.Engine.save_draft_weights(path, overwrite=False)`.

Both check the request here (`parse_save_request`: path a non-empty string, overwrite a bool),
then send `adapters.drafter_save.SaveDraftWeightsReqInput` to the scheduler, which writes the
folder on the server's disk. HTTP answers 200 ``{"success": true, "message", "saved": {"path",
"policy_version", "round", ...}}``, 400 ``{"success": false, "message": reason}`` for a refused
save (no draft, path taken, unwritable path, bad body) and 500 for a failure of the server.
"""

from __future__ import annotations

import sys
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang_rl.adapters.drafter_save import SAVE_NAME, SaveDraftWeightsReqInput, reply_of, saved_message
from sglang_rl.drafter.saved_folder import DraftSaveError, parse_save_request

ROUTE = "/save_draft_weights"


async def send_save(tokenizer_manager: Any, path: str, overwrite: bool) -> dict:
    """Ask the scheduler to save; its reply (success, saved or status and message)."""
    tokenizer_manager.auto_create_handle_loop()
    obj = SaveDraftWeightsReqInput(name=SAVE_NAME, path=path, overwrite=overwrite)
    reply = reply_of(await tokenizer_manager.get_weights_by_name(obj))
    if reply is None:
        return {"success": False, "status": 500, "message": "the scheduler gave no answer to the save request"}
    return reply


def engine_save_draft_weights(self: Any, path: str, overwrite: bool = False) -> dict:
    """Write the served drafter to the folder ``path`` (loadable with
    --speculative-draft-model-path); returns what was saved (path, policy_version, round, ...).
    ValueError with the reason when the save is refused, RuntimeError when it fails."""
    try:
        path, overwrite = parse_save_request({"path": path, "overwrite": overwrite})
    except DraftSaveError as exc:
        raise ValueError(str(exc)) from exc
    reply = self.loop.run_until_complete(send_save(self.tokenizer_manager, path, overwrite))
    if not reply["success"]:
        raise (ValueError if reply.get("status") == 400 else RuntimeError)(reply["message"])
    return reply["saved"]


async def save_draft_weights(request: Request) -> JSONResponse:
    """POST /save_draft_weights {"path": DIR, "overwrite": false}."""
    from sglang.srt.entrypoints.http_server import get_global_state

    try:
        path, overwrite = parse_save_request(await request.json())
    except ValueError as exc:  # DraftSaveError, or a body that is not JSON
        reason = str(exc) if isinstance(exc, DraftSaveError) else 'the body must be JSON: {"path": DIR}'
        return JSONResponse({"success": False, "message": reason}, status_code=400)
    reply = await send_save(get_global_state().tokenizer_manager, path, overwrite)
    if not reply["success"]:
        return JSONResponse({"success": False, "message": reply["message"]}, status_code=reply.get("status", 500))
    return JSONResponse({"success": True, "message": saved_message(reply["saved"]), "saved": reply["saved"]})


def launch_subprocesses_after(result: Any, engine_cls: type, *args: Any, **kwargs: Any) -> None:
    """AFTER Engine._launch_subprocesses: the Engine method, and the route on the HTTP app when
    this process is the HTTP launcher (see adapters/drafter_weights_api.py for why here), with
    the auth level of sglang's weight routes (a save writes to the server's disk)."""
    from sglang.srt.entrypoints.engine import Engine

    if not hasattr(Engine, "save_draft_weights"):
        Engine.save_draft_weights = engine_save_draft_weights
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http_server is None:
        return
    from sglang.srt.utils.auth import AuthLevel, auth_level

    if all(getattr(r, "path", None) != ROUTE for r in http_server.app.router.routes):
        http_server.app.add_api_route(ROUTE, auth_level(AuthLevel.ADMIN_OPTIONAL)(save_draft_weights), methods=["POST"])
