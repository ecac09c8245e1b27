"""The flag parser of every `sglang-rl` subcommand: argparse's, with one-line errors.

A bad flag ends with `PROG: error: REASON` and exit code 2, the usage block only on `--help`. The
class is the client's (`sglang-rl-verify`), so the plugin's commands and the client's fail alike.
"""

from __future__ import annotations

from sglang_rl_client.arguments import ArgumentParser

__all__ = ["ArgumentParser"]
