"""`harness submit EXP [EXP ...]`: send `harness run` to Slurm (one job; several experiments = one job array).

Resources default to each experiment's `slurm:` section; options override them. Every value is
validated and shell-quoted before it reaches the script (harness/executors/slurm.py); a bad one is
refused with exit 2 naming the argument. `--resume RUN_ID` submits a job that continues that run
from its last complete block.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from harness.cli import UsageError
from harness.executors import slurm as S
from harness.spec import load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("submit", help="submit experiments as a Slurm job (array) running `harness run`")
    p.add_argument("experiments", nargs="+", metavar="EXP", help="experiments/<name>.yaml (several => one job array)")
    p.add_argument("--resume", metavar="RUN_ID", help="continue this run (one experiment) from its last complete block")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--constraint")
    p.add_argument("--qos")
    p.add_argument("--gpus", type=int, help="GPUs of the allocation (0 for a CPU smoke test)")
    p.add_argument("--time", help="time limit (minutes, HH:MM:SS, D-HH:MM:SS, ...)")
    p.add_argument("--mem", help="memory per node, e.g. 32G")
    p.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=None, help="whole node")
    p.add_argument("--template", help="slurm/<TEMPLATE>.sbatch.j2 (default: the experiment's slurm.template)")
    p.add_argument("--dependency", help="sbatch --dependency, e.g. afterok:123")
    p.add_argument("--profile-root", type=Path, help="where run directories go (default: <results>/profile, "
                                                     "see `harness run --help`)")
    p.add_argument("--reports-root", type=Path, help="where reports go (default: <results>/reports)")
    p.add_argument("--cpu", action="store_true", help="run the CPU smoke-test profile even on a GPU node")
    p.add_argument("--dry-run", action="store_true", help="render and keep job.sbatch, print it, do not submit")
    p.set_defaults(func=run)


def roots(args, loaded) -> tuple[Path, Path]:
    """profile and reports roots: given, or the experiment's results root; inside the experiment's
    repository or the harness."""
    from harness.results import results_root

    default = results_root(loaded.path)
    out = []
    for name, given, fallback in (("--profile-root", args.profile_root, default / "profile"),
                                  ("--reports-root", args.reports_root, default / "reports")):
        path = S.check_path(name, given if given is not None else fallback)
        if not any(path.is_relative_to(r.resolve()) for r in (loaded.root, S.HARNESS_ROOT)):
            raise S.SlurmError(f"{name}: {path} is outside the repository {loaded.root} (and the harness checkout)")
        out.append(path)
    return out[0], out[1]


def run_dir_for(loaded, profile_root: Path, run_id: str, resume: bool) -> Path:
    from harness.run import RunError, RunOptions, pick_run_dir

    try:
        _, run_dir, _ = pick_run_dir(loaded, RunOptions(resume=resume, run_id=run_id, profile_root=profile_root))
    except RunError as e:
        raise UsageError(str(e)) from e
    return run_dir


def run(args) -> int:
    from harness.run import new_run_id
    from harness.runlock import describe_holder, holder_of

    try:
        overrides = {f.name: getattr(args, f.name, None) for f in fields(S.JobParams)}
        for raw in args.experiments:
            S.check("EXP", raw, S.PATH_RE, "experiment path (letters, digits and ._/@+=,:- only)")
        if args.resume is not None:
            S.check_name("--resume", args.resume)
            if len(args.experiments) != 1:
                raise UsageError("--resume RUN_ID continues one run: give exactly one experiment")
        loaded_all = [load_experiment(raw) for raw in args.experiments]
        names = [ld.exp.name for ld in loaded_all]
        if len(set(names)) != len(names):
            raise UsageError(f"experiments repeat in one array: {names}")
        params = [S.params_for(ld, overrides) for ld in loaded_all]
        differ = [f.name for f in fields(S.JobParams) if len({getattr(p, f.name) for p in params}) > 1]
        if differ:
            detail = "; ".join(f"{f}: " + ", ".join(f"{n}={getattr(p, f)!r}" for n, p in zip(names, params)) for f in differ)
            raise UsageError(f"one job array needs one set of resources, but the experiments' slurm sections differ "
                             f"({detail}); pass the option(s) --{' --'.join(differ)} to choose")
        profile_root, reports_root = roots(args, loaded_all[0])
        tasks = []
        for ld in loaded_all:
            if args.resume is not None:
                run_id = args.resume
                run_dir = run_dir_for(ld, profile_root, run_id, resume=True)
                holder = holder_of(run_dir)
                if holder is not None:
                    raise UsageError(f"run {run_id} is being run by {describe_holder(holder)}; "
                                     "a job would be refused its lock")
                job = S.current_job(run_dir)
                if job is not None:
                    st = S.query_state(job)
                    if st.run_state in ("queued", "running", "suspended"):
                        raise UsageError(f"run {run_id} still has job {job['job_ref']} {st.state}; "
                                         f"`harness cancel {run_dir}` first")
            else:
                run_id = new_run_id()
                run_dir = run_dir_for(ld, profile_root, run_id, resume=False)
            tasks.append(S.task_for(ld, run_id, run_dir))
        sub = S.submit(tasks, params[0], profile_root=profile_root, reports_root=reports_root,
                       python=S.interpreter(), cpu=args.cpu, dry_run=args.dry_run,
                       argv=["harness", "submit", *sys.argv[2:]] if sys.argv[1:2] == ["submit"] else None)
    except S.SlurmError as e:
        raise UsageError(str(e)) from e
    if args.dry_run:
        print(sub.script, end="")
        for t in tasks:
            print(f"# dry run: kept {t.run_dir / 'job.sbatch'} (not submitted)", file=sys.stderr)
        return 0
    for i, t in enumerate(tasks):
        where = f" array index {i}" if len(tasks) > 1 else ""
        print(f"submitted job {sub.job_id}{where}: {t.name} run {t.run_id} -> {t.run_dir}")
    return 0
