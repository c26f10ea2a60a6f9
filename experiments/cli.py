"""The `recover` command line: `main` and the list of its subcommands.

Contract: every subcommand is a module of experiments/commands/ with an
`add_parser(sub)`, listed once in `COMMANDS` (in the order `recover --help`
shows them). Each validates all of its input before it starts any process; a bad
value ends the command at once with one line, `recover: error: --flag: why`, and
exit code 2. This module holds no command of its own.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from .commands import bench, experiment, faults, figs, launch, simulate, train

COMMANDS: list[Callable] = [
    train.add_parser,
    faults.add_parser,
    bench.add_parser,
    launch.add_parser,
    simulate.add_parser,
    experiment.add_parser,
    figs.add_parser,
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="recover",
        description="ReCoVer: resilient LLM pre-training, its baselines, fault injection and experiments.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
