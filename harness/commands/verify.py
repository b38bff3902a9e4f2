"""`harness verify EXP [--side baseline|candidate]`: a side against the frozen BENCH_BASE oracle."""
from __future__ import annotations

from pathlib import Path

from harness.results import add_results_arguments, roots_from_args
from harness.spec import SIDES, load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a side against the BENCH_BASE fixtures and the frozen paths "
                                      "(exit 1 on any FAIL)")
    p.add_argument("experiment", help="path to an experiment file")
    p.add_argument("--side", choices=list(SIDES), default=None, help="default: both sides")
    add_results_arguments(p, reports=False)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--run-dir", type=Path, default=None, help="write verify.json here")
    p.set_defaults(func=run)


def run(args) -> int:
    from harness import fixtures, verify
    from harness.cli import UsageError
    from harness.revisions import RevisionError, resolve
    from harness.runlock import run_lock

    loaded = load_experiment(args.experiment)
    profile_root, _ = roots_from_args(args, loaded.path)
    record = fixtures.load_freeze(profile_root, loaded.exp.name)
    if record is None:
        raise UsageError(f"no {fixtures.freeze_path(profile_root, loaded.exp.name)}: run `harness freeze` first")
    if record.terminal:
        print(f"TERMINAL NO-GO (frozen baseline gate): {record.reason}")
        return 1
    try:
        revisions = resolve(loaded, profile_root)
        sides = [args.side] if args.side else list(SIDES)
        records = [verify.verify_side(loaded, revisions, record, s, device=args.device, profile_root=profile_root)
                   for s in sides]
    except (verify.VerifyError, RevisionError) as e:
        raise UsageError(str(e)) from e
    for r in records:
        print(verify.format_record(r))
        print()
    data = verify.verify_json(records, record)
    if args.run_dir is not None:
        with run_lock(args.run_dir, "harness verify"):
            verify.write_verify(args.run_dir, records, record)
        print(f"record: {args.run_dir / verify.VERIFY_FILE}")
    ok = all(g.get("status") == "PASS" for g in data["gates"].values())
    return 0 if ok else 1
