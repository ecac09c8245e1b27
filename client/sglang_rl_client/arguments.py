"""The flag parser of `sglang-rl-verify`, `sglang-rl-evidence` and every `sglang-rl` subcommand:
argparse's, with one-line errors (`PROG: error: REASON`, exit code 2); `--help` still shows usage."""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_USAGE = 2
"""exit code of a usage error (bad flags, unreadable inputs)"""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")
