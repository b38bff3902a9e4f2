"""`harness cancel RUN`: scancel the Slurm job of a run (RUN: a run directory or a run id).

The blocks the job finished stay on disk; `harness submit --resume RUN_ID EXP` continues the run.
"""
from __future__ import annotations

import time
from pathlib import Path

from harness.cli import UsageError
from harness.executors import slurm as S


def add_parser(sub) -> None:
    p = sub.add_parser("cancel", help="cancel the Slurm job of a run")
    p.add_argument("run", metavar="RUN", help="run directory, or run id (searched under --profile-root)")
    p.add_argument("--profile-root", type=Path, help="where run directories are (default: $HARNESS_RESULTS/profile, else experiments/results/profile)")
    p.add_argument("--wait", type=float, default=15, metavar="SECONDS", help="wait this long for the final state")
    p.set_defaults(func=run)


def find_run(arg: str, profile_root: Path | None) -> Path:
    p = Path(arg)
    if (p / "slurm.json").is_file():
        return p.resolve()
    S.check_name("RUN", arg)
    from harness.run import RunOptions

    root = (profile_root or RunOptions().profile_root).resolve()
    hits = [d for d in root.glob(f"*/runs/{arg}") if (d / "slurm.json").is_file()] if root.is_dir() else []
    if len(hits) != 1:
        raise UsageError(f"RUN: {arg!r} is no run directory with slurm.json, nor one run id under {root}"
                         f" ({len(hits)} matches)")
    return hits[0]


def run(args) -> int:
    try:
        run_dir = find_run(args.run, args.profile_root)
        job = S.current_job(run_dir)
        if job is None:
            raise UsageError(f"{run_dir} has no Slurm job (a local run?)")
        ref = S.check("job id", job["job_ref"], r"\d+(?:_\d+)?", "job id")
        S.slurm_cmd(["scancel", ref])
        deadline = time.monotonic() + args.wait
        while True:
            st = S.query_state(job)
            if st.final or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        S.remember_state(run_dir, st)
    except S.SlurmError as e:
        raise UsageError(str(e)) from e
    print(f"cancelled job {ref} of {run_dir}: now {st.state} ({st.run_state}); "
          f"resume with: harness submit --resume {run_dir.name} EXP")
    return 0
