"""Start-up shim for running the real sglang 0.5.17 on a CPU-only machine (test venv only).

Installed by scripts/setup_cpu.sh as a .pth hook in .venv; never part of the plugin.
- selects sglang's CPU engine (without it sglang imports vllm for rotary embeddings);
- defines the torchvision::nms/qnms operator schemas that PyPI's CUDA torchvision build expects
  before torchvision is imported (sglang imports torchvision.io; no torchvision op is used).
"""
import os

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


_define_torchvision_schemas()
