"""``python -m sglang_rl.drafter``: see :mod:`sglang_rl.drafter.cli`."""

import sys

from sglang_rl.drafter.cli import main

sys.exit(main())
