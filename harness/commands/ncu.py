"""`harness ncu EXP`: the Nsight Compute phase alone, into profile/<exp>/ncu/<timestamp>/.

`harness ncu --parse FILE.ncu-rep [...]`: print what the harness reads from existing reports (per
kernel; per stage too with `--stage NAME=REGEX`), touching no GPU. Exit codes: 0 gate PASS (or a
parse that read every file), 1 FAIL, 3 INCONCLUSIVE, 2 bad input or an error.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from harness.cli import UsageError
from harness.results import add_results_arguments


def add_parser(sub) -> None:
    p = sub.add_parser("ncu", help="run the Nsight Compute phase of an experiment, or --parse reports")
    p.add_argument("experiment", nargs="?", help="path to experiments/<name>.yaml")
    p.add_argument("--parse", nargs="+", type=Path, metavar="FILE.ncu-rep",
                   help="only read these reports and print their kernel (and --stage) tables")
    p.add_argument("--stage", action="append", default=[], metavar="NAME=REGEX",
                   help="with --parse: sum kernels matching REGEX into stage NAME (repeatable)")
    p.add_argument("--json", action="store_true", help="with --parse: print the parsed record as JSON")
    add_results_arguments(p, reports=False)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.parse:
        return _parse(args)
    if not args.experiment:
        raise UsageError("give an experiment file, or --parse FILE.ncu-rep")
    return _profile(args)


def _parse(args) -> int:
    from harness import ncu

    stages: dict[str, list[str]] = {}
    for item in args.stage:
        name, sep, rx = item.partition("=")
        if not sep or not name or not rx:
            raise UsageError(f"--stage {item!r}: expected NAME=REGEX")
        stages.setdefault(name, []).append(rx)
    out = {}
    for path in args.parse:
        try:
            launches, reader = ncu.read_report(path)
        except ncu.ReportError as e:
            raise UsageError(str(e)) from e
        kernels = ncu.kernel_metrics({_guess_pass(launches): launches})
        rec = {"reader": reader, "launches": len(launches), "kernels": kernels}
        if stages:
            rec["stages"] = ncu.stage_sums(kernels, stages)
        out[str(path)] = rec
        if not args.json:
            ncu.print_kernels(kernels, f"{path} ({len(launches)} launches, read with {reader})")
            for name, st in rec.get("stages", {}).items():
                print(f"stage {name}: kernels {st['kernels'] or 'none matched'}; " + ", ".join(
                    f"{k}={ncu.fmt(k, ncu.stage_value(st, k))}" for k in ncu.TABLE_KEYS))
    if args.json:
        print(json.dumps(ncu._clean(out), indent=2, sort_keys=True, default=str))
    return 0


def _guess_pass(launches) -> str:
    """A report with SpeedOfLight metrics is a `full` pass; one without, a `source` pass."""
    return "full" if any("gpu__time_duration.sum" in la.metrics for la in launches) else "source"


def _profile(args) -> int:
    from harness import ncu
    from harness import revisions as rev
    from harness.results import roots_from_args
    from harness.spec import load_experiment

    loaded = load_experiment(args.experiment)
    if loaded.exp.ncu is None:
        raise UsageError(f"{loaded.path}: the experiment has no `ncu:` section (rows, stages)")
    profile_root, _ = roots_from_args(args, loaded.path)
    try:
        revisions = rev.resolve(loaded, profile_root)
    except rev.RevisionError as e:
        raise UsageError(str(e)) from e
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_dir = profile_root / loaded.exp.name / "ncu" / stamp
    run_dir.mkdir(parents=True, exist_ok=False)
    record = ncu.ncu_run(loaded, revisions, run_dir, profile_root)
    for row in record.get("rows", []):
        ncu.print_stage_table(record, row)
    print(f"record: {run_dir / 'ncu.json'}")
    status = (record.get("gate") or {}).get("status")
    return {"PASS": 0, "FAIL": 1}.get(status, 3)
