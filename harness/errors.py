"""What a failure means to the caller: the exit codes of `harness`, the base of every bad-input
error, and the log that keeps the traceback of an unexpected one.

Exit codes (harness/cli.py maps exceptions to them):
  0 GO, 1 NO-GO, 3 INCONCLUSIVE   a verdict
  2 bad input                     a `BadInput`: the message names the file, field or argument and what
                                  was expected (a bad experiment, a run id that is a path, a run folder
                                  another process holds, damaged records a report cannot stand on)
  4 harness error                 anything else (a bug, a full disk, a broken environment): one line
                                  saying what went wrong and what to do, the traceback in a log file
  128+N                           stopped by signal N (SIGINT 130, SIGTERM 143): the run is resumable
This module imports nothing outside the standard library: `harness --help` needs only it.
"""
from __future__ import annotations

import os
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

EXIT_GO, EXIT_NOGO, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE, EXIT_HARNESS_ERROR = 0, 1, 2, 3, 4
VERDICT_EXIT = {"GO": EXIT_GO, "NO-GO": EXIT_NOGO, "INCONCLUSIVE": EXIT_INCONCLUSIVE}


class BadInput(Exception):
    """Input or state the user must fix; its message says what. Exit 2, no traceback."""


@contextmanager
def in_run(run_dir: Path, resume: str):
    """Tag an exception leaving this block with the run it interrupted, so the top level can put its
    traceback in that run folder and say how to resume (`resume`: the command that continues it)."""
    try:
        yield
    except BaseException as e:
        if getattr(e, "harness_run", None) is None:
            e.harness_run = {"run_dir": Path(run_dir), "resume": resume}
        raise


def run_of(exc: BaseException) -> dict | None:
    """{run_dir, resume} of the run `exc` interrupted (see `in_run`), else None."""
    return getattr(exc, "harness_run", None)


def write_crash_log(exc: BaseException, argv: list[str], fallback_dir: Path) -> Path | None:
    """The full traceback in a file: the interrupted run's logs/ folder, else `fallback_dir`, else the
    system's temporary folder (a full disk may refuse all but the last). None when nothing could be
    written."""
    run = run_of(exc)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = f"harness-error-{stamp}-{os.getpid()}.log"
    text = (f"harness {' '.join(argv)}\n\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    import tempfile

    for folder in ([run["run_dir"] / "logs"] if run else []) + [Path(fallback_dir), Path(tempfile.gettempdir())]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.write_text(text)
            return path
        except OSError:
            continue
    return None


# errno -> what the user can do about it (the path comes from the exception)
_OS_ADVICE = {
    "ENOSPC": "the disk is full: free space there, then resume (every record already written is kept)",
    "EDQUOT": "the disk quota is exhausted: free space there, then resume (every record already written is kept)",
    "EACCES": "permission denied: make it writable for this user, or choose another --profile-root/--reports-root",
    "EPERM": "operation not permitted: make it writable for this user, or choose another --profile-root/--reports-root",
    "EROFS": "the filesystem is read-only: choose another --profile-root/--reports-root",
    "EISDIR": "a folder stands where a file belongs: move it away",
    "ENOTDIR": "a file stands where a folder belongs: move it away",
    "EMFILE": "too many open files: raise the limit (ulimit -n)",
}


def describe(exc: BaseException) -> str:
    """One line: what went wrong and what to do about it."""
    import errno

    if isinstance(exc, OSError) and exc.errno is not None:
        code = errno.errorcode.get(exc.errno, "")
        where = exc.filename or ""
        advice = _OS_ADVICE.get(code)
        if advice:
            return f"{exc.strerror}: {where}: {advice}" if where else f"{exc.strerror}: {advice}"
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError):
        return "out of memory in the harness process: free memory or run fewer rows at once"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" + (" ..." if len(text) > 300 else "") + \
        " (an unexpected error: a harness bug or a broken environment; report it with the log)"
