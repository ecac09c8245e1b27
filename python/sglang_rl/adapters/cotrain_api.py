"""The caller's side of drafter co-training statistics: `GET /drafter_cotrain_stats` and
`sgl.Engine.get_drafter_cotrain_stats()`, answered by the scheduler (adapters/cotrain.py)."""

from __future__ import annotations

import sys
from typing import Any, Optional

from fastapi.responses import ORJSONResponse

from sglang_rl.adapters.cotrain import STATS_NAME, CotrainStatsReqInput
from sglang_rl.adapters.cotrain_parallel import combine_stats

NOT_ON = "this server was started without --drafter-cotrain"


async def fetch_stats(tokenizer_manager: Any) -> Optional[dict]:
    """The scheduler's co-training statistics (None on a server without --drafter-cotrain)."""
    tokenizer_manager.auto_create_handle_loop()
    stats = await tokenizer_manager.get_weights_by_name(CotrainStatsReqInput(name=STATS_NAME))
    return combine_stats(stats) if isinstance(stats, list) else stats  # a list: one per DP replica


async def drafter_cotrain_stats() -> ORJSONResponse:
    """GET /drafter_cotrain_stats: JSON statistics, 400 on a server without co-training."""
    from sglang.srt.entrypoints.http_server import get_global_state

    stats = await fetch_stats(get_global_state().tokenizer_manager)
    if stats is None:
        return ORJSONResponse({"error": NOT_ON}, status_code=400)
    return ORJSONResponse(stats)


def engine_get_drafter_cotrain_stats(self: Any) -> dict:
    """sgl.Engine.get_drafter_cotrain_stats(): the same JSON as the HTTP route (ValueError when
    the engine runs without drafter_cotrain=True)."""
    stats = self.loop.run_until_complete(fetch_stats(self.tokenizer_manager))
    if stats is None:
        raise ValueError(NOT_ON)
    return stats


def launch_subprocesses_after(result: Any, engine_cls: type, *args: Any, **kwargs: Any) -> None:
    """AFTER Engine._launch_subprocesses: the Engine method, and the GET route on the HTTP app
    when this process is the HTTP launcher (see adapters/drafter_weights_api.py for why here)."""
    from sglang.srt.entrypoints.engine import Engine

    if not hasattr(Engine, "get_drafter_cotrain_stats"):
        Engine.get_drafter_cotrain_stats = engine_get_drafter_cotrain_stats
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http_server is None:
        return
    if all(getattr(r, "path", None) != "/drafter_cotrain_stats" for r in http_server.app.router.routes):
        http_server.app.add_api_route("/drafter_cotrain_stats", drafter_cotrain_stats, methods=["GET"])
