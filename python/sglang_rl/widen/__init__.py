"""A small Llama model widened into a larger Llama shape that computes the same function.

SmolLM2-135M widened to the Llama-3.1-8B shape costs what an 8B model costs (dense matmuls do
not skip zeros) and answers as SmolLM2 does. Plain torch + safetensors; nothing here imports
sglang.

* shape.py: :class:`Shape` (named: ``llama-8b``), :class:`HiddenLayout` (where the small hidden
  dims and their copies sit), :class:`HeadMap` (query/KV heads and rotary pairs);
* tensors.py: one tensor widened (:class:`DecoderLayerMap` for a decoder layer);
* model.py: :func:`widen_model` streams a model folder into a widened one (writer.py: shards);
* drafter.py: :func:`widen_drafter` maps an EAGLE-1/2 or EAGLE3 drafter to the widened target;
* replay.py: acceptance of a (target, drafter) pair on held-out text, on the CPU;
* cli.py: ``sglang-rl model --shape llama-8b --out DIR`` and ``sglang-rl drafter widen``.
"""

from sglang_rl.widen.drafter import widen_drafter
from sglang_rl.widen.model import widen_model, widened_config, widening_of
from sglang_rl.widen.shape import LAYOUTS, NAMED_SHAPES, HeadMap, HiddenLayout, Shape, WidenError

__all__ = ["LAYOUTS", "NAMED_SHAPES", "HeadMap", "HiddenLayout", "Shape", "WidenError", "widen_drafter",
           "widen_model", "widened_config", "widening_of"]
