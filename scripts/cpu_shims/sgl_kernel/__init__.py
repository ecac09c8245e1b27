"""Stand-in for sgl_kernel on CPU test machines (no CPU build of sgl-kernel exists on PyPI).

sglang's CPU paths import a few `<name>_cpu` kernels at module load; with
--attention-backend torch_native none of them is called. Any attribute resolves to a
function that raises, so an unexpected call fails loudly instead of silently.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available on this CPU test machine")

    _missing.__name__ = name
    return _missing
