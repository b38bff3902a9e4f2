"""`harness freeze EXP`: the baseline gate, the oracle fixtures and the immutable BENCH_BASE commit."""
from __future__ import annotations

from pathlib import Path

from harness.results import add_results_arguments, roots_from_args
from harness.spec import load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("freeze", help="run the baseline correctness gate twice, then commit the oracle fixtures "
                                      "as bench-base/<exp> (exit 1: terminal NO-GO)")
    p.add_argument("experiment", help="path to an experiment file")
    add_results_arguments(p, reports=False)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--run-dir", type=Path, default=None, help="also write freeze.json here")
    p.add_argument("--reuse", action="store_true",
                   help="return an earlier green freeze without re-running when nothing changed")
    p.set_defaults(func=run)


def run(args) -> int:
    from harness import fixtures
    from harness.cli import UsageError
    from harness.revisions import RevisionError, resolve
    from harness.runlock import run_lock_if

    loaded = load_experiment(args.experiment)
    profile_root, _ = roots_from_args(args, loaded.path)
    try:
        with run_lock_if(args.run_dir, "harness freeze"):
            revisions = resolve(loaded, profile_root)
            record = fixtures.freeze(loaded, revisions, profile_root, device=args.device, recheck=not args.reuse,
                                     run_dir=args.run_dir)
    except (fixtures.FreezeError, RevisionError) as e:
        raise UsageError(str(e)) from e
    print(f"{'PASS' if not record.terminal else 'TERMINAL NO-GO'}: {record.reason}")
    if record.terminal:
        for f in record.failures[:20]:
            print(f"  {f}")
    else:
        print(f"BENCH_BASE {record.bench_base_branch} = {record.bench_base_sha}")
        print(f"manifest {record.manifest_path} sha256 {record.manifest_sha256}")
    print(f"record: {fixtures.freeze_path(profile_root, loaded.exp.name)}")
    return 1 if record.terminal else 0
