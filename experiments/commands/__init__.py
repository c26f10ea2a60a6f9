"""The `recover` subcommands, one module each; `experiments/cli.py` lists them.

Contract every command keeps:
- its module has `add_parser(sub)`, which adds the subcommand to the argparse
  subparsers `sub` and sets `func` to the function that runs it (args -> exit code);
- it validates all of its input before it starts any process; a bad value ends it
  at once with one line, `recover: error: --flag: why` (`fail`), and exit code 2.
Adding a command: a module here with `add_parser`, and one line in cli.COMMANDS.
"""
from __future__ import annotations

import sys


def fail(message: str) -> int:
    """Print `recover: error: MESSAGE` to stderr; return the exit code of bad input (2)."""
    print(f"recover: error: {message}", file=sys.stderr)
    return 2
