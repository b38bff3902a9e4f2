"""`harness validate FILE`: check an experiment file and print what it declares."""
from __future__ import annotations

from harness.spec import load_experiment


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="validate an experiment file (exit 2 with file:line: field: problem)")
    p.add_argument("experiment", help="path to experiments/<name>.yaml")
    p.set_defaults(func=run)


def run(args) -> int:
    loaded = load_experiment(args.experiment)
    exp = loaded.exp
    def side(rev) -> str:
        return f"{rev.package.name}=={rev.package.version} (installed)" if rev.is_package else rev.ref

    print(f"{loaded.path}: ok: experiment {exp.name!r}: {len(exp.shapes)} shapes x {len(exp.modes)} modes, "
          f"{exp.blocks} blocks a side, {len(exp.gates)} gates, baseline {side(exp.baseline)}, "
          f"candidate {side(exp.candidate)}")
    return 0
