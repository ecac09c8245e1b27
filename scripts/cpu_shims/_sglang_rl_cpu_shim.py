"""Start-up shim for running the real sglang 0.5.17 on a CPU-only machine (test venv only).

Installed by scripts/setup_cpu.sh as a .pth hook in .venv; never part of the plugin.
- selects sglang's CPU engine (without it sglang imports vllm for rotary embeddings);
- defines the torchvision::nms/qnms operator schemas that PyPI's CUDA torchvision build expects,
  just before torchvision is imported (sglang imports torchvision.io; no torchvision op is used).
"""
import os
import sys

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def _define_torchvision_schemas() -> None:
    try:
        import torch
    except Exception:
        return
    global _TORCHVISION_LIB
    _TORCHVISION_LIB = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        try:
            _TORCHVISION_LIB.define(
                f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )
        except RuntimeError:
            pass



class _BeforeTorchvision:
    """A meta-path finder that defines the schemas when torchvision is first imported, so that an
    interpreter that never imports it (most test subprocesses) does not pay for importing torch."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            _define_torchvision_schemas()
        return None


sys.meta_path.insert(0, _BeforeTorchvision())
