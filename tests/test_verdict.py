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


def _committed(name: str) -> dict:
    return json.loads((ROOT / "reports" / name / "h200" / "report.json").read_text())


def test_demo_lines(demo):
    v = verdict.build_verdict(demo)
    assert v.verdict == "NO-GO" and [g.name for g in v.deciding] == ["s1-triple"]
    assert v.gates[0].name == "s1-triple"  # deciding gates first
    first = v.lines[0]
    assert first.row == "S1/fwdbwd" and first.deciding  # the deciding gate's row leads
    row = next(r for r in demo["rows"] if r["name"] == "S1/fwdbwd")
    assert first.baseline.median == row["baseline"]["median"] and first.candidate.p90 == row["candidate"]["p90"]
    assert first.speedup == row["speedup"] and first.basis == "wall" and first.bases == ["wall", "device"]
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
    report = _committed("pkda-dAqk")
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


def test_rows_with_per_basis_timings(demo):
    """Rows that carry a `bases` map (graph replay, eager events, device time), what ended them and
    an A/A control: lines read the basis the gates name, with that basis's numbers."""
    report = copy.deepcopy(demo)
    row = next(r for r in report["rows"] if r["name"] == "S1/fwdbwd")
    summary = {"n": 90, "median": 1.0, "mean": 1.0, "std": 0.01, "min": 0.98, "p10": 0.99, "p90": 1.01,
               "quantile_method": "linear"}
    row["bases"] = {
        "graph": {"baseline": summary, "candidate": {**summary, "median": 0.5}, "speedup": {"point": 2.0, "lo": 1.98, "hi": 2.02}},
        "eager": {"baseline": summary, "candidate": {**summary, "median": 0.8}, "speedup": {"point": 1.25, "lo": 1.2, "hi": 1.3}},
    }
    row["basis"], row["stop"], row["aa"] = "graph", {"reason": "resolved"}, {"point": 1.0, "lo": 0.998, "hi": 1.002}
    row["pairs"], row["rounds"] = 2, 30
    gate = next(g for g in report["gates"] if g["name"] == "s1-triple")
    gate["numbers"]["basis"] = "eager"
    line = verdict.verdict_lines(report)[0]
    assert line.row == "S1/fwdbwd" and line.basis == "eager" and line.candidate.median == 0.8
    assert line.speedup["point"] == 1.25 and line.bases == ["graph", "eager"]
    assert line.stop == "resolved" and line.aa["hi"] == 1.002 and line.plan == {"pairs": 2, "rounds": 30}
    gate["numbers"].pop("basis")
    for g in report["gates"]:
        g["numbers"].pop("basis", None)
    assert verdict.verdict_lines(report)[0].basis == "graph"  # no gate names one: the row's own
