"""`harness` / `python -m harness`: one subcommand per module in harness/commands/.

Exit codes (../shared/design/harness.md): 0 GO, 1 NO-GO, 3 INCONCLUSIVE, 2 bad input or an error.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from harness.spec import SpecError

# Each module defines `add_parser(subparsers)` which registers its subcommand with `func=run`.
COMMANDS = [
    "validate",
    "report", "compare", "publish",
    "freeze",
    "verify",
    "attempts",
    "run",
    "bench",
    "ncu",
    "profile",
    "warm",
    "submit",
    "status",
    "cancel",
    "slurm_env",
]

EXIT_GO, EXIT_NOGO, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE = 0, 1, 2, 3


class UsageError(Exception):
    """Bad arguments or state that the user must fix; printed without a traceback, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"harness.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
