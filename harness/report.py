"""Render report.json into one self-contained HTML page, and the index of every report.

The page is rendered from the report dict alone (never from the run directory), with jinja2
autoescaping on: every string that came from the experiment file, git (branch names, commit
subjects) or the kernels (names) is escaped. Plots are inline SVG (harness/plots.py), styles are
inline, and the only script sorts tables; nothing is fetched, so the file opens from disk.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jinja2

from harness import plots

TEMPLATES = Path(__file__).resolve().parent / "templates"
VERDICT_CLASS = {"GO": "go", "NO-GO": "nogo", "INCONCLUSIVE": "inconclusive"}
# where each gate kind's evidence is shown in the page
GATE_SECTION = {"speedup": "speedup", "geomean": "geomeans", "non_regression": "speedup", "peak_alloc": "peak",
                "correctness": "correctness", "frozen_paths": "frozen", "amdahl": "profile", "ncu": "ncu",
                "training": "training"}
UNIT_SUFFIXES = (("_ms", "ms"), ("_bytes", "B"), ("_mhz", "MHz"), ("_c", "°C"), ("_w", "W"), ("_s", "s"))


# --- number formatting (every number leaves with its unit) -------------------------------------

def _num(v, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    a = abs(v)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}" if a < 1000 else f"{v:,.1f}"


def fmt_ms(v) -> str:
    return "n/a" if v is None else f"{_num(v)} ms"


def fmt_bytes(v, signed: bool = False) -> str:
    if v is None:
        return "n/a"
    v = int(v)
    sign = "+" if signed and v > 0 else ("-" if v < 0 else "")
    a = abs(v)
    human = ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if a >= size:
            human = f" ({sign}{a / size:.2f} {unit})"
            break
    return f"{sign}{a:,} B{human}"


def fmt_x(v) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


def fmt_ci(d: dict | None) -> str:
    if not d or d.get("lo") is None or d.get("hi") is None:
        return "no interval"
    return f"[{d['lo']:.3f}x, {d['hi']:.3f}x]"


def fmt_p(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2g}" if v >= 1e-4 else "< 1e-4"


def fmt_pct(v, signed: bool = True) -> str:
    if v is None:
        return "n/a"
    return f"{v * 100:+.2f}%" if signed else f"{v * 100:.1f}%"


def fmt_field(v, key: str = "") -> str:
    """A value of a phase record or gate numbers, with the unit its key's suffix names."""
    if isinstance(v, str) or v is None:
        return "n/a" if v is None else v
    key = str(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if key.endswith("_bytes") or key in ("bytes", "base_peak", "cand_peak", "reduction", "min_reduction_bytes"):
            return fmt_bytes(v, signed=key == "reduction")
        for suffix, unit in UNIT_SUFFIXES:
            if key.endswith(suffix):
                return f"{_num(v)} {unit}"
        if key.endswith(("share", "fraction")):
            return fmt_pct(v, signed=False)
    return _num(v) if isinstance(v, (int, float)) else str(v)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", str(text)).strip("-") or "x"


def _is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _records(v) -> bool:
    """A list of flat-ish dicts: shown as one table with the union of their keys."""
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _columns(v: list[dict]) -> list[str]:
    cols: list[str] = []
    for rec in v:
        cols += [k for k in rec if k not in cols]
    return cols


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.ChainableUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ms=fmt_ms, bytes=fmt_bytes, x=fmt_x, ci=fmt_ci, p=fmt_p, pct=fmt_pct, field=fmt_field,
                       num=_num, slug=slug, columns=_columns, short=lambda s, n=12: (s or "")[:n] or "n/a")
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


def render_html(report: dict) -> str:
    """The report page for one run, from its report.json dict alone."""
    return _env().get_template("report.html.j2").render(
        r=report, figures=build_figures(report), headline=headline(report),
        ncu=ncu_view((report.get("phases") or {}).get("ncu")),
        failed_blocks=[b for b in report["blocks"] if b["status"] != "ok"],
        row_failures=[f for f in report["failures"] if f.get("shape")],
    )


def _load_reports(reports_dir: Path) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(reports_dir.glob("*/*/report.json")):
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError):
            continue  # a half-copied report is skipped, not fatal for the index
    return out


def render_index(reports_dir: Path) -> Path:
    """Write reports/index.html: every run of every experiment, newest first, and per experiment
    the attempt history from its newest report."""
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    runs, attempts = [], {}
    for path, rep in _load_reports(reports_dir):
        prov = rep.get("provenance") or {}
        run = rep.get("run") or {}
        when = run.get("started") or run.get("finished") or rep.get("generated") or ""
        runs.append({
            "experiment": rep["experiment"]["name"], "run_id": run.get("id") or path.parent.name,
            "href": f"{path.parent.parent.name}/{path.parent.name}/index.html", "date": when,
            "verdict": rep.get("verdict"), "cpu_mode": run.get("cpu_mode"), "headline": headline(rep),
            "baseline": prov.get("baseline") or {}, "candidate": prov.get("candidate") or {},
            "deciding": [g["name"] for g in rep.get("deciding_gates") or []],
        })
        history = (rep.get("phases") or {}).get("attempts") or []
        name = rep["experiment"]["name"]
        if history and (name not in attempts or when >= attempts[name][0]):
            attempts[name] = (when, history)
    runs.sort(key=lambda x: (x["date"], x["run_id"]), reverse=True)
    html = _env().get_template("index.html.j2").render(
        runs=runs, attempts={k: v[1] for k, v in sorted(attempts.items())})
    out = reports_dir / "index.html"
    out.write_text(html)
    return out


def render_compare_html(comparison: dict) -> str:
    """The page for `harness compare`: per-row speedup and gate changes between two reports."""
    return _env().get_template("compare.html.j2").render(c=comparison)
