"""Starting real sglang servers for the end-to-end suite (see conftest.py for why the flags)."""

from __future__ import annotations

import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _root_conftest():
    """test/conftest.py as already imported by pytest (both files are named conftest.py)."""
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return module
    spec = importlib.util.spec_from_file_location("sglang_rl_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


Server = _root_conftest().Server

E2E_FLAGS = ("--sleep-on-idle",)


def e2e_env(extra: dict | None = None) -> dict:
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra or {})}


def start_server(model: str, *extra: str, log_name: str, env: dict | None = None) -> Server:
    return Server(model, *E2E_FLAGS, *extra, env=e2e_env(env), log_name=log_name)


# Resident memory of one CPU server of the default model (launcher + scheduler + detokenizer,
# measured ~2.7-3 GiB with the default KV cache) and what to leave free for everything else.
SERVER_GIB = 3.0
MARGIN_GIB = 2.0


def servers_that_fit() -> int:
    """How many more servers fit in the memory available now (at least one)."""
    import psutil

    available = psutil.virtual_memory().available / 2**30
    return max(1, int((available - MARGIN_GIB) // SERVER_GIB))


def start_servers(specs: list[dict]) -> list[Server]:
    """Start several servers (spec: {"model", "args", "log_name", "env"}), as many at once as the
    available memory allows (an OOM-killed scheduler leaves its launcher waiting, not exiting);
    if one fails to start, stop the others and raise."""
    def one(spec: dict) -> Server:
        return start_server(spec["model"], *spec.get("args", ()), log_name=spec["log_name"], env=spec.get("env"))

    servers: list[Server] = []
    pending = list(specs)
    while pending:
        size = servers_that_fit()
        wave, pending = pending[:size], pending[size:]
        with ThreadPoolExecutor(len(wave)) as pool:
            futures = [pool.submit(one, spec) for spec in wave]
        errors = []
        for future in futures:
            try:
                servers.append(future.result())
            except Exception as exc:  # noqa: BLE001 - re-raised after cleanup
                errors.append(exc)
        if errors:
            for server in servers:
                server.stop()
            raise errors[0]
    return servers
