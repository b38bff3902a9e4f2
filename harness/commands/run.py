"""`harness run EXP`: the whole protocol, resumable (`--resume`); exit 0 GO, 1 NO-GO, 3 INCONCLUSIVE,
2 bad input, 4 harness error (harness/errors.py)."""
from __future__ import annotations


from harness.attempts import clean_reason
from harness.cli import UsageError
from harness.errors import VERDICT_EXIT
from harness.formats import print_verdict
from harness.progress import make_progress
from harness.revisions import RevisionError
from harness.results import add_results_arguments, roots_from_args
from harness.run import RunError, RunOptions, run_experiment
from harness.spec import load_experiment


def add_common(p) -> None:
    p.add_argument("experiment", help="path to an experiment file (anywhere)")
    p.add_argument("--resume", action="store_true", help="continue the newest (or --run-id) run from its last complete block")
    p.add_argument("--run-id", help="name of the run directory under <results>/profile/<name>/runs/")
    add_results_arguments(p)
    p.add_argument("--cpu", action="store_true", help="run the CPU smoke-test profile even when a GPU is present")


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run the whole protocol of an experiment and print its verdict")
    add_common(p)
    p.add_argument("--note", default="", help="what this attempt changed (logged with the attempt)")
    p.add_argument("--reopen", metavar="REASON", help="allow a GO after the attempt budget is spent (logged)")
    p.add_argument("--measure-anyway", metavar="REASON",
                   help="after a failed Amdahl pre-gate, or a candidate that failed verification (correctness, "
                        "frozen paths), still run the blocks, ncu and training rows (logged in run.json with "
                        "REASON; the verdict stays NO-GO): to put an existing candidate's cost on record")
    p.add_argument("--aa", action="store_true", help="A/A run: baseline against itself, to measure the noise floor")
    p.add_argument("--quiet", action="store_true",
                   help="plain progress lines, no live display (the default when stdout is not a terminal; "
                        "also HARNESS_QUIET=1): for CI and Slurm logs")
    p.set_defaults(func=run)


def options(args) -> RunOptions:
    def reason(name: str, default=None):  # stored in records and echoed to terminals: printable only
        value = getattr(args, name, default)
        return clean_reason(value) if value is not None else None

    opts = RunOptions(resume=args.resume, run_id=args.run_id, note=reason("note", ""),
                      reopen=reason("reopen"), force_cpu=args.cpu, aa=getattr(args, "aa", False),
                      bench_only=getattr(args, "bench_only", False), measure_anyway=reason("measure_anyway"))
    opts.profile_root, opts.reports_root = roots_from_args(args, args.experiment)
    return opts


def run(args) -> int:
    loaded = load_experiment(args.experiment)
    progress = make_progress(quiet=getattr(args, "quiet", False))
    try:
        verdict, out_dir, data = run_experiment(loaded, options(args), log=progress)
    except (RunError, RevisionError) as e:
        raise UsageError(str(e)) from e
    finally:
        progress.close()
    print_verdict(data)  # after the live display is gone: the last thing on screen is the verdict
    print(f"{verdict}: {out_dir / 'index.html'}")
    return VERDICT_EXIT[verdict]
