"""The verdict as text: a terminal table, a markdown comment, a JUnit file.

All three render `harness.verdict.build_verdict(report)`, so they show the same rows, numbers and
gate marks as the HTML report's verdict box. The terminal table is coloured on a terminal and
plain elsewhere (CI logs, Slurm output, pipes); the markdown is meant to be pasted into an issue
or pull request; the JUnit file has one test case per gate (FAIL a failure, INCONCLUSIVE a
skipped case whose message says INCONCLUSIVE) for CI systems that read JUnit.
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from typing import TextIO

from harness.fmt import fmt_num, fmt_speedup, fmt_spread
from harness.verdict import Verdict, VerdictLine, build_verdict, dims_text, short_reason, side_label

STATUS_STYLE = {"PASS": "green", "FAIL": "bold red", "INCONCLUSIVE": "yellow",
                "GO": "bold green", "NO-GO": "bold red"}
PLAIN_WIDTH = 240  # off a terminal rich would wrap at 80 columns; a log line may be long
FORMATS = ("table", "md", "junit")
RAN_ELSEWHERE_NOTE = ("rows marked * ran at the dims shown, not at their declared (GPU) shape: "
                      "a CPU smoke test of the pipeline, not a measurement at that shape")
TIME_HEAD = "median (p10-p90), ms"
WIDE_TABLE = 150  # columns a terminal needs for one line per row; narrower ones get two
WIDE_COLUMNS = (("row", "left"), ("ran at", "left"), ("basis", "left"), (f"baseline {TIME_HEAD}", "right"),
                (f"candidate {TIME_HEAD}", "right"), ("speedup [95% CI]", "right"), ("gates", "left"))
NARROW_COLUMNS = (("row / ran at · basis · baseline -> candidate, median (p10-p90) / gates", "left"),
                  ("speedup [95% CI]", "right"))


def _ran_at(line: VerdictLine) -> str:
    return dims_text(line.dims) + (" *" if line.ran_elsewhere else "")


def _basis(line: VerdictLine) -> str:
    extra = [b for b in line.bases if b != line.basis]
    return line.basis + (f" (+{', '.join(extra)})" if extra else "")


def _headline(v: Verdict) -> str:
    return (f"{v.verdict}: {v.experiment} run {v.run_id}: baseline {side_label(v.baseline)} vs "
            f"candidate {side_label(v.candidate)}")


# --- terminal ------------------------------------------------------------------------------------

def print_verdict(report: dict, file: TextIO | None = None) -> None:
    """The verdict table: one line per (row, mode), rows of deciding gates first, then the gates.
    Colour only on a terminal (rich's detection; NO_COLOR is honoured)."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    file = file or sys.stdout
    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, highlight=False, width=PLAIN_WIDTH, no_color=True)
    v = build_verdict(report)

    def status(s: str) -> Text:
        return Text(s, style=STATUS_STYLE.get(s, ""))

    console.print(Text.assemble(status(v.verdict), " ", escape(_headline(v)[len(v.verdict) + 2:])))
    if v.no_gpu_verdict:
        console.print(f"no GPU verdict: {escape(v.no_gpu_verdict)}")
    if v.terminal:
        console.print(f"terminal: {escape(short_reason(v.terminal))} (the report has the full reason)")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    wide = console.width >= WIDE_TABLE
    heads = WIDE_COLUMNS if wide else NARROW_COLUMNS
    for col, justify in heads:
        # numbers never wrap; names, dims and gate marks do
        table.add_column(col, justify=justify, no_wrap=justify == "right", overflow="fold",
                         min_width=None if justify == "right" else 8)
    for line in v.lines:
        iv = line.speedup or {}
        style = ("green" if (iv.get("lo") or 0) > 1 else "red" if iv.get("hi") is not None and iv["hi"] < 1 else "")
        marks = Text(", ").join(Text.assemble(m.name + " ", status(m.status)) for m in line.marks) or Text("-")
        name = Text(line.row, style="bold" if line.deciding else "")
        base = fmt_spread(line.baseline.median, line.baseline.p10, line.baseline.p90)
        cand = fmt_spread(line.candidate.median, line.candidate.p10, line.candidate.p90)
        speedup = Text(fmt_speedup(iv), style=style)
        if wide:
            table.add_row(name, _ran_at(line), _basis(line), base, cand, speedup, marks)
        else:  # a narrow terminal: the row's details and gate marks on lines under its name
            detail = Text(f"{_ran_at(line)} · {_basis(line)} · {base} -> {cand} ms", style="dim")
            table.add_row(Text.assemble(name, "\n", detail, "\n", marks), speedup)
    if v.lines:
        console.print(table)
    if any(line.ran_elsewhere for line in v.lines):
        console.print(f"* {RAN_ELSEWHERE_NOTE}")
    for g in v.gates:
        basis = f", {g.basis}" if g.basis else ""
        console.print(Text.assemble("  ", status(g.status), f" {g.name} ({g.kind}{basis}): {g.summary}"))


# --- markdown ------------------------------------------------------------------------------------

def _md(text) -> str:
    """A markdown table cell: pipes escaped, markup defused, one line."""
    s = " ".join(str(text).split())
    return s.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def markdown(report: dict) -> str:
    """A verdict to paste into an issue or PR: the rows (medians, p90s, speedups with intervals,
    the gates that judged them), then every gate, deciding first, full reasons folded."""
    v = build_verdict(report)
    out = [f"### {_md(_headline(v))}", ""]
    facts = [f"device: {_md(v.device or 'n/a')}", f"started: {_md(v.started or 'n/a')}"]
    out += [" · ".join(facts), ""]
    if v.no_gpu_verdict:
        out += [f"> **No GPU verdict.** {_md(v.no_gpu_verdict)}.", ""]
    if v.terminal:
        out += [f"> **Terminal:** {_md(v.terminal)}", ""]
    if v.lines:
        out += [f"Speedup = {_md((report.get('units') or {}).get('speedup') or 'baseline / candidate time')}, "
                "with its 95% interval. Rows judged by a deciding gate come first.", ""]
        out.append("| row | ran at | basis | baseline median (ms) | baseline p90 (ms) | candidate median (ms) "
                   "| candidate p90 (ms) | speedup [95% CI] | gates |")
        out.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for line in v.lines:
            marks = ", ".join(f"{m.name} **{m.status}**" if m.deciding else f"{m.name} {m.status}"
                              for m in line.marks) or "-"
            name = f"**{_md(line.row)}**" if line.deciding else _md(line.row)
            out.append(f"| {name} | {_md(_ran_at(line))} | {_md(_basis(line))} | {fmt_num(line.baseline.median)} | "
                       f"{fmt_num(line.baseline.p90)} | {fmt_num(line.candidate.median)} | "
                       f"{fmt_num(line.candidate.p90)} | {fmt_speedup(line.speedup)} | {_md(marks)} |")
        out.append("")
        if any(line.ran_elsewhere for line in v.lines):
            out += [f"\\* {RAN_ELSEWHERE_NOTE}", ""]
    out += ["| gate | kind | basis | status | summary |", "| --- | --- | --- | --- | --- |"]
    for g in v.gates:
        st = f"**{g.status}**" if g.deciding else g.status
        out.append(f"| {_md(g.name)} | {_md(g.kind)} | {_md(g.basis or '-')} | {st} | {_md(g.summary)} |")
    out += ["", "<details><summary>full gate reasons</summary>", ""]
    out += [f"- **{_md(g.name)}** {g.status}: {_md(g.reason)}" for g in v.gates]
    out += ["", "</details>", ""]
    return "\n".join(out)


# --- JUnit ---------------------------------------------------------------------------------------

def junit(report: dict) -> str:
    """JUnit XML: one test suite per report, one test case per gate; a terminal reason (red
    baseline, failed pre-gate, spent attempts) adds a failing `verdict` case."""
    v = build_verdict(report)
    declared = [g["name"] for g in report.get("gates") or []]  # a CI tool lists cases as given
    cases = [(g.name, g.kind, g.status, g.summary, g.reason) for g in sorted(v.gates, key=lambda g: declared.index(g.name))]
    if v.terminal:
        cases.append(("verdict", "terminal", "FAIL", v.terminal, v.terminal))
    failures = sum(1 for c in cases if c[2] == "FAIL")
    skipped = sum(1 for c in cases if c[2] == "INCONCLUSIVE")
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": "0", "skipped": str(skipped)}
    suites = ET.Element("testsuites", {"name": "harness", **counts})
    suite = ET.SubElement(suites, "testsuite", {"name": v.experiment, **counts,
                                                "timestamp": v.started or "", "time": "0"})
    props = ET.SubElement(suite, "properties")
    for key, value in (("verdict", v.verdict), ("run_id", v.run_id), ("cpu_mode", str(v.cpu_mode).lower()),
                       ("baseline_sha", v.baseline.get("sha") or ""), ("candidate_sha", v.candidate.get("sha") or "")):
        ET.SubElement(props, "property", {"name": key, "value": value})
    for name, kind, status, summary, reason in cases:
        case = ET.SubElement(suite, "testcase", {"classname": f"{v.experiment}.{kind}", "name": name, "time": "0"})
        if status == "FAIL":
            ET.SubElement(case, "failure", {"message": summary, "type": "FAIL"}).text = reason
        elif status != "PASS":
            ET.SubElement(case, "skipped", {"message": f"INCONCLUSIVE: {summary}"}).text = reason
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def render(report: dict, fmt: str) -> str:
    """The report in a text format of FORMATS other than the terminal table."""
    if fmt == "md":
        return markdown(report)
    if fmt == "junit":
        return junit(report)
    raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
