"""Nsight Compute evidence: profile both sides, read the reports, sum stages, decide the ncu gate.

Phase `ncu` of ../shared/design/harness.md. For each side and each row of the experiment's
`ncu:` section, two ncu passes profile ONE measured iteration of the op (harness/ncu_target.py,
NVTX range `harness.measure`), filtered to the kernels of the declared stages:

    full:   --set full --section PmSampling --section PmSampling_WarpStates   (+ tensor instruction counts)
    source: --section SourceCounters                                            (spills, stall sampling)

always with `--clock-control none` (clocks are never changed; they are recorded instead) and
`--cache-control all` (caches flushed before each replayed kernel: DRAM bytes are cold-cache bytes).
Reports go to <run_dir>/ncu/*.ncu-rep (profile/ is outside git). They are read with the
`ncu_report` module, or `ncu --import X --csv --page raw` when the module is missing.

Per kernel and per stage: the metrics of METRICS (one table: logical name -> ncu metric names tried
in order, canonical unit, how launches and kernels combine), launches, and warp-stall reasons. A
metric the report lacks is None, never 0. <run_dir>/ncu.json holds the commands, the ncu version,
per side/row kernels and stages, baseline->candidate deltas, and `gate` {status, reason, numbers}:
the `ncu` gates' expectations evaluated on stage sums. A missing ncu, a failed profile, a stage that
matched no kernel or a missing metric makes an expectation INCONCLUSIVE (status None), never PASS.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

from harness import children
from harness.kernel_profile import stage_matches

SCHEMA_VERSION = 1
MEASURE_RANGE = "harness.measure"  # keep equal to harness.ncu_target.MEASURE_RANGE (no torch import here)
DEFAULT_TIMEOUT_S = 1800  # per ncu subprocess; HARNESS_NCU_TIMEOUT overrides
PASSES = ("full", "source")

# --- the metric table --------------------------------------------------------------------------
# kind: how a value's unit is normalised ("time" -> ns, "bytes" -> bytes, "rate" -> bytes/s,
#       "plain" -> as reported).
# agg:  how launches of one kernel, and kernels of one stage, combine:
#       "sum" (additive counts), "wavg" (duration-weighted mean: percentages, per-cycle rates),
#       "max" (per-launch resources: registers), "min" (occupancy limits).
# names: ncu metric names tried in order; the first the report has is used. A tuple entry
#       (name, factor) multiplies the value (sectors -> bytes). `parts` sums several metrics
#       (each tried as its own candidate list); the result is None when none of them is present.


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    kind: str
    agg: str
    names: tuple = ()
    parts: tuple = ()  # tuple of name-candidate tuples, summed
    passes: tuple = ("full", "source")  # which pass(es) may supply it, in order of preference


METRICS: tuple[Metric, ...] = (
    Metric("duration_ns", "duration", "ns", "time", "sum", ("gpu__time_duration.sum",)),
    Metric("dram_read_bytes", "DRAM read", "B", "bytes", "sum", ("dram__bytes_read.sum",)),
    Metric("dram_write_bytes", "DRAM write", "B", "bytes", "sum", ("dram__bytes_write.sum",)),
    Metric("dram_read_bytes_per_s", "DRAM read throughput", "B/s", "rate", "wavg", ("dram__bytes_read.sum.per_second",)),
    Metric("dram_write_bytes_per_s", "DRAM write throughput", "B/s", "rate", "wavg", ("dram__bytes_write.sum.per_second",)),
    Metric("dram_throughput_pct", "DRAM throughput % of peak", "%", "plain", "wavg",
           ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "dram__throughput.avg.pct_of_peak_sustained_elapsed")),
    Metric("l2_bytes", "L2 bytes", "B", "bytes", "sum",
           ("lts__t_bytes.sum", ("lts__t_sectors.sum", 32.0))),
    Metric("tensor_inst", "tensor-pipe instructions", "inst", "plain", "sum",
           parts=(("sm__inst_executed_pipe_tensor_op_hmma.sum", "smsp__inst_executed_pipe_tensor_op_hmma.sum"),
                  ("sm__inst_executed_pipe_tensor_op_gmma.sum", "smsp__inst_executed_pipe_tensor_op_gmma.sum"))),
    Metric("sm_sol_pct", "SM throughput % of peak", "%", "plain", "wavg",
           ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)),
    Metric("memory_sol_pct", "memory throughput % of peak", "%", "plain", "wavg",
           ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",)),
    Metric("tensor_sol_pct", "tensor pipe % of peak", "%", "plain", "wavg",
           ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
            "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
            "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active")),
    Metric("achieved_occupancy_pct", "achieved occupancy", "%", "plain", "wavg",
           ("sm__warps_active.avg.pct_of_peak_sustained_active",)),
    Metric("theoretical_occupancy_pct", "theoretical occupancy", "%", "plain", "wavg",
           ("sm__maximum_warps_per_active_cycle_pct",)),
    Metric("registers_per_thread", "registers/thread", "reg", "plain", "max", ("launch__registers_per_thread",)),
    Metric("occupancy_limit_registers", "block limit (registers)", "blocks", "plain", "min",
           ("launch__occupancy_limit_registers",)),
    Metric("occupancy_limit_shared_mem", "block limit (shared mem)", "blocks", "plain", "min",
           ("launch__occupancy_limit_shared_mem",)),
    Metric("occupancy_limit_warps", "block limit (warps)", "blocks", "plain", "min", ("launch__occupancy_limit_warps",)),
    Metric("shared_mem_per_block_bytes", "shared mem/block", "B", "bytes", "max",
           parts=(("launch__shared_mem_per_block_static",), ("launch__shared_mem_per_block_dynamic",))),
    Metric("spill_local_requests", "local spill requests", "req", "plain", "sum",
           ("derived__local_spilling_requests", "sass__inst_executed_register_spilling_mem_local"),
           passes=("source", "full")),
    Metric("spill_shared_requests", "shared spill requests", "req", "plain", "sum",
           ("derived__shared_spilling_requests", "sass__inst_executed_register_spilling_mem_shared"),
           passes=("source", "full")),
    Metric("spill_instructions", "spill instructions", "inst", "plain", "sum",
           ("sass__inst_executed_register_spilling",), passes=("source", "full")),
    Metric("local_load_bytes", "local-memory load bytes", "B", "bytes", "sum",
           ("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum", ("l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum", 32.0))),
    Metric("local_store_bytes", "local-memory store bytes", "B", "bytes", "sum",
           ("l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum", ("l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum", 32.0))),
    Metric("warps_active_per_cycle", "active warps/cycle (SMSP)", "warps", "plain", "wavg",
           ("smsp__warps_active.avg.per_cycle_active",)),
    Metric("warps_eligible_per_cycle", "eligible warps/cycle (SMSP)", "warps", "plain", "wavg",
           ("smsp__warps_eligible.avg.per_cycle_active",)),
    Metric("issue_active_per_cycle", "issued warps/cycle (SMSP)", "inst", "plain", "wavg",
           ("smsp__issue_active.avg.per_cycle_active",)),
)
METRIC_BY_KEY = {m.key: m for m in METRICS}
# Derived per kernel and per stage from the table's sums (never from missing values).
DERIVED = {
    "dram_bytes": ("dram_read_bytes", "dram_write_bytes"),  # read + write
}
# Warp-stall reasons: two families, matched by prefix over the report's metric names.
STALL_RATIO = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")  # full: WarpStateStats
STALL_SAMPLES = re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$")  # source: SourceCounters sampling
NOT_A_STALL = {"selected"}
TOP_STALLS = 5
# Tensor instruction counts are not in `--set full`'s sections: asked for explicitly, per arch.
EXTRA_METRICS = {
    (9, 0): ("sm__inst_executed_pipe_tensor_op_hmma.sum", "sm__inst_executed_pipe_tensor_op_gmma.sum"),
    "default": ("sm__inst_executed_pipe_tensor_op_hmma.sum",),
}


def metric_keys() -> list[str]:
    """Every metric an expectation may name: the table, the derived ones, and `launches`."""
    return ["launches", *(m.key for m in METRICS), *DERIVED]


def all_ncu_names() -> set[str]:
    names: set[str] = set()
    for m in METRICS:
        for cand in (m.names, *m.parts):
            for c in cand:
                names.add(c[0] if isinstance(c, tuple) else c)
    return names


# --- units --------------------------------------------------------------------------------------

_SI = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TIME = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}


class UnitError(ValueError):
    pass


def to_canonical(value: float, unit: str | None, kind: str) -> float:
    """Scale a value reported in `unit` to the table's canonical unit for `kind`."""
    unit = (unit or "").strip()
    if kind == "time":
        if unit not in _TIME:
            raise UnitError(f"time unit {unit!r} not understood")
        return value * _TIME[unit]
    if kind == "bytes":
        m = re.fullmatch(r"([KMGT]?)i?byte(?:/block)?", unit)
        if not m:
            raise UnitError(f"byte unit {unit!r} not understood")
        return value * _SI[m.group(1)]
    if kind == "rate":
        m = re.fullmatch(r"([KMGT]?)i?byte/(n|u|m|)second", unit)
        if not m:
            raise UnitError(f"rate unit {unit!r} not understood")
        per = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0}[m.group(2)]
        return value * _SI[m.group(1)] / per
    return value


# --- reading reports ----------------------------------------------------------------------------

@dataclass
class Launch:
    """One profiled kernel launch: its name and raw metrics {ncu name: (value, unit)}."""

    name: str
    metrics: dict[str, tuple[float | str | None, str]]
    index: int = 0
    nvtx: list[str] = field(default_factory=list)


class ReportError(Exception):
    """A report could not be read (no reader, corrupt file, ncu --import failed)."""


def _wanted(name: str) -> bool:
    return name in _ALL_NAMES or bool(STALL_RATIO.match(name) or STALL_SAMPLES.match(name))


_ALL_NAMES = all_ncu_names()


def read_report(path: str | Path, ncu: str | None = None, timeout: int = 600) -> tuple[list[Launch], str]:
    """(launches, reader) from an .ncu-rep: `ncu_report` when importable, else ncu's raw CSV."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such report")
    if _import_ncu_report(ncu) is None:
        ncu = ncu or find_ncu()
        if ncu is None:
            raise ReportError(f"{path}: neither the ncu_report module nor an ncu binary is available to read it")
        return read_report_csv(path, ncu, timeout), "csv"
    return read_report_module(path), "ncu_report"


def _import_ncu_report(ncu: str | None = None):
    """The `ncu_report` module: installed (PyPI ncu-report), or the one shipped in
    <nsight-compute>/extras/python next to the ncu binary; None when neither is there."""
    try:
        import ncu_report

        return ncu_report
    except ImportError:
        pass
    ncu = ncu or find_ncu()
    if ncu is None:
        return None
    extras = Path(ncu).resolve().parent / "extras" / "python"
    if not (extras / "ncu_report.py").is_file():
        return None
    sys.path.append(str(extras))
    try:
        import ncu_report

        return ncu_report
    except ImportError:
        sys.path.remove(str(extras))
        return None


def read_report_module(path: Path) -> list[Launch]:
    import ncu_report

    try:
        ctx = ncu_report.load_report(str(path))
    except Exception as e:
        raise ReportError(f"{path}: ncu_report could not load it: {type(e).__name__}: {e}") from e
    launches: list[Launch] = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            act = rng.action_by_idx(a)
            metrics: dict[str, tuple] = {}
            for name in act.metric_names():
                if not _wanted(name):
                    continue
                m = act.metric_by_name(name)
                if m is None:
                    continue
                try:
                    value = m.value()
                except Exception:
                    value = None
                metrics[name] = (value, m.unit() or "")
            launches.append(Launch(name=act.name(), metrics=metrics, index=len(launches), nvtx=_nvtx_ranges(act)))
    return launches


def _nvtx_ranges(act) -> list[str]:
    """The default domain's push/pop stack at launch (best effort; [] when unavailable)."""
    try:
        state = act.nvtx_state()
        if state is None:
            return []
        out = []
        for d in state.domains():
            dom = state.domain_by_id(d)
            out += [str(r) for r in dom.push_pop_ranges()]
        return out
    except Exception:
        return []


def _num(text: str) -> float | str | None:
    t = (text or "").strip()
    if t == "" or t.lower() in ("n/a", "nan"):
        return None
    try:
        return float(t.replace(",", ""))
    except ValueError:
        return t


def parse_raw_csv(text: str) -> list[Launch]:
    """`ncu --import X --csv --page raw` output: header row, units row, one row per launch."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # drop ==PROF== / ==WARNING== lines
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        return []
    header, units, body = rows[0], rows[1], rows[2:]
    name_col = next((c for c in ("Kernel Name", "launch__kernel_name", "Function Name") if c in header), None)
    if name_col is None:
        raise ReportError("raw CSV has no 'Kernel Name' column")
    ni = header.index(name_col)
    nvtx_cols = [i for i, h in enumerate(header) if h.startswith("NVTX") or h.startswith("thread_domain")]
    launches = []
    for k, row in enumerate(body):
        if len(row) < len(header):
            continue
        metrics = {h: (_num(row[i]), units[i] if i < len(units) else "") for i, h in enumerate(header) if _wanted(h)}
        launches.append(Launch(name=row[ni], metrics=metrics, index=k, nvtx=[row[i] for i in nvtx_cols if row[i]]))
    return launches


def read_report_csv(path: Path, ncu: str, timeout: int = 600) -> list[Launch]:
    cmd = [ncu, "--import", str(path), "--csv", "--page", "raw", "--print-units", "base"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (subprocess.SubprocessError, OSError) as e:
        raise ReportError(f"{shlex.join(cmd)}: {type(e).__name__}: {e}") from e
    if out.returncode != 0:
        raise ReportError(f"{shlex.join(cmd)} exited {out.returncode}: {out.stderr[-1000:]}")
    return parse_raw_csv(out.stdout)


# --- per kernel ---------------------------------------------------------------------------------

def _lookup(launch: Launch, metric: Metric, candidates: tuple) -> tuple[float | None, str | None, str | None]:
    for cand in candidates:
        name, factor = (cand if isinstance(cand, tuple) else (cand, 1.0))
        if name not in launch.metrics:
            continue
        raw, unit = launch.metrics[name]
        if raw is None or isinstance(raw, str):
            return None, name, f"{name} has no numeric value ({raw!r})"
        try:
            # a (name, factor) fallback counts something else (sectors): scale the count, not a unit
            v = float(raw) * factor if factor != 1.0 else to_canonical(float(raw), unit, metric.kind)
        except UnitError as e:
            return None, name, f"{name}: {e}"
        if not math.isfinite(v):
            return None, name, f"{name} is not finite"
        return v, name, None
    return None, None, None


def launch_metric(launch: Launch, metric: Metric) -> tuple[float | None, str | None]:
    """(value, ncu name(s) used) of one table metric for one launch; (None, None) when absent."""
    if metric.parts:
        total, used = 0.0, []
        for cands in metric.parts:
            v, name, _ = _lookup(launch, metric, cands)
            if v is not None:
                total += v
                used.append(name)
        return (total, "+".join(used)) if used else (None, None)
    v, name, _ = _lookup(launch, metric, metric.names)
    return v, name


def _combine(values: list[float | None], weights: list[float | None], agg: str) -> float | None:
    """Combine per-launch (or per-kernel) values; any None makes the result None (never a partial 0)."""
    if not values or any(v is None for v in values):
        return None
    if agg == "sum":
        return float(sum(values))
    if agg == "max":
        return float(max(values))
    if agg == "min":
        return float(min(values))
    if agg == "wavg":
        if weights and all(w is not None and w > 0 for w in weights):
            return float(sum(v * w for v, w in zip(values, weights)) / sum(weights))
        return float(sum(values) / len(values))
    raise ValueError(f"unknown aggregation {agg!r}")


def _stalls(launches: list[Launch], pattern: re.Pattern, weights: list[float | None] | None) -> dict[str, float]:
    """Reason -> value over launches: summed (samples) when weights is None, else duration-weighted."""
    out: dict[str, list[tuple[float, float | None]]] = {}
    for i, la in enumerate(launches):
        for name, (raw, _unit) in la.metrics.items():
            m = pattern.match(name)
            if not m or name.endswith("_not_issued") or not isinstance(raw, (int, float)):
                continue
            out.setdefault(m.group(1), []).append((float(raw), weights[i] if weights else None))
    res = {}
    for reason, vals in out.items():
        if weights is None:
            res[reason] = sum(v for v, _ in vals)
        else:
            ws = [w for _, w in vals]
            res[reason] = (sum(v * w for v, w in vals) / sum(ws)) if all(w for w in ws) else sum(v for v, _ in vals) / len(vals)
    return res


DRAM_RATES = (("dram_read_bytes_per_s", "dram_read_bytes"), ("dram_write_bytes_per_s", "dram_write_bytes"))


def _bytes_per_s(values: dict[str, float | None], bytes_key: str) -> float | None:
    """Bytes over the duration (ns) of the same kernel or stage; None when either is missing."""
    b, d = values.get(bytes_key), values.get("duration_ns")
    return b / (d * 1e-9) if b is not None and d else None


def kernel_metrics(passes: dict[str, list[Launch]]) -> dict[str, dict]:
    """Per kernel name: launches, table metrics (None when missing), derived, stalls, sources.

    `passes` maps a pass name to its launches. A table metric comes from the first pass in the
    metric's `passes` order whose launches of that kernel all have it."""
    names: list[str] = []
    for launches in passes.values():
        for la in launches:
            if la.name not in names:
                names.append(la.name)
    out = {}
    for kname in names:
        by_pass = {p: [la for la in ls if la.name == kname] for p, ls in passes.items()}
        counts = {p: len(ls) for p, ls in by_pass.items() if ls}
        launches = counts.get("full", max(counts.values()))
        values: dict[str, float | None] = {}
        sources: dict[str, str] = {}
        missing: list[str] = []
        for metric in METRICS:
            got = None
            for p in metric.passes:
                ls = by_pass.get(p) or []
                if not ls:
                    continue
                per = [launch_metric(la, metric) for la in ls]
                if all(v is not None for v, _ in per):
                    durs = [launch_metric(la, METRIC_BY_KEY["duration_ns"])[0] for la in ls]
                    got = _combine([v for v, _ in per], durs, metric.agg)
                    sources[metric.key] = f"{p}:{per[0][1]}"
                    break
            values[metric.key] = got
            if got is None:
                missing.append(metric.key)
        # ncu's `.per_second` rates are computed by the CLI when it prints a report; the stored report
        # (what ncu_report reads) lacks them (measured on the H200's ncu 2025.3.1). Bytes over the
        # kernel's duration is the same rate: derived here, and its source says so.
        for key, src_key in DRAM_RATES:
            rate = _bytes_per_s(values, src_key)
            if values.get(key) is None and rate is not None:
                values[key] = rate
                sources[key] = f"derived: {src_key} / duration_ns"
                missing.remove(key)
        values.update(_derived(values))
        full = by_pass.get("full") or []
        src = by_pass.get("source") or []
        durs = [launch_metric(la, METRIC_BY_KEY["duration_ns"])[0] for la in full]
        rec = {"launches": launches, "launches_by_pass": counts, "metrics": values, "missing": missing,
               "sources": sources,
               "stall_ratio": _stalls(full, STALL_RATIO, durs) if full else {},
               "stall_samples": _stalls(src, STALL_SAMPLES, None) if src else {}}
        rec["top_stalls"] = top_stalls(rec)
        out[kname] = rec
    return out


def _derived(values: dict[str, float | None]) -> dict[str, float | None]:
    out = {}
    for key, parts in DERIVED.items():
        vals = [values.get(p) for p in parts]
        out[key] = None if any(v is None for v in vals) else float(sum(vals))
    return out


def top_stalls(rec: dict, n: int = TOP_STALLS) -> list[dict]:
    """The dominant stall reasons: by sampled share when SourceCounters sampled, else by
    warps-per-issued-instruction from WarpStateStats."""
    samples = {r: v for r, v in (rec.get("stall_samples") or {}).items() if r not in NOT_A_STALL}
    total = sum(samples.values())
    if total > 0:
        ranked = sorted(samples.items(), key=lambda kv: -kv[1])[:n]
        return [{"reason": r, "samples": v, "share": v / total, "source": "pcsamp"} for r, v in ranked]
    ratios = {r: v for r, v in (rec.get("stall_ratio") or {}).items() if r not in NOT_A_STALL}
    ranked = sorted(ratios.items(), key=lambda kv: -kv[1])[:n]
    return [{"reason": r, "warps_per_issue": v, "source": "warp_state"} for r, v in ranked]


# --- per stage ----------------------------------------------------------------------------------

def stage_kernels(kernel_names: Iterable[str], patterns: list[str]) -> list[str]:
    """Kernels a stage's patterns match, by the profile's own rule (kernel_profile.stage_matches)."""
    return [k for k in kernel_names if stage_matches(k, patterns)]


def stage_sums(kernels: dict[str, dict], patterns: dict[str, list[str]]) -> dict[str, dict]:
    """Per stage: matched kernels, launches, each table metric combined over them (None when any
    matched kernel lacks it, or when no kernel matched), derived metrics and stalls."""
    out = {}
    for stage, pats in patterns.items():
        names = stage_kernels(kernels, pats)
        recs = [kernels[k] for k in names]
        values: dict[str, float | None] = {}
        missing: dict[str, list[str]] = {}
        durs = [r["metrics"].get("duration_ns") for r in recs]
        for metric in METRICS:
            vals = [r["metrics"].get(metric.key) for r in recs]
            values[metric.key] = _combine(vals, durs, metric.agg) if recs else None
            if recs and values[metric.key] is None:
                missing[metric.key] = [k for k, v in zip(names, vals) if v is None]
        values.update(_derived(values))
        for key, src in DRAM_RATES:  # a stage's throughput: its bytes over its time
            rate = _bytes_per_s(values, src)
            if rate is not None:
                values[key] = rate
        stall_samples: dict[str, float] = {}
        for r in recs:
            for reason, v in r.get("stall_samples", {}).items():
                stall_samples[reason] = stall_samples.get(reason, 0.0) + v
        stall_ratio: dict[str, float] = {}
        if recs and all(r.get("stall_ratio") for r in recs) and all(durs) and all(x is not None for x in durs):
            reasons = set().union(*(r["stall_ratio"] for r in recs))
            for reason in reasons:
                stall_ratio[reason] = sum(r["stall_ratio"].get(reason, 0.0) * w for r, w in zip(recs, durs)) / sum(durs)
        rec = {"patterns": list(pats), "kernels": names, "matched": len(names),
               "launches": sum(r["launches"] for r in recs) if recs else None,
               "metrics": values, "missing": missing, "stall_samples": stall_samples, "stall_ratio": stall_ratio}
        rec["top_stalls"] = top_stalls(rec)
        out[stage] = rec
    return out


def stage_value(stage: dict | None, key: str) -> float | None:
    if stage is None or not stage.get("matched"):
        return None
    if key == "launches":
        return float(stage["launches"])
    return stage["metrics"].get(key)


def deltas(base: dict[str, dict], cand: dict[str, dict]) -> dict[str, dict]:
    """Per stage, per metric: baseline, candidate, candidate - baseline, candidate / baseline."""
    out = {}
    for stage in sorted(set(base) | set(cand)):
        row = {}
        for key in metric_keys():
            b, c = stage_value(base.get(stage), key), stage_value(cand.get(stage), key)
            row[key] = {"baseline": b, "candidate": c,
                        "delta": None if b is None or c is None else c - b,
                        "ratio": None if b is None or c is None or b == 0 else c / b}
        out[stage] = row
    return out


# --- the gate -----------------------------------------------------------------------------------

RELATIONS = {
    "lower_by_at_least": "baseline - candidate >= value",
    "higher_by_at_most": "candidate - baseline <= value",
    "candidate_at_most": "candidate <= value",
    "candidate_ratio_at_least": "candidate / baseline >= value",
}


def check_expectation(exp, base_stage: dict | None, cand_stage: dict | None,
                      side_problem: dict[str, str | None] | None = None) -> dict:
    """One expectation -> {stage, metric, relation, value, baseline, candidate, status, reason};
    status PASS | FAIL | None (INCONCLUSIVE)."""
    res = {"stage": exp.stage, "metric": exp.metric, "relation": exp.relation, "value": exp.value,
           "rule": RELATIONS[exp.relation], "baseline": None, "candidate": None, "status": None, "reason": ""}
    if exp.metric not in metric_keys():
        res["reason"] = f"unknown ncu metric {exp.metric!r} (known: {', '.join(metric_keys())})"
        return res
    needs_base = exp.relation != "candidate_at_most"
    sides = (("baseline", base_stage), ("candidate", cand_stage)) if needs_base else (("candidate", cand_stage),)
    for side, st in sides:
        problem = (side_problem or {}).get(side)
        if problem:
            res["reason"] = f"{side}: {problem}"
            return res
        if st is None:
            res["reason"] = f"{side}: stage {exp.stage!r} was not profiled"
            return res
        if not st.get("matched"):
            res["reason"] = (f"{side}: stage {exp.stage!r} matched no profiled kernel (patterns {st.get('patterns')}); "
                             "check the stage patterns and the ncu kernel filter")
            return res
        v = stage_value(st, exp.metric)
        res[side] = v
        if v is None:
            who = st.get("missing", {}).get(exp.metric) or st.get("kernels")
            res["reason"] = f"{side}: metric {exp.metric!r} is missing from the report for stage {exp.stage!r} (kernels {who})"
            return res
    if not needs_base and base_stage and base_stage.get("matched"):
        # the rule reads the candidate alone; the baseline's value is shown beside it, so a reader
        # sees whether the candidate introduced the excess or inherited it
        res["baseline"] = stage_value(base_stage, exp.metric)
    b, c, x = res["baseline"], res["candidate"], exp.value
    if exp.relation == "lower_by_at_least":
        ok, shown = (b - c) >= x, f"baseline - candidate = {b - c:g} vs >= {x:g}"
    elif exp.relation == "higher_by_at_most":
        ok, shown = (c - b) <= x, f"candidate - baseline = {c - b:g} vs <= {x:g}"
    elif exp.relation == "candidate_at_most":
        ok, shown = c <= x, f"candidate = {c:g} vs <= {x:g}" + ("" if b is None else f" (baseline {b:g})")
    else:
        if b == 0:
            res["reason"] = f"baseline {exp.metric} is 0 for stage {exp.stage!r}: the ratio is undefined"
            return res
        ok, shown = (c / b) >= x, f"candidate / baseline = {c / b:.4g} vs >= {x:g}"
    res["status"] = "PASS" if ok else "FAIL"
    res["reason"] = f"{exp.stage}.{exp.metric}: {shown}"
    return res


def _combine_status(statuses: list[str | None]) -> str | None:
    if any(s == "FAIL" for s in statuses):
        return "FAIL"
    if statuses and all(s == "PASS" for s in statuses):
        return "PASS"
    return None


def evaluate_gates(exp, record: dict) -> dict:
    """The `ncu` gates of `exp` on the record's stage sums -> {status, reason, numbers}.

    FAIL when any expectation fails; PASS when every one passes; otherwise None (INCONCLUSIVE)."""
    from harness.spec import NcuGate

    gates = [g for g in exp.gates if isinstance(g, NcuGate)]
    if not gates:
        return _verdict(None, "the experiment declares no ncu gate", {})
    if record.get("error"):
        numbers = {g.name: {"status": None, "checks": []} for g in gates}
        return _verdict(None, record["error"], numbers)
    numbers, statuses, reasons = {}, [], []
    for gate in gates:
        rowrec = {s: (record.get("sides", {}).get(s, {}).get("rows", {}).get(gate.row)) for s in ("baseline", "candidate")}
        problems = {}
        for side, rr in rowrec.items():
            if rr is None:
                problems[side] = f"row {gate.row!r} was not profiled (add it to ncu.rows)"
            elif rr.get("status") != "ok":
                problems[side] = f"profile of row {gate.row!r} failed: {rr.get('error')}"
        checks = []
        for e in gate.expect:
            stages = {s: (rowrec[s] or {}).get("stages", {}).get(e.stage) for s in ("baseline", "candidate")}
            checks.append(check_expectation(e, stages["baseline"], stages["candidate"], problems))
        st = _combine_status([c["status"] for c in checks])
        numbers[gate.name] = {"row": gate.row, "status": st, "checks": checks}
        statuses.append(st)
        bad = [c for c in checks if c["status"] != "PASS"]
        if st == "PASS":
            reasons.append(f"{gate.name}: all {len(checks)} expectations hold")
        else:
            shown = [c for c in bad if c["status"] == "FAIL"] or bad
            reasons.append(f"{gate.name}: " + "; ".join(c["reason"] for c in shown))
    return _verdict(_combine_status(statuses), " | ".join(reasons), numbers)


def _verdict(status, reason, numbers) -> dict:
    try:
        from dataclasses import asdict

        from harness.gates import PhaseVerdict

        return asdict(PhaseVerdict(status=status, reason=reason, numbers=numbers))
    except ImportError:
        return {"status": status, "reason": reason, "numbers": numbers}


# --- running ncu --------------------------------------------------------------------------------

def find_ncu() -> str | None:
    """HARNESS_NCU, then `ncu` on PATH, then the usual install places."""
    env = os.environ.get("HARNESS_NCU")
    if env:
        return env if Path(env).is_file() else None
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu"):
        hits = sorted(Path("/").glob(pattern.lstrip("/")))
        if hits:
            return str(hits[-1])
    return None


def ncu_version(ncu: str, timeout: int = 60) -> str | None:
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=timeout)
    except (subprocess.SubprocessError, OSError):
        return None
    m = re.search(r"Version\s+([\w.\-() ]+)", out.stdout)
    return m.group(1).strip() if m else (out.stdout.strip().splitlines() or [None])[-1]


def kernel_regex(patterns: Iterable[str]) -> str:
    """One ncu `-k regex:` filter: the union of the stage patterns, each in its own group."""
    uniq = list(dict.fromkeys(patterns))
    return uniq[0] if len(uniq) == 1 else "|".join(f"({p})" for p in uniq)


def build_commands(ncu: str, target: list[str], out_stem: Path, patterns: Iterable[str],
                   extra_metrics: Iterable[str] = (), launch_count: int | None = None,
                   nvtx_range: str = MEASURE_RANGE) -> dict[str, list[str]]:
    """Both passes' argv for one side and row: {'full': [...], 'source': [...]}."""
    common = ["--clock-control", "none", "--cache-control", "all", "--target-processes", "all",
              "--nvtx", "--nvtx-include", f"{nvtx_range}/", "-k", f"regex:{kernel_regex(patterns)}"]
    if launch_count:
        common += ["-c", str(launch_count)]
    full = [ncu, *common, "--set", "full", "--section", "PmSampling", "--section", "PmSampling_WarpStates"]
    extra = list(extra_metrics)
    if extra:
        full += ["--metrics", ",".join(extra)]
    full += ["-f", "-o", f"{out_stem}-full", *target]
    source = [ncu, *common, "--section", "SourceCounters", "-f", "-o", f"{out_stem}-source", *target]
    return {"full": full, "source": source}


def _report_path(argv: list[str]) -> Path:
    return Path(argv[argv.index("-o") + 1] + ".ncu-rep")


def _errors_from_log(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "==ERROR==" in ln or "==WARNING==" in ln or "Error" in ln]
    return " / ".join(lines[-6:]) if lines else text[-800:]


def run_pass(argv: list[str], log_path: Path, env: dict, cwd: Path, timeout: int) -> dict:
    """Run one ncu pass; {status ok|failed, rc, wall_s, report, error}. Never raises."""
    report = _report_path(argv)
    report.unlink(missing_ok=True)
    t0 = time.perf_counter()
    rec: dict = {"command": shlex.join(argv), "log": str(log_path), "report": str(report), "rc": None}
    try:
        with log_path.open("w") as out:
            proc = children.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        rec["rc"] = proc.returncode
    except subprocess.TimeoutExpired:
        rec.update(status="failed", error=f"ncu timed out after {timeout} s", wall_s=round(time.perf_counter() - t0, 1))
        return rec
    except OSError as e:
        rec.update(status="failed", error=f"could not start ncu: {e}", wall_s=0.0)
        return rec
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if not report.is_file():
        why = "no kernels were profiled" if "No kernels were profiled" in text else "no report was written"
        rec.update(status="failed", error=f"{why} (ncu exit {rec['rc']}): {_errors_from_log(text)}")
    elif rec["rc"] != 0:
        rec.update(status="failed", error=f"ncu exit {rec['rc']}: {_errors_from_log(text)}")
    else:
        rec.update(status="ok", error=None, report_bytes=report.stat().st_size)
    return rec


def _timeout() -> int:
    try:
        return int(os.environ.get("HARNESS_NCU_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _extra_metrics() -> tuple[str, ...]:
    try:
        import torch

        cap = tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
    except Exception:
        cap = None
    return EXTRA_METRICS.get(cap, EXTRA_METRICS["default"])


def profile_mode(exp) -> str:
    return "fwdbwd" if "fwdbwd" in exp.modes else exp.modes[0]


def ncu_run(loaded, revisions, run_dir: Path, profile_root: Path, log: Callable[[str], None] = print) -> dict:
    """Profile both sides on every `ncu.rows` row, parse, sum stages, decide the gate, write
    run_dir/ncu.json (atomically) and return the record. Never raises for a missing ncu or a failed
    profile: those end in the record's gate as INCONCLUSIVE with the reason. Each (side, row) is kept
    in ncu/<side>-<row>.json as soon as it is parsed: a run resumed after a crash (or a device call
    that ran out of time) profiles only what is missing."""
    from harness.measure.sides import side_env, side_op
    from harness.records import declared_side, run_is_aa

    exp = loaded.exp
    run_dir = Path(run_dir)
    out_dir = run_dir / "ncu"
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = profile_mode(exp)
    record: dict = {"schema": SCHEMA_VERSION, "experiment": exp.name, "started": _now(), "finished": None,
                    "mode": mode, "rows": list(exp.ncu.rows), "stages": list(exp.ncu.stages),
                    "nvtx_range": MEASURE_RANGE, "cache_control": "all", "clock_control": "none",
                    "ncu": {"path": None, "version": None}, "commands": [], "sides": {}, "deltas": {},
                    "metric_table": {m.key: {"label": m.label, "unit": m.unit, "agg": m.agg,
                                             "names": [n if isinstance(n, str) else list(n) for n in m.names],
                                             "parts": [list(p) for p in m.parts]} for m in METRICS},
                    "error": None}
    ncu = find_ncu()
    if ncu is None:
        record["error"] = "ncu not found (set HARNESS_NCU or put Nsight Compute's ncu on PATH)"
        log(f"ncu: {record['error']}")
        return _finish(exp, record, run_dir)
    record["ncu"] = {"path": ncu, "version": ncu_version(ncu)}
    try:
        from harness.device import device_info, gpu_snapshot, versions

        record.update(device=device_info(), versions=versions(), gpu_before=gpu_snapshot())
    except Exception as e:  # provenance is best effort; the profile is the evidence
        record["device"] = {"error": f"{type(e).__name__}: {e}"}
    timeout = _timeout()
    extra = _extra_metrics()
    _, inputs_fn = exp.target.inputs.split(":")
    aa = run_is_aa(run_dir)
    for side in ("baseline", "candidate"):
        rs = getattr(revisions, side)
        patterns = {s: list(getattr(exp.stages[s], side)) for s in exp.ncu.stages}
        side_rec = {"sha": rs.sha, "ref": rs.ref, "stage_patterns": patterns,
                    "kernel_filter": kernel_regex(p for ps in patterns.values() for p in ps), "rows": {}}
        record["sides"][side] = side_rec
        declared = declared_side(side, aa)
        env = side_env(loaded, declared, profile_root, cpu_mode=False)
        for row in exp.ncu.rows:
            shape = exp.shape(row)
            stem = out_dir / f"{side}-{row}"
            job = {"worktree": rs.worktree, **side_op(exp, declared), "inputs_file": str(loaded.inputs_file),
                   "inputs_fn": inputs_fn, "shape": shape.model_dump(exclude_none=True), "mode": mode,
                   "dtype": exp.dtype, "seed": exp.seed, "warmup": exp.warmup,
                   "result_path": str(out_dir / f"{side}-{row}-target.json")}
            done_path = out_dir / f"{side}-{row}.json"
            if done_path.is_file():
                # a resumed run: this (side, row) was profiled and parsed by an earlier attempt (its
                # reports may be gone with that machine; the parsed record is what the gate reads)
                row_rec = json.loads(done_path.read_text())
                if row_rec.get("status") == "ok":
                    log(f"ncu {side} {row}: kept from an earlier attempt ({done_path.name})")
                    record["commands"] += [{"side": side, "row": row, "pass": p, **r}
                                           for p, r in row_rec["passes"].items()]
                    side_rec["rows"][row] = row_rec
                    continue
            job_path = out_dir / f"{side}-{row}-job.json"
            job_path.write_text(json.dumps(job, indent=1))
            target = [sys.executable, "-m", "harness.ncu_target", str(job_path)]
            cmds = build_commands(ncu, target, stem, [p for ps in patterns.values() for p in ps], extra)
            row_rec: dict = {"status": "ok", "error": None, "passes": {}}
            for pname in PASSES:
                log(f"ncu {side} {row} {pname} ({rs.sha[:10]})")
                res = run_pass(cmds[pname], out_dir / f"{side}-{row}-{pname}.log", env, run_dir, timeout)
                if pname == "full" and res["status"] != "ok" and "Failed to find metric" in (res.get("error") or "") and extra:
                    # a chip without one of the extra tensor metrics: profile again without them
                    cmds["full"] = build_commands(ncu, target, stem, [p for ps in patterns.values() for p in ps])["full"]
                    res = run_pass(cmds["full"], out_dir / f"{side}-{row}-{pname}.log", env, run_dir, timeout)
                record["commands"].append({"side": side, "row": row, "pass": pname, **res})
                row_rec["passes"][pname] = res
            tpath = Path(job["result_path"])
            row_rec["target"] = json.loads(tpath.read_text()) if tpath.is_file() else None
            _parse_row(row_rec, patterns, ncu)
            side_rec["rows"][row] = row_rec
            tmp = done_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(_clean(row_rec), indent=1, sort_keys=True, default=str))
            tmp.replace(done_path)
            if row_rec["status"] != "ok":
                log(f"ncu {side} {row}: {row_rec['error']}")
    try:
        from harness.device import gpu_snapshot

        record["gpu_after"] = gpu_snapshot()
    except Exception:
        pass
    for row in exp.ncu.rows:
        b = record["sides"]["baseline"]["rows"][row].get("stages", {})
        c = record["sides"]["candidate"]["rows"][row].get("stages", {})
        record["deltas"][row] = deltas(b, c)
    return _finish(exp, record, run_dir)


def _parse_row(row_rec: dict, patterns: dict[str, list[str]], ncu: str | None) -> None:
    """Read the row's reports into kernels and stage sums; a failed pass marks the row failed."""
    launches: dict[str, list[Launch]] = {}
    problems = []
    for pname, res in row_rec["passes"].items():
        if res.get("status") != "ok":
            problems.append(f"{pname} pass: {res.get('error')}")
            continue
        try:
            launches[pname], reader = read_report(res["report"], ncu)
            res["reader"] = reader
            res["launches"] = len(launches[pname])
        except ReportError as e:
            problems.append(f"{pname} pass: {e}")
    if problems:
        row_rec["status"], row_rec["error"] = "failed", "; ".join(problems)
    row_rec["kernels"] = kernel_metrics(launches) if launches else {}
    row_rec["stages"] = stage_sums(row_rec["kernels"], patterns) if launches else {}


def _finish(exp, record: dict, run_dir: Path) -> dict:
    record["gate"] = evaluate_gates(exp, record)
    record["finished"] = _now()
    path = run_dir / "ncu.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_clean(record), indent=2, sort_keys=True, default=str))
    tmp.replace(path)
    return record


def _clean(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


# --- tables for people --------------------------------------------------------------------------

TABLE_KEYS = ("launches", "duration_ns", "dram_read_bytes", "dram_write_bytes", "dram_read_bytes_per_s",
              "dram_write_bytes_per_s",
              "l2_bytes", "tensor_inst", "sm_sol_pct", "tensor_sol_pct", "achieved_occupancy_pct",
              "theoretical_occupancy_pct", "registers_per_thread", "spill_local_requests", "local_load_bytes",
              "local_store_bytes", "warps_active_per_cycle", "warps_eligible_per_cycle")


def fmt(key: str, v: float | None) -> str:
    if v is None:
        return "missing"
    unit = "" if key == "launches" else METRIC_BY_KEY.get(key, Metric(key, key, "", "plain", "sum")).unit
    if key == "duration_ns":
        return f"{v / 1e3:,.2f} us"
    if unit == "B":
        for div, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= div:
                return f"{v / div:,.2f} {u}"
        return f"{v:,.0f} B"
    if unit == "B/s":
        return f"{v / 1e9:,.1f} GB/s"
    if unit == "%":
        return f"{v:.1f}%"
    if float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:,.3g}"


def _value_of(rec: dict, key: str) -> float | None:
    if key == "launches":
        return None if rec.get("launches") is None else float(rec["launches"])
    return rec["metrics"].get(key)


def print_kernels(kernels: dict[str, dict], title: str, console=None) -> None:
    """One column per kernel, one row per metric, plus the top stalls."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=title, show_lines=False)
    t.add_column("metric")
    for k in kernels:
        t.add_column(k if len(k) <= 40 else k[:37] + "...", justify="right")
    for key in TABLE_KEYS:
        t.add_row(key, *(fmt(key, _value_of(r, key)) for r in kernels.values()))
    t.add_row("top stalls", *(", ".join(s["reason"] for s in r["top_stalls"][:3]) or "missing" for r in kernels.values()))
    console.print(t)


def print_stage_table(record: dict, row: str, console=None) -> None:
    """Per stage: baseline, candidate, delta for each metric of TABLE_KEYS; then the gate."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for stage, metrics in (record.get("deltas", {}).get(row) or {}).items():
        t = Table(title=f"ncu {record.get('experiment')} row {row} stage {stage}")
        for col in ("metric", "baseline", "candidate", "delta", "cand/base"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for key in TABLE_KEYS:
            d = metrics.get(key) or {}
            t.add_row(key, fmt(key, d.get("baseline")), fmt(key, d.get("candidate")),
                      fmt(key, d.get("delta")) if d.get("delta") is not None else "missing",
                      f"{d['ratio']:.3f}" if d.get("ratio") is not None else "-")
        for side in ("baseline", "candidate"):
            st = ((record["sides"].get(side) or {}).get("rows", {}).get(row) or {}).get("stages", {}).get(stage) or {}
            t.add_row(f"{side} kernels", ", ".join(st.get("kernels") or []) or "none matched", "", "", "")
            t.add_row(f"{side} top stalls", ", ".join(s["reason"] for s in st.get("top_stalls", [])[:3]) or "missing",
                      "", "", "")
        console.print(t)
    gate = record.get("gate") or {}
    console.print(f"ncu gate: {gate.get('status') or 'INCONCLUSIVE'}: {gate.get('reason')}")
