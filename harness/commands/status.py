"""`harness status EXP` / `harness status --run RUN_DIR`: where a run stands (Slurm job state, blocks done, verdict).

The job's state comes from sacct when accounting is on, else squeue/scontrol, else the
job-completion log; it is mapped to the run's state (queued, running, done, failed, timeout,
cancelled, preempted, node_fail, out_of_memory, unknown) with the exit code. A run without
slurm.json is a local run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from harness.cli import UsageError
from harness.executors import slurm as S
from harness.records import completed_blocks


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="state of an experiment's newest run (or --run DIR, or --all runs)")
    p.add_argument("experiment", nargs="?", help="experiments/<name>.yaml")
    p.add_argument("--run", type=Path, metavar="RUN_DIR", help="a run directory (profile/<name>/runs/<id>)")
    p.add_argument("--all", action="store_true", help="every run of the experiment, oldest first")
    p.add_argument("--profile-root", type=Path,
                   help="where run directories are (default: <results>/profile, see `harness run --help`)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                   help="poll until the job reaches a final state, at most this long")
    p.set_defaults(func=run)


def run_dirs(args) -> list[Path]:
    if args.run is not None:
        if not args.run.is_dir():
            raise UsageError(f"--run: {args.run} is not a run directory")
        return [args.run.resolve()]
    if not args.experiment:
        raise UsageError("give an experiment file or --run RUN_DIR")
    from harness.results import roots_from_args
    from harness.run import RunOptions
    from harness.spec import load_experiment

    loaded = load_experiment(args.experiment)
    profile_root, _ = roots_from_args(args, loaded.path)
    from harness.run import pick_run_dir

    exp_dir = pick_run_dir(loaded, RunOptions(run_id="x", profile_root=profile_root))[1].parent
    runs = sorted(p for p in exp_dir.glob("*") if p.is_dir() and ((p / "run.json").exists() or (p / "slurm.json").exists())) \
        if exp_dir.is_dir() else []
    if not runs:
        raise UsageError(f"no runs of {loaded.exp.name!r} under {exp_dir}")
    return runs if args.all else runs[-1:]


def describe(run_dir: Path, wait: float = 0) -> dict:
    manifest = S.read_json(run_dir / "run.json") or {}
    job = S.current_job(run_dir)
    out: dict = {"run_dir": str(run_dir), "run_id": run_dir.name,
                 "experiment": manifest.get("experiment") or (S.read_json(run_dir / "slurm.json") or {}).get("experiment"),
                 "executor": "slurm" if job else "local"}
    if job is not None:
        deadline = time.monotonic() + wait
        while True:
            st = S.query_state(job)
            if st.final or time.monotonic() >= deadline:
                break
            time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
        S.remember_state(run_dir, st)
        env = S.read_json(run_dir / "slurm_env.json") or {}
        out.update(job_id=job["job_ref"], slurm_state=st.state, state=st.run_state, exit_code=st.exit_code,
                   signal=st.signal, reason=st.reason, node=st.node or env.get("slurmd_nodename"), source=st.source,
                   harness_rc=env.get("harness_rc"), submissions=len((S.read_json(run_dir / "slurm.json") or {}).get("jobs", [])))
        if st.final and st.state != "COMPLETED":
            out["resume"] = f"harness submit --resume {run_dir.name} {manifest.get('experiment_file') or '<EXP>'}"
    else:
        out["state"] = "done" if manifest.get("finished") else "incomplete"
    plan = manifest.get("plan") or []
    blocks = completed_blocks(run_dir / "samples.jsonl")
    out["blocks_done"] = len(blocks)
    out["blocks_planned"] = len(plan) or None
    from harness.run import RunOptions

    name = manifest.get("experiment") or (S.read_json(run_dir / "slurm.json") or {}).get("experiment") or ""
    reports = [run_dir / "report.json", RunOptions().reports_root / name / run_dir.name / "report.json"]
    if job is not None and job.get("reports_root"):
        reports.insert(1, Path(job["reports_root"]) / name / run_dir.name / "report.json")
    for report in reports:
        data = S.read_json(report) if report.is_file() else None
        if data and "verdict" in data:
            v = data["verdict"]
            out["verdict"] = v.get("verdict") if isinstance(v, dict) else v
            break
    return out


def run(args) -> int:
    rows = [describe(d, wait=args.wait) for d in run_dirs(args)]
    if args.json:
        print(json.dumps(rows if args.all else rows[0], indent=2, sort_keys=True))
        return 0
    for r in rows:
        line = f"{r['run_dir']}: {r['state']}"
        if r["executor"] == "slurm":
            code = "" if r.get("exit_code") is None else f" exit {r['exit_code']}:{r.get('signal') or 0}"
            line += f" (job {r['job_id']} {r['slurm_state']}{code} via {r['source']}"
            line += f"{', node ' + r['node'] if r.get('node') else ''}{', reason ' + r['reason'] if r.get('reason') and r['reason'] != 'None' else ''})"
        line += f"; blocks {r['blocks_done']}/{r['blocks_planned'] or '?'}"
        if r.get("verdict"):
            line += f"; verdict {r['verdict']}"
        print(line)
        if r.get("resume"):
            print(f"  resume with: {r['resume']}")
    return 0
