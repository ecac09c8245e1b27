#!/usr/bin/env python
"""Judge workers from their saved verification results (the same as `sglang-rl evidence`).

    python toploc-scripts/worker_evidence.py --calibration cal.json results.jsonl [more ...]
"""

import sys
from pathlib import Path

try:
    import sglang_rl_client  # noqa: F401
except ImportError:  # a checkout without the client installed: its client/ folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from sglang_rl_client.worker_evidence import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
