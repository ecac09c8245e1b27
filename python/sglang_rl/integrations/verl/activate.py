"""Turn sglang-rl on inside verl by configuration alone.

verl's rollout server (`SGLangHttpServer.launch_server`) builds sglang's `ServerArgs` from
`actor_rollout_ref.rollout.engine_kwargs.sglang` before sglang loads its plugins (sglang does that
inside `Engine._launch_subprocesses`), so the plugin's flags would be refused as unknown keyword
arguments. verl hands `ray_kwargs.ray_init.runtime_env` to `ray.init`, and Ray runs the
runtime env's `worker_process_setup_hook` in every worker process. With this module's hook, a
process that imports verl's sglang server module loads sglang's plugins just before; sglang's
hook registry then puts the plugin's `ServerArgs` wherever sglang's was imported, verl's module
included. Nothing of verl is changed; other processes pay nothing.

    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=sglang_rl.integrations.verl.activate.load_plugins_first
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

# verl 0.9.1's module that imports sglang's ServerArgs and builds it from engine_kwargs
VERL_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"


class _LoadPluginsFirst(importlib.abc.MetaPathFinder):
    """Loads sglang's plugins once, when `VERL_SERVER_MODULE` is about to be imported."""

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Any = None) -> None:
        if name == VERL_SERVER_MODULE:
            sys.meta_path.remove(self)  # once, and not for the imports that loading makes
            load_sglang_plugins()
        return None  # the import itself goes on as usual


def load_sglang_plugins() -> None:
    """sglang's own `load_plugins()` (idempotent); a failure is logged, not raised, so that a
    process that only imports verl's module keeps working (its server would refuse the flags)."""
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    except Exception:  # noqa: BLE001 - see the docstring
        logger.exception("sglang-rl: loading sglang's plugins before verl's sglang server failed")


def load_plugins_first() -> None:
    """Ray `worker_process_setup_hook`: load sglang's plugins before verl's sglang server module
    runs (at once if it was already imported)."""
    if VERL_SERVER_MODULE in sys.modules:
        load_sglang_plugins()
    elif not any(isinstance(finder, _LoadPluginsFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoadPluginsFirst())
