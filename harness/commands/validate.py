"""`harness validate EXP`: the experiment file's schema, then its setup for real (harness/setup_check.py):
the repository, both refs, the op and the reference importing on each side, one input from the
inputs factory, the frozen paths and the pytest gates' selections. Exit 2 naming the field of every
problem; `--schema-only` stops after the file itself."""
from __future__ import annotations

from harness.results import add_results_arguments, roots_from_args
from harness.spec import load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="check an experiment file and its setup (exit 2 with file:line: field: problem)")
    p.add_argument("experiment", help="path to an experiment file")
    p.add_argument("--schema-only", action="store_true",
                   help="check the file alone: no repository, worktree or subprocess")
    add_results_arguments(p, reports=False)
    p.set_defaults(func=run)


def run(args) -> int:
    loaded = load_experiment(args.experiment)
    exp = loaded.exp

    def side(rev) -> str:
        return f"{rev.package.name}=={rev.package.version} (installed)" if rev.is_package else rev.ref

    m = exp.measure
    how = (f"{exp.blocks} blocks a side" if m.engine == "blocks" else
           f"{m.pairs}-{m.max_pairs} worker pairs{' + A/A control' if m.control else ''}, "
           f"+-{m.target_half_width:.1%} or {m.row_budget_s:g} s a row")
    print(f"{loaded.path}: ok: experiment {exp.name!r}: {len(exp.shapes)} shapes x {len(exp.modes)} modes, "
          f"{how}, {len(exp.gates)} gates, baseline {side(exp.baseline)}, candidate {side(exp.candidate)}")
    if args.schema_only:
        return 0
    from harness.setup_check import check_setup

    profile_root, _ = roots_from_args(args, loaded.path)
    check_setup(loaded, profile_root, log=print)
    print(f"{loaded.path}: ok: setup (worktrees under {profile_root / exp.name / 'worktrees'})")
    return 0
