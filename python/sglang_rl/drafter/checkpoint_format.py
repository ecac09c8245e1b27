"""What every drafter folder shares, EAGLE-1/2 (``checkpoint.py``) and EAGLE3 (``eagle3.py``): the
weights file's name, the initialisation schemes and the error a bad folder raises."""

from __future__ import annotations

WEIGHTS_FILE = "model.safetensors"
INIT_SCHEMES = ("passthrough", "normal")


class DrafterCheckpointError(ValueError):
    """A drafter folder is missing weights, has wrong shapes, or would be ambiguous to sglang."""
