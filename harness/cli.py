"""`harness` / `python -m harness`: one subcommand per module in harness/commands/.

Exit codes (harness/errors.py): 0 GO, 1 NO-GO, 3 INCONCLUSIVE, 2 bad input, 4 harness error,
128+N stopped by signal N. Only the chosen subcommand's module is imported: `harness --help`
needs nothing beyond the standard library.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import signal
import sys
from pathlib import Path

from harness.errors import EXIT_BAD_INPUT, EXIT_HARNESS_ERROR, BadInput, describe, run_of, write_crash_log

# command -> its module in harness/commands/. Each module defines `add_parser(subparsers)`, which
# registers the command with its help line and `func=run`.
COMMANDS = {
    "validate": "validate",
    "report": "report", "compare": "compare", "publish": "publish",
    "freeze": "freeze",
    "verify": "verify",
    "attempts": "attempts",
    "run": "run",
    "bench": "bench",
    "ncu": "ncu",
    "profile": "profile",
    "warm": "warm",
    "submit": "submit",
    "status": "status",
    "cancel": "cancel",
    "slurm-env": "slurm_env",
}
HARNESS_ROOT = Path(__file__).resolve().parent.parent


class UsageError(BadInput):
    """Bad arguments or state that the user must fix; printed without a traceback, exit 2."""


def help_line(module: str) -> str:
    """The help line a command module gives its `sub.add_parser(NAME, help=...)`, read from the
    module's source without importing it (nor anything it imports)."""
    source = Path(__file__).resolve().parent / "commands" / f"{module}.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_parser":
            for kw in node.keywords:
                if kw.arg == "help":
                    return ast.literal_eval(kw.value)
    return ""


def _requested(argv: list[str]) -> str | None:
    """The subcommand named in argv (the first word that is not an option), if it is one."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser with the full arguments of the command `argv` names (all commands when argv is
    None); the others are listed by name and help line only, their modules left unimported."""
    parser = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = set(COMMANDS) if argv is None else {_requested(argv)}
    for name, module in COMMANDS.items():
        if name in wanted:
            importlib.import_module(f"harness.commands.{module}").add_parser(sub)
        else:
            sub.add_parser(name, help=help_line(module), add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    from harness.children import Stopped, install_signal_handlers, raise_if_stopped, restore_signal_handlers, stop_signal

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    previous = install_signal_handlers()

    def stopped(signum: int, e: BaseException) -> int:
        run = run_of(e)
        where = f"; run {run['run_dir']} is resumable: {run['resume']}" if run else ""
        print(f"harness: stopped by {signal.Signals(signum).name}; every worker was stopped{where}", file=sys.stderr)
        return 128 + signum

    try:
        code = int(args.func(args) or 0)
        raise_if_stopped()  # a stop whose Stopped a finaliser swallowed is still a stop
        return code
    except BadInput as e:
        if stop_signal() is not None:  # workers killed by a stop read as "did not start": not a setup error
            return stopped(stop_signal(), e)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (Stopped, KeyboardInterrupt) as e:
        return stopped(e.signum if isinstance(e, Stopped) else signal.SIGINT, e)
    except Exception as e:
        if stop_signal() is not None:
            return stopped(stop_signal(), e)
        log = write_crash_log(e, argv, HARNESS_ROOT / "profile" / "logs")
        run = run_of(e)
        resume = f"; then resume: {run['resume']}" if run else ""
        print(f"harness error: {describe(e)}{resume} (traceback: {log or 'could not be written'})", file=sys.stderr)
        return EXIT_HARNESS_ERROR
    finally:
        restore_signal_handlers(previous)
