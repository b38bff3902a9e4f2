"""`harness warm EXP`: compile the experiment's kernels into its Triton cache in parallel processes
(harness/warm.py says why and what it never does). Optional: `harness run` works without it, only
slower on a fresh GPU machine. Exit 0 when every process succeeded, 1 otherwise, 2 bad input."""
from __future__ import annotations

import os

from harness.cli import UsageError
from harness.revisions import RevisionError, resolve
from harness.results import add_results_arguments, roots_from_args
from harness.spec import load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("warm", help="compile the experiment's kernels in parallel before a run (GPU only)")
    p.add_argument("experiment", help="path to experiments/<name>.yaml")
    add_results_arguments(p, reports=False)
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                   help="processes at once (default: CPU count, at most 12)")
    p.add_argument("--side", choices=["baseline", "candidate"], action="append",
                   help="warm only this side (repeatable; default both)")
    p.add_argument("--no-fixtures", action="store_true",
                   help="bench rows only (the fixture cases are done once freeze and verify have run)")
    p.set_defaults(func=run)


def run(args) -> int:
    from harness.device import cuda_available
    from harness.warm import run_warm

    loaded = load_experiment(args.experiment)
    if not cuda_available():
        raise UsageError("harness warm compiles GPU kernels: no CUDA device here (the CPU smoke test needs no warming)")
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    root, _ = roots_from_args(args, loaded.path)
    try:
        revisions = resolve(loaded, root)
    except RevisionError as e:
        raise UsageError(str(e)) from e
    sides = [s for s in (revisions.baseline, revisions.candidate) if not args.side or s.side in args.side]
    if len(sides) == 2 and sides[0].kind == sides[1].kind == "git" and sides[0].sha == sides[1].sha:
        sides = sides[:1]
    rows = run_warm(loaded, sides, root, jobs=args.jobs, fixtures=not args.no_fixtures)
    return 0 if all(r["rc"] == 0 for r in rows) else 1
