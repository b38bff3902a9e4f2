"""`harness publish EXP --run RUN_ID [--as NAME]`: copy one run's report (report.json, index.html)
from the results root into this repository's tracked reports/<experiment>/<NAME or RUN_ID>/ and
refresh reports/index.html. The only way a verdict enters git: a run never writes there."""
from __future__ import annotations

import shutil
from pathlib import Path

from harness.results import PUBLISHED_REPORTS, add_results_arguments, roots_from_args
from harness.spec import SAFE_NAME, load_experiment

REPORT_FILES = ("report.json", "index.html")


def add_parser(sub) -> None:
    p = sub.add_parser("publish", help="put a run's report into this repository's reports/ (and reports/index.html)")
    p.add_argument("experiment", help="path to an experiment file")
    p.add_argument("--run", metavar="RUN_ID", required=True, help="the run whose report to publish")
    p.add_argument("--as", dest="as_name", metavar="NAME",
                   help="folder under reports/<experiment>/ (default: the run id), e.g. h200")
    p.add_argument("--into", type=Path, default=PUBLISHED_REPORTS,
                   help=f"the published reports folder (default: {PUBLISHED_REPORTS})")
    p.add_argument("--replace", action="store_true", help="overwrite a published report of the same name")
    add_results_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from harness.cli import UsageError
    from harness.report import render_index

    loaded = load_experiment(args.experiment)
    name = args.as_name or args.run
    for flag, value in (("--run", args.run), ("--as", name)):
        if not SAFE_NAME.match(value):
            raise UsageError(f"{flag} {value!r} must match {SAFE_NAME.pattern}")
    _, reports_root = roots_from_args(args, loaded.path)
    src = reports_root / loaded.exp.name / args.run
    missing = [f for f in REPORT_FILES if not (src / f).is_file()]
    if missing:
        raise UsageError(f"no {' and '.join(missing)} in {src}: `harness report {args.experiment} --run {args.run}` "
                         "renders a run's report from its records")
    dest = args.into.resolve() / loaded.exp.name / name
    if dest.exists() and not args.replace and any(
            not (dest / f).is_file() or (dest / f).read_bytes() != (src / f).read_bytes() for f in REPORT_FILES):
        raise UsageError(f"{dest} holds another report; --replace overwrites it")
    dest.mkdir(parents=True, exist_ok=True)
    for f in REPORT_FILES:
        shutil.copyfile(src / f, dest / f)
    index = render_index(args.into.resolve())
    print(f"published {src} -> {dest / 'index.html'} (index: {index})")
    return 0
