"""The `sglang-rl` command: every tool of the plugin as a subcommand.

    sglang-rl calibrate --model-path MODEL --out cal.json
    sglang-rl drafter init --model-path MODEL --out drafter/
    sglang-rl audit --server URL --sample-dir DIR

Each subcommand is the `main(argv)` of one module, which parses its own flags: `--model-path` is
always a model folder and `--server` a URL. Bad input ends with a one-line error and exit code 2.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Optional, Sequence

# subcommand -> (module whose main(argv) runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("sglang_rl.widen.cli", "print the default model's folder (SmolLM2-135M-Instruct), building it if needed; "
              "with --shape llama-8b --out DIR, write it widened to an 8B model's shape"),
    "calibrate": ("sglang_rl.calibration.fit", "fit TOPLOC verification bounds to a model (writes a calibration file)"),
    "calibrate-server": ("sglang_rl.calibration.servers", "calibration records from a generator server checked by a verifier server"),
    "evidence": ("sglang_rl_client.worker_evidence", "judge workers from their saved verification results"),
    "drafter": ("sglang_rl.drafter.cli", "EAGLE drafter folders: `init` writes a random-init drafter; `trainer` serves one co-training trainer to several servers; `widen` maps one to a widened model"),
    "audit": ("sglang_rl.integrations.verl.audit", "verify a sample of a verl run's rollouts on a verifier server"),
}

# a subcommand's word that another module serves: (command, word) -> (module, function(argv) -> exit code);
# routed here so that the drafter package does not import the widen package, which imports it
ROUTES: dict[tuple[str, str], tuple[str, str]] = {
    ("drafter", "widen"): ("sglang_rl.widen.cli", "drafter_main"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: sglang-rl COMMAND [flags]   (sglang-rl COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_line}" for name, (_, help_line) in COMMANDS.items()]
    return "\n".join(lines)


def command_main(name: str) -> Callable[[Optional[Sequence[str]]], int]:
    """The `main(argv)` of a subcommand's module."""
    return importlib.import_module(COMMANDS[name][0]).main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the installed `sglang-rl` command; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"sglang-rl: error: unknown command {name!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    sys.argv[0] = f"sglang-rl {name}"  # argparse names the program after argv[0] in usage and errors
    if (name, rest[0] if rest else None) in ROUTES:
        module, function = ROUTES[(name, rest[0])]
        return int(getattr(importlib.import_module(module), function)(rest[1:]) or 0)
    code = command_main(name)(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
