"""`harness report EXP [--run RUN_ID] [--format table|md|junit] [--out FILE]`: a run's verdict.

With an experiment file: rebuild report.json and index.html from the run's records (no GPU
needed) in <results>/reports/<name>/<run-id>/ (never in the run folder, which a run in progress
may hold) and refresh <results>/reports/index.html (this repository's tracked reports/ is written by `harness publish`
only). With a report.json or a report directory instead (a committed report, whose records are
not in git): re-render its index.html from report.json alone.
Then print the verdict: the terminal table (default), a markdown comment to paste into an issue
or pull request (`--format md`), or JUnit XML with one test case per gate (`--format junit`);
`--out FILE` writes it to FILE instead of stdout.
Exit code follows the verdict: 0 GO, 1 NO-GO, 3 INCONCLUSIVE (2 bad input, 4 harness error).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.cli import UsageError
from harness.errors import VERDICT_EXIT
from harness.formats import FORMATS
from harness.results import PUBLISHED_REPORTS, add_results_arguments, roots_from_args
from harness.spec import load_experiment

def add_parser(sub) -> None:
    p = sub.add_parser("report", help="re-render a run's report and print its verdict (table, markdown or JUnit)")
    p.add_argument("experiment", help="path to an experiment file, or a report.json or report directory "
                                      "(reports/<name>/<run-id>/) to re-render from report.json alone")
    p.add_argument("--run", metavar="RUN_ID", help="run directory name (default: the newest run)")
    add_results_arguments(p)
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="what to print: the terminal table (default), markdown for an issue or PR, JUnit XML for CI")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the --format output to FILE instead of stdout")
    p.set_defaults(func=run)


def run_dirs(profile_root: Path, name: str) -> list[Path]:
    """Every run directory of an experiment (profile/<name>/runs/<id>/ or profile/<name>/<id>/),
    oldest first by the start time in its run.json, then by name."""
    base = profile_root / name
    found = [p.parent for pattern in ("runs/*/run.json", "*/run.json") for p in base.glob(pattern)]

    def started(d: Path) -> tuple[str, str]:
        try:
            run = json.loads((d / "run.json").read_bytes())
        except (OSError, ValueError):  # a damaged run.json: its report says so
            return ("", d.name)
        return (str(run.get("started") or "") if isinstance(run, dict) else "", d.name)

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
    """Write the report to reports/<name>/<run-id>/ and refresh the index. Nothing is written into
    the run folder: a run in progress holds it (harness/runlock.py), and a report may be rendered
    from it meanwhile."""
    from harness import analyse
    from harness.report import render_index

    out = reports_root / report["experiment"]["name"] / run_dir.name
    html = analyse.write_report(report, out)
    render_index(reports_root)
    return html


def is_report_path(path: Path) -> bool:
    """A report.json, or a directory holding one (not an experiment file)."""
    return path.name == "report.json" and path.is_file() or path.is_dir() and (path / "report.json").is_file()


def rerender(report_dir: Path, reports_root: Path) -> tuple[dict, Path]:
    """index.html rendered again from the report.json beside it (report.json is never rewritten);
    reports/index.html refreshed when the report lies under the reports root."""
    from harness.commands.compare import load_report
    from harness.report import render_html, render_index

    data = load_report(report_dir)
    html = report_dir / "index.html"
    html.write_text(render_html(data))
    if reports_root in report_dir.resolve().parents:
        render_index(reports_root)
    return data, html


def emit_verdict(data: dict, fmt: str, out: Path | None) -> None:
    """The verdict in the asked format, on stdout or into `out`."""
    from harness import formats

    if fmt == "table" and out is None:
        formats.print_verdict(data)
        return
    if fmt == "table":
        with out.open("w") as f:
            formats.print_verdict(data, file=f)
        return
    text = formats.render(data, fmt)
    if out is None:
        sys.stdout.write(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def run(args) -> int:
    from harness import analyse

    source = Path(args.experiment)
    if is_report_path(source):
        report_dir = source if source.is_dir() else source.parent
        _, reports_root = roots_from_args(args, None)
        # a published report refreshes this repository's reports/index.html; one under a results root, that root's
        root = next((r for r in (reports_root, PUBLISHED_REPORTS) if r in report_dir.resolve().parents), reports_root)
        data, path = rerender(report_dir, root)
    else:
        loaded = load_experiment(args.experiment)
        profile_root, reports_root = roots_from_args(args, loaded.path)
        run_dir = find_run_dir(profile_root, loaded.exp.name, args.run)
        try:
            data = analyse.build_report(loaded, run_dir)
        except analyse.ReportError as e:
            raise UsageError(str(e)) from e
        if data["experiment"].get("matches_run") is False:
            print(f"warning: {loaded.path} changed since run {run_dir.name}; its gates are judged as declared now "
                  "(the report says so)", file=sys.stderr)
        path = publish(data, run_dir, reports_root)
    emit_verdict(data, args.format, args.out)
    # stdout stays the verdict alone when it is markdown or JUnit (to paste or to pipe)
    where = sys.stdout if args.format == "table" and args.out is None else sys.stderr
    print(f"{data['verdict']}: {path}", file=where)
    return VERDICT_EXIT.get(data["verdict"], 3)
