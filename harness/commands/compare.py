"""`harness compare RUN_A RUN_B`: what changed between two runs, per row and per gate.

Each argument is a report.json, a directory holding one (reports/<name>/<run-id>/), or a run
directory (its report is built from the records). Prints a table and writes a compare page.
"""
from __future__ import annotations

import json
from pathlib import Path

from harness.cli import UsageError
from harness.fmt import fmt_speedup
from harness.results import HARNESS_ROOT
from harness.verdict import gate_summary, row_bases, verdict_lines


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


def _row_numbers(report: dict) -> dict[str, tuple]:
    """Each measured row of a run by name: (its verdict line, the row)."""
    rows = {r["name"]: r for r in report.get("rows") or []}
    return {ln.row: (ln, rows[ln.row]) for ln in verdict_lines(report)}


def _row_side(found: tuple | None, basis: str | None) -> dict | None:
    """One run's numbers for a row on `basis` (its own line's basis when it lacks that one)."""
    if found is None:
        return None
    line, row = found
    bases = row_bases(row)
    use = basis if basis in bases else line.basis
    return {"basis": use, "dims": line.dims, "point": bases[use]["speedup"].get("point"),
            "lo": bases[use]["speedup"].get("lo"), "hi": bases[use]["speedup"].get("hi"),
            "baseline_ms": bases[use]["baseline"].get("median"), "candidate_ms": bases[use]["candidate"].get("median")}


def compare_reports(a: dict, b: dict) -> dict:
    """Rows matched by name (on A's basis for the row) and gates by name; a row or gate only one run
    has is listed with the other side None and named in `only_in_a` / `only_in_b`."""
    def side(r: dict) -> dict:
        prov = r.get("provenance") or {}
        return {"experiment": r["experiment"]["name"], "run_id": r["run"]["id"], "started": r["run"].get("started"),
                "verdict": r.get("verdict"), "cpu_mode": r["run"].get("cpu_mode"),
                "baseline_sha": (prov.get("baseline") or {}).get("sha"),
                "candidate_sha": (prov.get("candidate") or {}).get("sha"),
                "candidate_branch": (prov.get("candidate") or {}).get("branch")}

    found_a, found_b = _row_numbers(a), _row_numbers(b)
    rows = []
    for name in list(found_a) + [n for n in found_b if n not in found_a]:
        ia = _row_side(found_a.get(name), None)
        ib = _row_side(found_b.get(name), ia["basis"] if ia else None)
        ia = ia or {}
        ib = ib or {}
        change = ib["point"] / ia["point"] if ia.get("point") and ib.get("point") else None
        rows.append({"name": name, "a": ia, "b": ib, "change": change, "overlap": _overlap(ia, ib),
                     "only_in": "A" if not ib else "B" if not ia else None,
                     "dims_differ": bool(ia and ib and ia["dims"] != ib["dims"])})
    gates_a = {g["name"]: g for g in a.get("gates") or []}
    gates_b = {g["name"]: g for g in b.get("gates") or []}
    gates = []
    for name in list(gates_a) + [n for n in gates_b if n not in gates_a]:
        sa, sb = (gates_a.get(name) or {}).get("status"), (gates_b.get(name) or {}).get("status")
        gates.append({"name": name, "a": sa, "b": sb, "changed": sa != sb,
                      "b_reason": gate_summary(gates_b[name]) if name in gates_b else None})
    warnings = []
    sa, sb = side(a), side(b)
    if sa["experiment"] != sb["experiment"]:
        warnings.append(f"different experiments: {sa['experiment']} vs {sb['experiment']}")
    if sa["baseline_sha"] != sb["baseline_sha"]:
        warnings.append("different baselines: speedups are relative to different code")
    if sa["cpu_mode"] != sb["cpu_mode"]:
        warnings.append("one run is a CPU smoke test and the other is not: timings are not comparable")
    only_a = [r["name"] for r in rows if r["only_in"] == "A"]
    only_b = [r["name"] for r in rows if r["only_in"] == "B"]
    if any(r["dims_differ"] for r in rows):
        warnings.append("some rows ran at different dims in the two runs: " +
                        ", ".join(r["name"] for r in rows if r["dims_differ"]))
    return {"a": sa, "b": sb, "rows": rows, "gates": gates, "warnings": warnings,
            "only_in_a": only_a, "only_in_b": only_b}


def print_comparison(c: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from harness.formats import PLAIN_WIDTH

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=PLAIN_WIDTH, no_color=True)
    console.print(f"A: {escape(c['a']['experiment'])} {escape(c['a']['run_id'])} -> {escape(str(c['a']['verdict']))}")
    console.print(f"B: {escape(c['b']['experiment'])} {escape(c['b']['run_id'])} -> {escape(str(c['b']['verdict']))}")
    for w in c["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
    rows = Table(title="speedup per row (baseline / candidate time, 95% interval)", title_justify="left")
    for col in ("row", "basis", "A", "B", "B / A", "intervals"):
        rows.add_column(col, justify="right" if col == "B / A" else "left")
    for r in c["rows"]:
        basis = r["a"].get("basis") or r["b"].get("basis") or "-"
        if r["a"] and r["b"] and r["a"]["basis"] != r["b"]["basis"]:
            basis = f"{r['a']['basis']} / {r['b']['basis']}"
        rows.add_row(escape(r["name"]), basis, "only in B" if r["only_in"] == "B" else fmt_speedup(r["a"]),
                     "only in A" if r["only_in"] == "A" else fmt_speedup(r["b"]),
                     "n/a" if r["change"] is None else f"{r['change']:.3f}x", r["overlap"])
    console.print(rows)
    for label, names in (("only in A", c["only_in_a"]), ("only in B", c["only_in_b"])):
        if names:
            console.print(f"rows {label}: {escape(', '.join(names))}")
    gates = Table(title="gates", title_justify="left")
    for col in ("gate", "A", "B", "changed"):
        gates.add_column(col)
    for g in c["gates"]:
        gates.add_row(escape(g["name"]), str(g["a"] or "-"), str(g["b"] or "-"),
                      "[bold]yes[/bold]" if g["changed"] else "no")
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
