"""Import fallbacks for the staged GPU kit (put this folder on PYTHONPATH; Python imports
`sitecustomize` at start-up, in the Engine's spawned processes too).

The kit of ../shared/gpu has no `deep_gemm`, which sglang 0.5.17's EAGLE worker imports (through
`layers/attention/dsa_backend.py`) while it lists the attention backends that can capture draft
CUDA graphs. With triton attention on a Llama model nothing from it is called. A finder at the end
of `sys.meta_path` answers only for these names, and only when no real module is installed; any
attribute of a stand-in module is a function that raises if it is ever called. sglang enables its
DeepGEMM paths whenever `deep_gemm` imports, so they are switched off here
(SGLANG_ENABLE_JIT_DEEPGEMM=0), as they are without the module.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

MISSING_OK = ("deep_gemm",)


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise NotImplementedError(f"{self.__name__}.{name} is not installed in the GPU kit")

        return missing


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in MISSING_OK:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


os.environ.setdefault("SGLANG_ENABLE_JIT_DEEPGEMM", "0")
sys.meta_path.append(_Finder())
