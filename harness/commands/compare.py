"""`harness compare RUN_A RUN_B`: what changed between two runs, per row and per gate.

Each argument is a report.json, a directory holding one (reports/<name>/<run-id>/), or a run
directory (its report is built from the records). Prints a table and writes a compare page.
"""
from __future__ import annotations

import json
from pathlib import Path

from harness.bench import HARNESS_ROOT
from harness.cli import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="compare two runs: per-row speedup and gate changes")
    p.add_argument("run_a", type=Path, help="report.json, a report directory or a run directory")
    p.add_argument("run_b", type=Path, help="report.json, a report directory or a run directory")
    p.add_argument("--out", type=Path, help="compare page to write (default: profile/compare/A_vs_B.html)")
    p.set_defaults(func=run)


def load_report(path: Path) -> dict:
    """A report dict from a report.json, a directory with one, or a run directory's records."""
    path = Path(path)
    if path.is_dir() and (path / "report.json").is_file():
        path = path / "report.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} is not valid JSON: {e}") from e
    if path.is_dir() and (path / "run.json").is_file():
        from harness import analyse
        from harness.spec import load_experiment

        exp_file = json.loads((path / "run.json").read_text()).get("experiment_file")
        if not exp_file:
            raise UsageError(f"{path / 'run.json'} names no experiment_file")
        return analyse.build_report(load_experiment(exp_file), path)
    raise UsageError(f"{path}: not a report.json, a report directory or a run directory")


def _overlap(a: dict, b: dict) -> str:
    if None in (a.get("lo"), a.get("hi"), b.get("lo"), b.get("hi")):
        return "n/a"
    if b["lo"] > a["hi"]:
        return "B faster (intervals disjoint)"
    if b["hi"] < a["lo"]:
        return "B slower (intervals disjoint)"
    return "overlap"


def compare_reports(a: dict, b: dict) -> dict:
    """Rows matched by name and gates by name; a side missing a row or gate shows None."""
    def side(r: dict) -> dict:
        prov = r.get("provenance") or {}
        return {"experiment": r["experiment"]["name"], "run_id": r["run"]["id"], "started": r["run"].get("started"),
                "verdict": r.get("verdict"), "cpu_mode": r["run"].get("cpu_mode"),
                "baseline_sha": (prov.get("baseline") or {}).get("sha"),
                "candidate_sha": (prov.get("candidate") or {}).get("sha"),
                "candidate_branch": (prov.get("candidate") or {}).get("branch")}

    rows_a = {r["name"]: r["speedup"] for r in a.get("rows") or []}
    rows_b = {r["name"]: r["speedup"] for r in b.get("rows") or []}
    rows = []
    for name in list(rows_a) + [n for n in rows_b if n not in rows_a]:
        ia, ib = rows_a.get(name) or {}, rows_b.get(name) or {}
        change = ib["point"] / ia["point"] if ia.get("point") and ib.get("point") else None
        rows.append({"name": name, "a": ia, "b": ib, "change": change, "overlap": _overlap(ia, ib)})
    gates_a = {g["name"]: g for g in a.get("gates") or []}
    gates_b = {g["name"]: g for g in b.get("gates") or []}
    gates = []
    for name in list(gates_a) + [n for n in gates_b if n not in gates_a]:
        sa, sb = (gates_a.get(name) or {}).get("status"), (gates_b.get(name) or {}).get("status")
        gates.append({"name": name, "a": sa, "b": sb, "changed": sa != sb,
                      "b_reason": (gates_b.get(name) or {}).get("reason")})
    warnings = []
    sa, sb = side(a), side(b)
    if sa["experiment"] != sb["experiment"]:
        warnings.append(f"different experiments: {sa['experiment']} vs {sb['experiment']}")
    if sa["baseline_sha"] != sb["baseline_sha"]:
        warnings.append("different baselines: speedups are relative to different code")
    if sa["cpu_mode"] != sb["cpu_mode"]:
        warnings.append("one run is a CPU smoke test and the other is not: timings are not comparable")
    return {"a": sa, "b": sb, "rows": rows, "gates": gates, "warnings": warnings}


def _x(iv: dict) -> str:
    if not iv or iv.get("point") is None:
        return "n/a"
    ci = f" [{iv['lo']:.3f}, {iv['hi']:.3f}]" if iv.get("lo") is not None and iv.get("hi") is not None else ""
    return f"{iv['point']:.3f}x{ci}"


def print_comparison(c: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    console.print(f"A: {escape(c['a']['experiment'])} {escape(c['a']['run_id'])} -> {escape(str(c['a']['verdict']))}")
    console.print(f"B: {escape(c['b']['experiment'])} {escape(c['b']['run_id'])} -> {escape(str(c['b']['verdict']))}")
    for w in c["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
    rows = Table(title="speedup per row (baseline median / candidate median, 95% interval)")
    for col in ("row", "A", "B", "B / A", "intervals"):
        rows.add_column(col, justify="right" if col in ("B / A",) else "left")
    for r in c["rows"]:
        rows.add_row(escape(r["name"]), _x(r["a"]), _x(r["b"]),
                     "n/a" if r["change"] is None else f"{r['change']:.3f}x", r["overlap"])
    console.print(rows)
    gates = Table(title="gates")
    for col in ("gate", "A", "B", "changed"):
        gates.add_column(col)
    for g in c["gates"]:
        gates.add_row(escape(g["name"]), str(g["a"]), str(g["b"]), "[bold]yes[/bold]" if g["changed"] else "no")
    console.print(gates)


def run(args) -> int:
    from harness.report import render_compare_html

    a, b = load_report(args.run_a), load_report(args.run_b)
    c = compare_reports(a, b)
    print_comparison(c)
    out = args.out or HARNESS_ROOT / "profile" / "compare" / f"{c['a']['run_id']}_vs_{c['b']['run_id']}.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_compare_html(c))
    print(f"compare page: {out}")
    return 0
