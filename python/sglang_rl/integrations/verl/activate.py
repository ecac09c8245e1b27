"""Turn sglang-rl on inside verl by configuration alone.

verl's rollout server (`SGLangHttpServer.launch_server`) builds sglang's `ServerArgs` from
`actor_rollout_ref.rollout.engine_kwargs.sglang` before sglang loads its plugins (sglang does that
inside `Engine._launch_subprocesses`), so the plugin's flags would be refused as unknown keyword
arguments. verl hands `ray_kwargs.ray_init.runtime_env` to `ray.init`, and Ray runs the
runtime env's `worker_process_setup_hook` in every worker process. With this module's hook:

- a process that imports verl's sglang server module loads sglang's plugins just before; sglang's
  hook registry then puts the plugin's `ServerArgs` wherever sglang's was imported, verl's module
  included;
- verl's rollout registry (`RolloutReplicaRegistry`, verl's own extension point for rollout
  backends) gives `SGLangRLReplica` for the rollout name `sglang`: verl's replica and server,
  whose outputs also carry each rollout's fingerprints and speculative counters (server.py);
- verl's trainer registry (`register_trainer`, verl's own extension point for trainers) gets
  `sglang_rl_sync`, verl's sync trainer that also logs co-training statistics every step
  (trainer.py; chosen with `trainer.v1.trainer_mode=sglang_rl_sync`).

Nothing of verl is changed; a process that imports neither module pays nothing.

    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=sglang_rl.integrations.verl.activate.load_plugins_first
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

# verl 0.9.1's module that imports sglang's ServerArgs and builds it from engine_kwargs
VERL_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"
# verl 0.9.1's registry of rollout backends (RolloutReplicaRegistry)
VERL_REPLICA_MODULE = "verl.workers.rollout.replica"
# verl 0.9.1's v1 trainers, chosen by name from its trainer registry (register_trainer)
VERL_TRAINER_PACKAGE = "verl.trainer.ppo.v1"


def load_sglang_plugins() -> None:
    """sglang's own `load_plugins()` (idempotent); a failure is logged, not raised, so that a
    process that only imports verl's module keeps working (its server would refuse the flags)."""
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    except Exception:  # noqa: BLE001 - see the docstring
        logger.exception("sglang-rl: loading sglang's plugins before verl's sglang server failed")


def register_replica(replica_module: ModuleType) -> None:
    """Make verl's rollout name `sglang` give `SGLangRLReplica` (verl's own loader still runs
    first: it prepares the process for sglang)."""
    registry = replica_module.RolloutReplicaRegistry
    verl_loader = registry._registry["sglang"]
    if getattr(verl_loader, "sglang_rl", False):
        return  # registered already (the hook ran twice in this process)

    def load_sglang_rl() -> type:
        verl_loader()
        from sglang_rl.integrations.verl.server import SGLangRLReplica

        return SGLangRLReplica

    load_sglang_rl.sglang_rl = True
    registry.register("sglang", load_sglang_rl)


def register_trainer(_trainer_package: ModuleType) -> None:
    """Register `sglang_rl_sync` with verl's trainer registry (importing it registers it)."""
    import sglang_rl.integrations.verl.trainer  # noqa: F401


class _ImportActions(importlib.abc.MetaPathFinder):
    """Runs an action just before one module is imported and another just after one is."""

    def __init__(self, before: dict[str, Callable[[], None]],
                 after: dict[str, Callable[[ModuleType], None]]) -> None:
        self.before, self.after = dict(before), dict(after)

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        action, then = self.before.pop(name, None), self.after.pop(name, None)
        if not self.before and not self.after and self in sys.meta_path:
            sys.meta_path.remove(self)  # done; the imports the actions make don't come back here
        if action is not None:
            action()
        if then is None:
            return None  # the import goes on as usual
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            logger.warning("sglang-rl: %s is not a plain module on sys.path; not registered", name)
            return None
        exec_module = spec.loader.exec_module

        def exec_then(module: ModuleType) -> None:
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then  # this spec's own loader object
        return spec


def load_plugins_first() -> None:
    """Ray `worker_process_setup_hook`: load sglang's plugins before verl's sglang server module
    runs, register `SGLangRLReplica` with verl's rollout registry and `sglang_rl_sync` with its
    trainer registry (at once where verl's modules were already imported)."""
    if any(isinstance(finder, _ImportActions) for finder in sys.meta_path):
        return
    before: dict[str, Callable[[], None]] = {}
    after: dict[str, Callable[[ModuleType], None]] = {}
    if VERL_SERVER_MODULE in sys.modules:
        load_sglang_plugins()
    else:
        before[VERL_SERVER_MODULE] = load_sglang_plugins
    if VERL_REPLICA_MODULE in sys.modules:
        register_replica(sys.modules[VERL_REPLICA_MODULE])
    else:
        after[VERL_REPLICA_MODULE] = register_replica
    if VERL_TRAINER_PACKAGE in sys.modules:
        register_trainer(sys.modules[VERL_TRAINER_PACKAGE])
    else:
        after[VERL_TRAINER_PACKAGE] = register_trainer
    if before or after:
        sys.meta_path.insert(0, _ImportActions(before, after))
