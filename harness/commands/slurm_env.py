"""`harness slurm-env --run-dir DIR`: inside a Slurm job, record its provenance in slurm_env.json
(at the start; with `--finish RC` at the end). Called by the sbatch template, not by users."""
from __future__ import annotations

from pathlib import Path

from harness.executors import slurm as S


def add_parser(sub) -> None:
    p = sub.add_parser("slurm-env", help="(inside a Slurm job) record job provenance in the run directory")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--script", type=Path, help="the batch script that runs ($0): its sha256 is recorded")
    p.add_argument("--finish", type=int, metavar="RC", help="record the end of the job with harness's exit code")
    p.set_defaults(func=run)


def run(args) -> int:
    args.run_dir.mkdir(parents=True, exist_ok=True)
    if args.finish is not None:
        S.record_finish(args.run_dir, args.finish)
    else:
        S.record_env(args.run_dir, args.script)
    return 0
