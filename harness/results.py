"""The results root: where runs write their records and reports, outside the harness's tracked files.

<root>/profile/<name>/...   raw records (runs/<run-id>/, worktrees/, triton-cache/, freeze.json, ...)
<root>/reports/<name>/<run-id>/{report.json,index.html} and <root>/reports/index.html

The root is --results DIR, else $HARNESS_RESULTS, else results/ beside the experiment file.
RunOptions (harness/run.py) holds the two roots of a run; this module only says where they are
by default and turns a command's flags into them (kept free of heavy imports: every subcommand
parser uses it).
"""
from __future__ import annotations

import os
from pathlib import Path

HARNESS_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "HARNESS_RESULTS"
RESULTS_FOLDER = "results"  # the default results root: this folder beside the experiment file
PUBLISHED_REPORTS = HARNESS_ROOT / "reports"  # tracked in git: written by `harness publish` only


def results_root(experiment_file: Path | str | None = None, given: Path | str | None = None) -> Path:
    """Where runs write: `given` (--results), else $HARNESS_RESULTS, else results/ beside the
    experiment file (beside this checkout's experiments/ when no file is at hand). Raw records go
    to <root>/profile/, reports to <root>/reports/."""
    if given is not None:
        return Path(given).resolve()
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV]).resolve()
    folder = Path(experiment_file).resolve().parent if experiment_file is not None else HARNESS_ROOT / "experiments"
    return folder / RESULTS_FOLDER


def add_results_arguments(p, reports: bool = True) -> None:
    """--results (and the finer --profile-root / --reports-root) for a subcommand that reads or
    writes run records; `roots_from_args` turns them into the two roots."""
    p.add_argument("--results", type=Path, metavar="DIR",
                   help=f"results root: raw records under DIR/profile, reports under DIR/reports (default: "
                        f"${RESULTS_ENV}, else {RESULTS_FOLDER}/ beside the experiment file)")
    p.add_argument("--profile-root", type=Path, help="raw records only (default: <results>/profile)")
    if reports:
        p.add_argument("--reports-root", type=Path, help="reports only (default: <results>/reports)")


def roots_from_args(args, experiment_file: Path | str | None) -> tuple[Path, Path]:
    """(profile root, reports root) from add_results_arguments' flags, for one experiment file."""
    root = results_root(experiment_file, getattr(args, "results", None))
    given_profile, given_reports = getattr(args, "profile_root", None), getattr(args, "reports_root", None)
    return ((given_profile or root / "profile").resolve(), (given_reports or root / "reports").resolve())
