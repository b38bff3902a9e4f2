"""harness/formats.py: the terminal table (plain off a terminal, coloured on one), the markdown
verdict and the JUnit file, from a run built the way the worker writes one."""
from __future__ import annotations

import copy
import io
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import analyse, formats

ROOT = Path(__file__).resolve().parent.parent
ANSI = "\x1b["
COLOUR = re.compile(r"\x1b\[(?:[0-9]+;)*(?:3[0-8]|9[0-7])(?:;[0-9]+)*m")  # a foreground colour, not bold


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from test_report import build_run_dir

    loaded, run_dir = build_run_dir(tmp_path_factory.mktemp("formats"))
    return analyse.build_report(loaded, run_dir)


def _table(report: dict) -> str:
    out = io.StringIO()
    formats.print_verdict(report, file=out)
    return out.getvalue()


def test_plain_table_off_a_terminal(demo, monkeypatch):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    text = _table(demo)
    assert ANSI not in text
    lines = text.splitlines()
    assert lines[0].startswith("NO-GO demo-report run 20260101T000000Z-abcd: baseline 0123456789ab vs candidate")
    s1 = next(r for r in demo["rows"] if r["name"] == "S1/fwdbwd")
    row_line = next(line for line in lines if line.startswith("S1/fwdbwd"))
    iv = s1["speedup"]
    # one line per row: dims, basis, medians with p10-p90, the speedup and its interval, gate marks
    for part in ("B1 T256 H2 K32 V32", "eager (+device)", f"{iv['point']:.3f}x [{iv['lo']:.3f}, {iv['hi']:.3f}]",
                 "s1-triple FAIL"):
        assert part in row_line, (part, row_line)
    assert lines.index(row_line) < min(i for i, line in enumerate(lines) if line.startswith(("S1/fwd ", "S2/")))
    assert any(line.strip().startswith("FAIL s1-triple (speedup, eager): S1/fwdbwd") for line in lines)


def test_colour_on_a_terminal(demo, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # what rich reads as "this is a terminal"
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert COLOUR.search(_table(demo))
    monkeypatch.setenv("NO_COLOR", "1")  # honoured: bold stays, colours go
    assert not COLOUR.search(_table(demo))


def test_markdown(demo):
    report = copy.deepcopy(demo)
    gate = next(g for g in report["gates"] if g["name"] == "s1-triple")
    gate["reason"] += " | note with a | pipe and <b>markup</b>"
    md = formats.markdown(report)
    assert md.startswith("### NO-GO: demo-report run 20260101T000000Z-abcd: baseline 0123456789ab vs candidate ")
    header = next(line for line in md.splitlines() if line.startswith("| row |"))
    assert header.count("|") == 10 and "baseline p90 (ms)" in header and "speedup [95% CI]" in header
    s1 = next(r for r in report["rows"] if r["name"] == "S1/fwdbwd")
    first = next(line for line in md.splitlines() if line.startswith("| **S1/fwdbwd**"))
    assert f"| {s1['baseline']['median']:.4g} | {s1['baseline']['p90']:.4g} |" in first
    assert "s1-triple **FAIL**" in first
    assert "| s1-triple | speedup | eager | **FAIL** |" in md
    # cells stay cells: pipes escaped, markup shown as text
    assert "note with a \\| pipe and &lt;b&gt;markup&lt;/b&gt;" in md and "<b>markup" not in md
    assert "> **No GPU verdict.**" in md and "<details><summary>full gate reasons</summary>" in md


def test_junit_one_case_per_gate(demo):
    root = ET.fromstring(formats.junit(demo))
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [g["name"] for g in demo["gates"]]  # declared order
    statuses = {g["name"]: g["status"] for g in demo["gates"]}
    for case in cases:
        st = statuses[case.get("name")]
        assert (case.find("failure") is not None) == (st == "FAIL")
        skipped = case.find("skipped")
        assert (skipped is not None) == (st == "INCONCLUSIVE")
        if skipped is not None:
            assert skipped.get("message").startswith("INCONCLUSIVE: ")
    assert suite.get("failures") == str(sum(s == "FAIL" for s in statuses.values()))
    assert suite.get("skipped") == str(sum(s == "INCONCLUSIVE" for s in statuses.values()))
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["verdict"] == "NO-GO" and props["cpu_mode"] == "true"


def test_junit_terminal_reason_is_a_failing_case():
    report = json.loads((ROOT / "reports" / "pkda-dAqk" / "h200" / "report.json").read_text())
    cases = ET.fromstring(formats.junit(report)).find("testsuite").findall("testcase")
    last = cases[-1]
    assert last.get("name") == "verdict" and last.find("failure").get("message").startswith("Amdahl pre-gate failed")
    assert len(cases) == len(report["gates"]) + 1


def test_narrow_terminal_stacks_each_row(demo, monkeypatch):
    """An 80-column terminal gets the row's name and speedup on one line, its dims, basis and times
    on the next, its gate marks after: nothing squeezed away."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    text = re.sub(r"\x1b\[[0-9;]*m", "", _table(demo))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    s1 = next(r for r in demo["rows"] if r["name"] == "S1/fwdbwd")
    i = next(i for i, line in enumerate(lines) if line.startswith("S1/fwdbwd "))
    assert f"{s1['speedup']['point']:.3f}x [" in lines[i]
    assert lines[i + 1].startswith("B1 T256 H2 K32 V32 · eager (+device) · ")
    assert "s1-triple FAIL" in " ".join(lines[i + 1:i + 5])
