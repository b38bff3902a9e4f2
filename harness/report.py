"""Render report.json into one self-contained HTML page, and the index of every report.

The page is rendered from the report dict alone (never from the run directory), with jinja2
autoescaping on: every string that came from the experiment file, git (branch names, commit
subjects) or the kernels (names) is escaped. Plots are inline SVG (harness/plots.py), styles are
inline, and the only script sorts tables; nothing is fetched, so the file opens from disk.
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import jinja2

from harness import plots, verdict
from harness.fmt import fmt_bytes, fmt_ci, fmt_field, fmt_ms, fmt_p, fmt_num, fmt_pct, fmt_speedup, fmt_spread, fmt_x

TEMPLATES = Path(__file__).resolve().parent / "templates"
VERDICT_CLASS = {"GO": "go", "NO-GO": "nogo", "INCONCLUSIVE": "inconclusive"}
# where each gate kind's evidence is shown in the page
GATE_SECTION = {"speedup": "speedup", "geomean": "geomeans", "non_regression": "speedup", "peak_alloc": "peak",
                "correctness": "correctness", "frozen_paths": "frozen", "amdahl": "profile", "ncu": "ncu",
                "training": "training", "pytest": "pytest"}


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", str(text)).strip("-") or "x"


def _is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


RECORD_COLUMNS = 6  # a list of records wider than this reads better one record at a time


def _records(v) -> bool:
    """A list of flat dicts (scalar values, few keys): shown as one table with the union of their
    keys. Nested or wide records are shown one by one, so no table outgrows the page."""
    return (isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)
            and len(_columns(v)) <= RECORD_COLUMNS
            and all(_is_scalar(y) or isinstance(y, list) and all(map(_is_scalar, y)) for x in v for y in x.values()))


def _columns(v: list[dict]) -> list[str]:
    cols: list[str] = []
    for rec in v:
        cols += [k for k in rec if k not in cols]
    return cols


def _defined(fmt):
    """A filter that reads a missing field (jinja's Undefined) as None, i.e. "n/a"."""
    def f(v, *args, **kwargs):
        return fmt(None if isinstance(v, jinja2.Undefined) else v, *args, **kwargs)
    return f


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.ChainableUndefined, trim_blocks=True, lstrip_blocks=True)
    formats = dict(ms=fmt_ms, bytes=fmt_bytes, x=fmt_x, ci=fmt_ci, p=fmt_p, pct=fmt_pct, field=fmt_field,
                   num=fmt_num, speedup=fmt_speedup, spread=fmt_spread)
    env.filters.update({k: _defined(f) for k, f in formats.items()})
    env.filters.update(slug=slug, columns=_columns, short=lambda s, n=12: (s or "")[:n] or "n/a",
                       dims=verdict.dims_text, side_label=verdict.side_label, ran_at=lambda row: verdict.dims_text(verdict.row_dims(row)))
    env.tests.update(scalar=_is_scalar, records=_records)
    env.globals.update(verdict_class=VERDICT_CLASS, gate_section=GATE_SECTION)
    return env


# --- figures from report.json ------------------------------------------------------------------

def _thresholds(report: dict) -> list[dict]:
    out = []
    for g in report["experiment"]["gates"]:
        if g["kind"] in ("speedup", "geomean"):
            out.append({"label": g["name"], "value": g["threshold"]})
        elif g["kind"] == "non_regression":
            out.append({"label": g["name"], "value": 1 / (1 + g["margin"])})
    return out


def _profile_shares(record: dict | None) -> dict[str, dict[str, float]]:
    """Stage shares in a profile record: any mapping stage -> fraction under a key with 'share'."""
    found: dict[str, dict[str, float]] = {}

    def walk(node, label: str):
        if isinstance(node, dict):
            for k, v in node.items():
                if "share" in str(k) and isinstance(v, dict) and v and all(
                        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()):
                    found[f"{label} {k}".strip()] = {s: float(x) for s, x in v.items()}
                else:
                    walk(v, f"{label} {k}".strip() if not isinstance(v, (int, float, str)) else label)
        elif isinstance(node, list):
            for i, x in enumerate(node):
                walk(x, label if not isinstance(x, dict) else str(x.get("row") or x.get("name") or label or i))

    walk(record or {}, "")
    return found


def _row_stage_shares(row: dict) -> dict[str, dict[str, float]]:
    """Per side: each stage's median as a share of the call's median time (rest: 'other')."""
    out = {}
    for side in ("baseline", "candidate"):
        total = (row.get(side) or {}).get("median")
        if not total or not row.get("stages"):
            continue
        shares = {s["stage"]: (s[side].get("median") or 0.0) / total for s in row["stages"]}
        rest = 1.0 - sum(shares.values())
        if rest > 0:
            shares["other"] = rest
        out[side] = shares
    return out


NCU_KERNEL_KEYS = ("launches", "duration_ns", "dram_read_bytes", "dram_write_bytes", "l2_bytes", "tensor_inst",
                   "sm_sol_pct", "achieved_occupancy_pct", "registers_per_thread", "spill_local_requests",
                   "warps_eligible_per_cycle")


def _stall_shares(node: dict) -> dict[str, float]:
    """A stage's (or kernel's) stall reasons as shares: the sampled stalls (SourceCounters and
    PmSampling) when there are any, else the warp-state ratios of the full pass; as in
    ncu.top_stalls, an issuing warp ("selected") is no stall."""
    from harness.ncu import NOT_A_STALL

    for key in ("stall_samples", "stall_ratio"):
        counts = {r: float(v) for r, v in (node.get(key) or {}).items()
                  if isinstance(v, (int, float)) and v > 0 and r not in NOT_A_STALL}
        total = sum(counts.values())
        if total > 0:
            return {r: v / total for r, v in counts.items()}
    return {}


def ncu_view(record: dict | None) -> dict | None:
    """The Nsight Compute section's tables from the run's ncu record (report.json phases.ncu):
    per row and stage, every table metric side by side with its delta and ratio; per row, every
    profiled kernel of both sides; the commands that made the reports."""
    from harness import ncu

    if not record:
        return None
    labels = {k: (record.get("metric_table") or {}).get(k, {}).get("label", k) for k in ncu.TABLE_KEYS}
    sides = record.get("sides") or {}
    rows = []
    for row in record.get("rows") or []:
        side_rows = {side: (sides.get(side) or {}).get("rows", {}).get(row) or {} for side in ("baseline", "candidate")}
        stages = []
        for stage, d in ((record.get("deltas") or {}).get(row) or {}).items():
            metrics = []
            for key in ncu.TABLE_KEYS:
                m = d.get(key) or {}
                metrics.append({"key": key, "label": labels[key], "baseline": ncu.fmt(key, m.get("baseline")),
                                "candidate": ncu.fmt(key, m.get("candidate")),
                                "delta": "missing" if m.get("delta") is None else ncu.fmt(key, m["delta"]),
                                "ratio": m.get("ratio")})
            per_side = {side: (side_rows[side].get("stages") or {}).get(stage) or {} for side in side_rows}
            stages.append({"stage": stage, "metrics": metrics,
                           "kernels": {side: st.get("kernels") or [] for side, st in per_side.items()},
                           "top_stalls": {side: [t["reason"] for t in (st.get("top_stalls") or [])[:3]]
                                          for side, st in per_side.items()},
                           "stalls": {side: _stall_shares(st) for side, st in per_side.items()}})
        kernels = []
        for side, rec in side_rows.items():
            for name, k in (rec.get("kernels") or {}).items():
                m = k.get("metrics") or {}
                kernels.append({"side": side, "name": name,
                                "cells": [{"key": key, "text": ncu.fmt(key, k.get("launches") if key == "launches"
                                                                         else m.get(key)),
                                            "sort": k.get("launches") if key == "launches" else m.get(key)}
                                           for key in NCU_KERNEL_KEYS],
                                "stalls": ", ".join(t["reason"] for t in (k.get("top_stalls") or [])[:3]) or "n/a"})
        status = {side: {"status": rec.get("status"), "error": rec.get("error")} for side, rec in side_rows.items()}
        rows.append({"row": row, "stages": stages, "kernels": kernels, "status": status})
    return {"rows": rows, "kernel_columns": [labels.get(k, k) for k in NCU_KERNEL_KEYS],
            "commands": record.get("commands") or [], "version": (record.get("ncu") or {}).get("version"),
            "mode": record.get("mode"), "nvtx_range": record.get("nvtx_range"), "error": record.get("error"),
            "cache_control": record.get("cache_control"), "clock_control": record.get("clock_control")}


def build_figures(report: dict) -> dict:
    items = [{"label": r["name"], **r["speedup"]} for r in report["rows"]]
    items += [{"label": f"geomean: {g['name']}", "point": g["point"], "lo": g["lo"], "hi": g["hi"], "geomean": True}
              for g in report["geomeans"]]
    low = {b["index"]: b["low_clock"] for b in report["blocks"]}
    series, dists, stages = {}, {}, {}
    for r in report["rows"]:
        pts = [{"block": b["index"], "side": b["side"], "median_ms": m["median_ms"], "low_clock": low.get(b["index"])}
               for b in report["blocks"] for m in b["row_medians"] if m["row"] == r["name"]]
        series[r["name"]] = plots.block_series(pts, f"{r['name']}: block medians", f"series-{slug(r['name'])}")
        dists[r["name"]] = plots.distributions(r["samples_ms"], f"{r['name']}: every sample",
                                               f"dist-{slug(r['name'])}")
        shares = _row_stage_shares(r)
        if shares:
            stages[r["name"]] = plots.stage_shares(shares, f"{r['name']}: stage share of the call's median",
                                                   f"stages-{slug(r['name'])}")
    profile = _profile_shares((report.get("phases") or {}).get("profile"))
    view = ncu_view((report.get("phases") or {}).get("ncu"))
    stalls = {f"{r['row']}/{st['stage']}": plots.stall_bars(st["stalls"], f"{r['row']}, stage {st['stage']}: warp stalls",
                                                          f"ncu-stalls-{slug(r['row'])}-{slug(st['stage'])}")
              for r in (view or {}).get("rows", []) for st in r["stages"]}
    return {
        "ncu_stalls": stalls,
        "forest": plots.speedup_forest(items, _thresholds(report)),
        "series": series, "dists": dists, "stages": stages,
        "profile": plots.stage_shares(profile, "baseline profile: stage shares", "profile-shares") if profile else None,
    }


# --- pages -------------------------------------------------------------------------------------

def headline(report: dict) -> dict | None:
    """The one speedup an index line shows: the first declared geomean, else the first speedup
    gate's row, else the all-rows geomean of the last mode."""
    geos = report.get("geomeans") or []
    for g in geos:
        if g.get("declared") and g.get("point") is not None:
            return {"label": g["name"], "point": g["point"], "lo": g["lo"], "hi": g["hi"]}
    for g in report["experiment"]["gates"]:
        if g["kind"] == "speedup" and not g.get("stage"):
            for r in report.get("rows") or []:
                if r["shape"] == g["row"] and r["mode"] == g["mode"] and r["speedup"].get("point") is not None:
                    return {"label": r["name"], **{k: r["speedup"][k] for k in ("point", "lo", "hi")}}
    for g in reversed(geos):
        if g.get("point") is not None:
            return {"label": g["name"], "point": g["point"], "lo": g["lo"], "hi": g["hi"]}
    return None


def attempt_history(entries: list[dict], reports: dict[str, dict]) -> list[dict]:
    """The attempt log as the page shows it. An attempt whose run has a report here (`reports`,
    by run id) shows that report's verdict and its gates that did not pass, so the history agrees
    with the gate table a reader opens; any other attempt shows what the log recorded then."""
    out, seen = [], []
    for e in entries:
        if e.get("type") == "reopen":
            seen = []
            out.append({"kind": "reopen", "t": e.get("t"), "run_id": e.get("run_id"), "note": e.get("reason") or ""})
            continue
        if e.get("type") != "attempt":
            continue
        sha = e.get("sha") or ""
        if sha not in seen:
            seen.append(sha)
        rep = reports.get(e.get("run_id") or "")
        if rep is not None:
            verdict = rep.get("verdict")
            gates = [{"name": g["name"], "status": g["status"]} for g in rep.get("gates") or [] if g["status"] != "PASS"]
            source = "report"
        else:
            verdict = e.get("verdict")
            gates = [{"name": n, "status": "FAIL"} for n in e.get("failing_gates") or []]
            source = "log"
        out.append({"kind": "attempt", "n": seen.index(sha) + 1, "t": e.get("t"), "sha": sha, "run_id": e.get("run_id"),
                    "verdict": verdict, "capped": bool(e.get("capped")), "measured": e.get("measured_verdict"),
                    "gates": gates, "note": e.get("note") or "", "source": source})
    return out


def render_html(report: dict) -> str:
    """The report page for one run, from its report.json dict alone."""
    rows = {r["name"]: r for r in report.get("rows") or []}
    return _env().get_template("report.html.j2").render(
        r=report, v=verdict.build_verdict(report), figures=build_figures(report), headline=headline(report),
        ncu=ncu_view((report.get("phases") or {}).get("ncu")),
        failed_blocks=[b for b in report["blocks"] if b["status"] != "ok"],
        row_failures=[f for f in report["failures"] if f.get("shape")],
        prov=report.get("provenance") or {}, row_of_gate=lambda name: next(
            (row for row in rows if verdict.gate_row_matches(name, row)), None),
        attempts=attempt_history((report.get("phases") or {}).get("attempts") or [],
                                 {str((report.get("run") or {}).get("id")): report}),
        short_reason=verdict.short_reason,
    )


def _load_reports(reports_dir: Path) -> list[tuple[Path, dict]]:
    """Every report.json under reports_dir that the index can list. A half-copied or damaged one is
    skipped with a warning: it must never take the index (and the end of every run) down with it."""
    out = []
    for path in sorted(reports_dir.glob("*/*/report.json")):
        try:
            rep = json.loads(path.read_bytes())
            if not isinstance(rep.get("experiment", {}).get("name"), str) or not isinstance(rep.get("run") or {}, dict):
                raise ValueError("no experiment name or run section")
        except (OSError, ValueError, AttributeError) as e:
            logging.getLogger(__name__).warning("reports index: skipped %s (damaged: %s)", path, e)
            continue
        out.append((path, rep))
    return out


def render_index(reports_dir: Path) -> Path:
    """Write reports/index.html: every run of every experiment, newest first, and per experiment
    the attempt history from its newest report."""
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    runs, attempts = [], {}
    loaded = _load_reports(reports_dir)
    by_run: dict[str, dict[str, dict]] = {}  # experiment -> run id -> its published report
    for path, rep in loaded:
        by_run.setdefault(rep["experiment"]["name"], {})[str((rep.get("run") or {}).get("id") or path.parent.name)] = rep
    for path, rep in loaded:
        try:  # a report whose sections are damaged is skipped like an unreadable one
            prov = rep.get("provenance") or {}
            run = rep.get("run") or {}
            when = str(run.get("started") or run.get("finished") or rep.get("generated") or "")
            entry = {
                "experiment": rep["experiment"]["name"], "run_id": str(run.get("id") or path.parent.name),
                "href": f"{path.parent.parent.name}/{path.parent.name}/index.html", "date": when,
                "verdict": rep.get("verdict"), "cpu_mode": run.get("cpu_mode"), "headline": headline(rep),
                "baseline": prov.get("baseline") or {}, "candidate": prov.get("candidate") or {},
                "deciding": [g["name"] for g in rep.get("deciding_gates") or []],
            }
            name = rep["experiment"]["name"]
            history = (rep.get("phases") or {}).get("attempts") or []
            if history and (name not in attempts or when >= attempts[name][0]):
                history = (when, attempt_history(history, by_run.get(name, {})))
            else:
                history = None
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            logging.getLogger(__name__).warning("reports index: skipped %s (damaged: %s: %s)", path, type(e).__name__, e)
            continue
        runs.append(entry)
        if history is not None:
            attempts[name] = history
    runs.sort(key=lambda x: (x["date"], x["run_id"]), reverse=True)
    html = _env().get_template("index.html.j2").render(
        runs=runs, attempts={k: v[1] for k, v in sorted(attempts.items())})
    out = reports_dir / "index.html"
    out.write_text(html)
    return out


def render_compare_html(comparison: dict) -> str:
    """The page for `harness compare`: per-row speedup and gate changes between two reports."""
    return _env().get_template("compare.html.j2").render(c=comparison)
