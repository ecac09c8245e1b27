#!/usr/bin/env python
"""Judge workers from their saved verification results (the same as `sglang-rl evidence`).

    python toploc-scripts/worker_evidence.py --calibration cal.json results.jsonl [more ...]
"""

import sys

from sglang_rl.worker_evidence import main

if __name__ == "__main__":
    sys.exit(main())
