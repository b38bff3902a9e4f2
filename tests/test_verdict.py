"""harness/verdict.py: the verdict lines every format renders, on a run built the way the worker
writes one (test_report.build_run_dir), on the committed H200 reports, and on rows that carry the
measurement fields to come (a `bases` map)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from harness import analyse, verdict

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from test_report import build_run_dir

    loaded, run_dir = build_run_dir(tmp_path_factory.mktemp("verdict"))
    return analyse.build_report(loaded, run_dir)


def _committed(name: str, run: str = "h200") -> dict:
    return json.loads((ROOT / "reports" / name / run / "report.json").read_text())


def test_demo_lines(demo):
    v = verdict.build_verdict(demo)
    assert v.verdict == "NO-GO" and [g.name for g in v.deciding] == ["s1-triple"]
    assert v.gates[0].name == "s1-triple"  # deciding gates first
    first = v.lines[0]
    assert first.row == "S1/fwdbwd" and first.deciding  # the deciding gate's row leads
    row = next(r for r in demo["rows"] if r["name"] == "S1/fwdbwd")
    assert first.baseline.median == row["baseline"]["median"] and first.candidate.p90 == row["candidate"]["p90"]
    assert first.speedup == row["speedup"] and first.basis == "eager" and first.bases == ["eager", "device"]
    assert first.plan == {"pairs": 3, "rounds": 3} and first.stop is None and first.aa is None  # the first engine
    assert first.dims == {"B": 1, "T": 256, "H": 2, "K": 32, "V": 32} and not first.ran_elsewhere
    marks = {m.name: (m.status, m.deciding) for m in first.marks}
    assert marks["s1-triple"] == ("FAIL", True)
    peak = next(g for g in demo["gates"] if g["name"] == "peak-down")
    assert marks["s1-device"] == ("INCONCLUSIVE", False)
    assert marks["peak-down"][0] == peak["numbers"]["rows"]["S1/fwdbwd"]["status"]  # its per-row status
    assert [m.name for m in first.marks][0] == "s1-triple"
    # every measured row has a line; a row no gate names has no marks
    assert sorted(line.row for line in v.lines) == sorted(r["name"] for r in demo["rows"])
    assert next(line for line in v.lines if line.row == "S2/fwd").marks == []


def test_committed_dAqk_reads_as_the_gates_do():
    """The first engine's pkda-dAqk report (blocks, 2026-12-03)."""
    report = _committed("pkda-dAqk", "h200-blocks")
    v = verdict.build_verdict(report)
    assert v.lines[0].row == "B4_T2048_H16_D128/fwdbwd"  # replaced-stages, the first deciding gate with a row
    by_row = {line.row: line for line in v.lines}
    # no-regression FAILs on three rows: only those decide with it, the INCONCLUSIVE ones do not
    assert by_row["B1_T8192_H96_D128/fwdbwd"].deciding and not by_row["B1_T8192_H96_D128/fwd"].deciding
    nr = next(g for g in v.gates if g.name == "no-regression")
    assert nr.summary == ("14 rows: 3 FAIL, 11 INCONCLUSIVE; first: B1_T8192_H96_D128/fwdbwd ratio 1.168 "
                          "[1.137, 1.210] vs limit 1.020")
    assert len(nr.reason) > 1000 and nr.basis == "wall"  # the full reason stays for the folded details
    amdahl = next(g for g in v.gates if g.name == "amdahl-pre-gate")
    assert amdahl.summary == "bound 1.003x (needs 1.1x); share 23.7% (needs 20%)"
    assert verdict.short_reason(report["terminal"]) == "Amdahl pre-gate failed"
    # a varlen row runs packed (B=1, T=tokens): that is its declared shape, not another one
    assert not by_row["varlen_uneven_K128_V64/fwd"].ran_elsewhere
    assert all(len(g.summary) <= verdict.SUMMARY_CHARS + 2 for g in v.gates)


def test_committed_lockstep_dAqk_forward_control_holds_one():
    """The lockstep engine's pkda-dAqk report (2026-12-04): the forward rows run the same code on both
    sides, and every one of their intervals holds 1.0 (the first engine's excluded it at one row); the
    fwd+bwd rows decide, the forward ones do not; evidence the run did not reach is missing, not
    failed."""
    report = _committed("pkda-dAqk")
    assert report["measurement"]["engine"] == "lockstep"
    fwd = [r for r in report["rows"] if r["mode"] == "fwd"]
    assert len(fwd) == 7
    for r in fwd:
        sp = r["bases"][r["primary_basis"]]["speedup"]
        assert sp["lo"] <= 1.0 <= sp["hi"], (r["name"], sp)
    v = verdict.build_verdict(report)
    assert v.verdict == "NO-GO" and v.lines[0].row == "B4_T2048_H16_D128/fwdbwd"
    by_row = {line.row: line for line in v.lines}
    assert not any(by_row[r["name"]].deciding for r in fwd)
    gates = {g.name: g for g in v.gates}
    assert gates["no-regression"].summary.startswith("14 rows: 5 FAIL, 7 INCONCLUSIVE, 2 PASS")
    assert gates["ncu-attribution"].status == "INCONCLUSIVE" and "missing evidence" in gates["ncu-attribution"].summary


def test_committed_whole_dAqk_run_has_every_gate_and_the_forward_control_holds_one():
    """pkda-dAqk run whole on the lockstep engine (an H100, 2026-12-05/06): the forward rows hold 1.0
    on every row; every gate was measured (training rows and ncu included), none is missing evidence;
    NO-GO."""
    report = _committed("pkda-dAqk", "h100-1205")
    assert report["provenance"]["device"]["name"].startswith("NVIDIA H100")
    for r in (r for r in report["rows"] if r["mode"] == "fwd"):
        sp = r["bases"][r["primary_basis"]]["speedup"]
        assert sp["lo"] <= 1.0 <= sp["hi"], (r["name"], sp)
    v = verdict.build_verdict(report)
    assert v.verdict == "NO-GO"
    assert not [g.name for g in v.gates if "missing evidence" in g.summary]
    gates = {g.name: g.status for g in v.gates}
    assert gates["ncu-attribution"] == gates["two-layer-training"] == gates["dAqk-and-beta-partials-removed"] == "FAIL"


def test_committed_pkda_aa_every_row_is_a_graph_and_holds_one():
    """The lockstep A/A of our op (2026-12-04, sides at 9671aa8: no host sync, dense or varlen):
    every row, varlen too, was timed as a graph; every graph speedup interval holds 1.0 and the 2%
    non-regression gate PASSes on all 10 rows; the verdict is NO-GO from the terminal pre-gate alone;
    the report counts the A/A control intervals that missed 1.0 (3 of 20, on record in
    docs/perf/pkda.md)."""
    report = _committed("pkda-aa")
    assert report["measurement"]["engine"] == "lockstep"
    assert len(report["rows"]) == 10
    for r in report["rows"]:
        assert r["primary_basis"] == "graph", (r["name"], r.get("graph_reason"))
        sp = r["bases"]["graph"]["speedup"]
        assert sp["lo"] <= 1.0 <= sp["hi"], (r["name"], sp)
    aa = report["measurement"]["aa_control"]
    assert (aa["containing_one"], aa["intervals"]) == (17, 20)
    v = verdict.build_verdict(report)
    gates = {g.name: g for g in v.gates}
    assert gates["no-regression"].status == "PASS" and gates["no-regression"].summary.startswith("10 rows: 10 PASS")
    assert v.verdict == "NO-GO" and verdict.short_reason(report["terminal"]) == "Amdahl pre-gate failed"


def test_package_side_is_named_by_its_version():
    v = verdict.build_verdict(_committed("pkda-vs-fla"))
    assert verdict.side_label(v.baseline) == "fla-core==0.6.0"
    assert verdict.side_label(v.candidate) == "fb955eaf4856 (HEAD)"
    assert verdict.side_label({"sha": "ab" * 20, "ref": "ab" * 20, "branch": "pkda/x"}) == "abababababab (pkda/x)"


def test_cpu_smoke_rows_show_the_dims_they_ran_at(tmp_path):
    """A CPU run measures its rows under their GPU names at the cpu profile's dims: every line says
    which dims it ran at and that they are not the declared shape's."""
    from test_report import build_run_dir

    loaded, run_dir = build_run_dir(tmp_path)
    run = json.loads((run_dir / "run.json").read_text())
    run["settings"] = {"shapes": [{"name": "S1", "B": 2, "T": 64, "H": 1, "K": 32, "V": 32},
                                  {"name": "S2", "B": 2, "T": 64, "H": 1, "K": 32, "V": 32}]}
    (run_dir / "run.json").write_text(json.dumps(run))
    v = verdict.build_verdict(analyse.build_report(loaded, run_dir))
    line = next(line for line in v.lines if line.row == "S1/fwdbwd")
    assert line.ran_elsewhere and line.dims == {"B": 2, "T": 64, "H": 1, "K": 32, "V": 32}
    assert line.declared_dims == {"B": 1, "T": 256, "H": 2, "K": 32, "V": 32}
    assert verdict.dims_text(line.dims) == "B2 T64 H1 K32 V32"


def test_line_reads_the_basis_its_gates_read(demo):
    """A row measured on several bases (graph replay, eager, device time), with what ended each
    basis's rounds and its A/A control: a line shows the basis its gates read, with that basis's
    numbers; a row no gate names a basis for shows its primary basis."""
    report = copy.deepcopy(demo)
    row = next(r for r in report["rows"] if r["name"] == "S1/fwdbwd")
    graph = copy.deepcopy(row["bases"]["eager"])
    graph.update(basis="graph", pairs=2, rounds=30,
                 candidate={**graph["candidate"], "median": 0.5 * graph["baseline"]["median"]},
                 speedup={**graph["speedup"], "point": 2.0, "lo": 1.99, "hi": 2.01},
                 aa_control={**graph["speedup"], "point": 1.0, "lo": 0.998, "hi": 1.002},
                 stop={"basis": "graph", "reason": "resolved", "pairs": 2, "rounds": 30})
    row["bases"]["graph"], row["primary_basis"] = graph, "graph"
    line = verdict.verdict_lines(report)[0]
    assert line.row == "S1/fwdbwd" and line.basis == "eager"  # s1-triple reads eager
    assert line.speedup == row["bases"]["eager"]["speedup"] and line.bases == ["eager", "device", "graph"]
    for g in report["gates"]:  # no gate names a basis: the row's primary
        g["numbers"].pop("basis", None)
        for entry in (g["numbers"].get("rows") or {}).values():
            entry.pop("basis", None)
    line = verdict.verdict_lines(report)[0]
    assert line.basis == "graph" and line.candidate.median == graph["candidate"]["median"]
    assert line.speedup["point"] == 2.0 and line.stop == "resolved" and line.aa["hi"] == 1.002
    assert line.plan == {"pairs": 2, "rounds": 30}


def test_schema_1_rows_read_as_wall_clock():
    """A report from before per-basis rows (the committed H200 ones): the wall-clock fields, and the
    summed device time as a second basis."""
    report = _committed("pkda-keep-solve")
    line = next(line for line in verdict.verdict_lines(report) if line.row == "B4_T2048_H16_D128/fwdbwd")
    row = next(r for r in report["rows"] if r["name"] == line.row)
    assert line.basis == "wall" and line.bases == ["wall", "device"] and line.speedup == row["speedup"]
    assert line.plan == {"blocks": row["blocks"]} and line.stop is None and line.aa is None
