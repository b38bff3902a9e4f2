"""`harness report EXP [--run RUN_ID]`: re-render a run's report from its records (no GPU needed).

Rebuilds report.json and index.html in the run directory, copies both to
reports/<name>/<run-id>/, refreshes reports/index.html and prints the report's path.
Exit code follows the verdict: 0 GO, 1 NO-GO, 3 INCONCLUSIVE (2 for bad input).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from harness.bench import HARNESS_ROOT
from harness.cli import UsageError
from harness.spec import load_experiment

VERDICT_EXIT = {"GO": 0, "NO-GO": 1, "INCONCLUSIVE": 3}


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="re-render a run's report from its records and refresh reports/index.html")
    p.add_argument("experiment", help="path to experiments/<name>.yaml")
    p.add_argument("--run", metavar="RUN_ID", help="run directory name (default: the newest run)")
    p.add_argument("--profile-root", type=Path, default=HARNESS_ROOT / "profile",
                   help="where the run records are (default: ./profile of this checkout)")
    p.add_argument("--reports-root", type=Path, default=HARNESS_ROOT / "reports",
                   help="where reports are published (default: ./reports of this checkout)")
    p.set_defaults(func=run)


def run_dirs(profile_root: Path, name: str) -> list[Path]:
    """Every run directory of an experiment (profile/<name>/runs/<id>/ or profile/<name>/<id>/),
    oldest first by the start time in its run.json, then by name."""
    base = profile_root / name
    found = [p.parent for pattern in ("runs/*/run.json", "*/run.json") for p in base.glob(pattern)]

    def started(d: Path) -> tuple[str, str]:
        try:
            return (json.loads((d / "run.json").read_text()).get("started") or "", d.name)
        except (OSError, json.JSONDecodeError):
            return ("", d.name)

    return sorted(set(found), key=started)


def find_run_dir(profile_root: Path, name: str, run_id: str | None) -> Path:
    runs = run_dirs(profile_root, name)
    if not runs:
        raise UsageError(f"no runs of {name!r} under {profile_root / name} (run `harness run` first)")
    if run_id is None:
        return runs[-1]
    matches = [d for d in runs if d.name == run_id]
    if not matches:
        known = ", ".join(d.name for d in runs[-5:])
        raise UsageError(f"no run {run_id!r} of {name!r} under {profile_root / name} (newest: {known})")
    return matches[0]


def publish(report: dict, run_dir: Path, reports_root: Path) -> Path:
    """Write the report into the run dir, copy it to reports/<name>/<run-id>/, refresh the index."""
    from harness import analyse
    from harness.report import render_index

    analyse.write_report(report, run_dir)
    out = reports_root / report["experiment"]["name"] / run_dir.name
    out.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "index.html"):
        shutil.copyfile(run_dir / name, out / name)
    render_index(reports_root)
    return out / "index.html"


def run(args) -> int:
    from harness import analyse

    loaded = load_experiment(args.experiment)
    run_dir = find_run_dir(args.profile_root.resolve(), loaded.exp.name, args.run)
    try:
        data = analyse.build_report(loaded, run_dir)
    except analyse.ReportError as e:
        raise UsageError(str(e)) from e
    if data["experiment"].get("matches_run") is False:
        print(f"warning: {loaded.path} changed since run {run_dir.name}; its gates are judged as declared now "
              "(the report says so)", file=sys.stderr)
    path = publish(data, run_dir, args.reports_root.resolve())
    print(f"{data['verdict']}: {path}")
    return VERDICT_EXIT.get(data["verdict"], 3)
