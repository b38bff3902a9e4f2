"""Analyse one run directory into report.json: the single source the HTML report is rendered from.

Reads only records on disk (run.json, samples.jsonl, the optional phase records and the
experiment's attempt log), so `harness report` can re-render any run without a GPU. Statistics
come from harness/stats.py and decisions from harness/gates.py, so the
intervals shown per row are the very numbers the gates judged.
"""
from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from harness import gates as G
from harness import stats
from harness.profile import pregate_terminal
from harness.verify import candidate_terminal
from harness.errors import BadInput
from harness.measure.detail import autotune
from harness.records import Block, Damage, Measurement, declared_side, load_measurement, read_jsonl
from harness.spec import GeomeanGate, LoadedExperiment, Shape

SCHEMA_VERSION = 2  # docs/report.schema.json: 2 = rows carry per-basis measurements (bases), report.measurement
LOW_CLOCK_FRACTION = 0.75  # a block whose SM clock fell below this share of boost is flagged
NO_GPU_VERDICT = ("CPU timings under Triton's interpreter are a smoke test of the pipeline, "
                  "not a performance verdict for GPU kernels")
# Phase records in a run dir. verify.json decides correctness and frozen_paths (its `gates`);
# profile.json decides amdahl and ncu.json ncu (their `gate`); freeze.json's gate is the baseline
# gate (a FAIL there is a terminal red baseline, not a gate of this table); training.json feeds
# the training gate with blocks.
PHASE_FILES = ("verify", "freeze", "pytest", "profile", "ncu", "training", "agreement")
PHASE_GATE = {"profile": "amdahl", "ncu": "ncu", "agreement": "agreement"}


class ReportError(BadInput):
    """The run directory lacks what a report needs (no run.json, or a damaged one)."""


# what a report cannot do without: a run.json lacking one is damaged (a CPU run would read as a GPU one)
RUN_FIELDS = ("run_id", "experiment", "cpu_mode", "plan")


def _read_json(path: Path, damage: list[Damage] | None = None) -> dict | None:
    """A JSON object file, or None when it is missing. A damaged one (not UTF-8, not JSON, not an
    object) raises ReportError, or with a `damage` list is described there and read as missing."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        problem = None if isinstance(data, dict) else f"not a JSON object but {type(data).__name__}"
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        problem = f"unreadable: {e}"
    if problem is None:
        return data
    if damage is None:
        raise ReportError(f"{path} is damaged ({problem})")
    damage.append(Damage(str(path), 0, f"{problem}; read as missing"))
    return None


def _read_run(run_dir: Path) -> dict:
    run = _read_json(run_dir / "run.json")
    if run is None:
        raise ReportError(f"{run_dir} has no run.json: not a run directory")
    missing = [k for k in RUN_FIELDS if k not in run]
    if missing:
        raise ReportError(f"{run_dir / 'run.json'} lacks {', '.join(missing)} (damaged): no report can say what "
                          "this run measured")
    return run


def _clean(value):
    """JSON-safe copy: NaN/inf become None (report.json stays strict JSON), tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _row_name(shape: str, mode: str) -> str:
    return f"{shape}/{mode}"


def _run_shapes(loaded: LoadedExperiment, run: dict) -> list[Shape]:
    """The shapes this run measured: the manifest's (the cpu profile's on a CPU run)."""
    declared = (run.get("settings") or {}).get("shapes") or run.get("shapes")
    if declared:
        return [Shape.model_validate(s) for s in declared]
    if run.get("cpu_mode") and loaded.exp.cpu is not None:
        return list(loaded.exp.cpu.shapes)
    return list(loaded.exp.shapes)


def _experiment_dir(loaded: LoadedExperiment, run_dir: Path) -> Path | None:
    """profile/<experiment>/ (attempts.jsonl, state.json): the nearest ancestor named after it."""
    for parent in run_dir.resolve().parents:
        if parent.name == loaded.exp.name:
            return parent
    return None


# --- sections ----------------------------------------------------------------------------------

def _experiment_section(loaded: LoadedExperiment, run: dict) -> dict:
    exp = loaded.exp
    yaml_text = run.get("experiment_yaml")
    current = loaded.path.read_text() if loaded.path.is_file() else None
    return {
        "name": exp.name, "description": exp.description, "file": str(loaded.path),
        "sha256": hashlib.sha256(yaml_text.encode()).hexdigest() if yaml_text else None,
        # False: the file was edited after the run started, so the gates judged here are not the
        # ones declared before it (shown as a warning in the report)
        "matches_run": None if yaml_text is None or current is None else current == yaml_text,
        "dtype": exp.dtype, "modes": list(exp.modes), "order": exp.order, "seed": exp.seed,
        "blocks_per_side": exp.blocks, "samples_per_block": exp.samples_per_block,
        "shapes": [s.model_dump(exclude_none=True) for s in exp.shapes],
        "stages": {k: v.model_dump() for k, v in exp.stages.items()},
        "gates": [g.model_dump(mode="json") for g in exp.gates],
        "frozen_paths": list(exp.frozen_paths), "max_attempts": exp.max_attempts,
    }


def _run_section(run: dict, run_dir: Path, blocks: list[Block]) -> dict:
    plan = run.get("plan") or []
    return {
        "id": run.get("run_id") or run_dir.name, "cpu_mode": bool(run.get("cpu_mode")), "aa": bool(run.get("aa")),
        "started": run.get("started"), "finished": run.get("finished"), "note": run.get("note") or "",
        "measure_anyway": run.get("measure_anyway"),
        "run_dir": str(run_dir), "dtype": run.get("dtype"),
        "blocks_planned": len(plan), "blocks_completed": len(blocks),
        "blocks_failed": sum(1 for b in blocks if b.status != "ok"),
        "plan": plan,
    }


def _boost_mhz(run: dict, blocks: list[Block]) -> float | None:
    device = run.get("device") or {}
    for key in ("boost_sm_clock_mhz", "max_sm_clock_mhz"):
        if device.get(key):
            return float(device[key])
    for b in blocks:
        for snap in (b.gpu_before, b.gpu_after):
            if snap and snap.get("max_sm_clock_mhz"):
                return float(snap["max_sm_clock_mhz"])
    return None


def _blocks_section(blocks: list[Block], boost: float | None) -> list[dict]:
    out = []
    for b in blocks:
        clocks = [s.get("sm_clock_mhz") for s in (b.gpu_before, b.gpu_after) if s and s.get("sm_clock_mhz")]
        # an idle GPU sits at its idle clock (345 MHz on the H200 before a block starts): only a
        # snapshot of a busy GPU says anything about the clock the kernels ran at
        busy = [s.get("sm_clock_mhz") for s in (b.gpu_before, b.gpu_after)
                if s and s.get("sm_clock_mhz") and "gpu_idle" not in (s.get("throttle_reasons") or [])]
        low = bool(boost and busy and min(busy) < LOW_CLOCK_FRACTION * boost)
        medians = []  # only a block that finished ok counts as data (a failed one's samples do not)
        for (shape, mode), ms in sorted(b.samples.items()) if b.status == "ok" else ():
            if ms:
                s = stats.summarize(ms)
                medians.append({"shape": shape, "mode": mode, "row": _row_name(shape, mode), "n": s.n,
                                "median_ms": s.median})
        out.append({
            "index": b.index, "pair": b.pair, "side": b.side, "attempt": b.attempt, "status": b.status, "error": b.error,
            "start": b.t_start, "end": b.t_end, "host": b.host,
            "gpu_before": b.gpu_before, "gpu_after": b.gpu_after,
            "min_sm_clock_mhz": min(clocks) if clocks else None, "boost_sm_clock_mhz": boost,
            "low_clock": low, "row_medians": medians, "failures": b.failures,
        })
    return out


def _kernel_table(blocks: list[Block], key: tuple[str, str], side: str) -> list[dict]:
    """Per kernel name: device time and launches per profiled call, over the side's workers (blocks)."""
    totals: dict[str, list[float]] = {}
    iters = 0
    for b in blocks:
        if b.side != side or (b.pair is None and b.status != "ok"):  # the first engine's failed blocks are no data
            continue
        rec = b.kernels.get(key)
        if not rec:
            continue
        iters += int(rec.get("iters") or 0)
        for name, (ms, launches) in (rec.get("kernels") or {}).items():
            t = totals.setdefault(name, [0.0, 0])
            t[0] += float(ms)
            t[1] += int(launches)
    if not iters:
        return []
    return sorted(({"kernel": name, "ms_per_call": ms / iters, "launches_per_call": n / iters}
                   for name, (ms, n) in totals.items()), key=lambda k: -k["ms_per_call"])


def _basis_section(r: G.RowEvidence, basis: str) -> dict:
    """One timing basis of a row: both sides' summaries over every call, the speedup and time ratio
    with their intervals, the A/A control's time ratio (the row's noise floor), and how its rounds ended."""
    series = r.series[basis]
    base, cand = series.samples("base"), series.samples("cand")
    speedup = stats.ratio_interval(series, "base", "cand")
    aa = stats.ratio_interval(series, "control", "base") if series.has("control") else None
    floor, floor_source = G.noise_floor(series)
    return {
        "basis": basis, "baseline": stats.summarize(base).to_json(), "candidate": stats.summarize(cand).to_json(),
        "speedup": speedup.to_json(), "time_ratio": stats.reciprocal(speedup).to_json(),
        "aa_control": aa.to_json() if aa else None,
        "aa_control_median": stats.summarize(series.samples("control")).median if aa else None,
        "noise_floor": floor, "noise_floor_source": floor_source,
        "pairs": len(series.pairs), "rounds": series.n_rounds,
        "excluded_rounds": r.excluded.get(basis, 0), "retimed_calls": r.retimed.get(basis, 0),
        "stop": r.stops.get(basis),
        "mann_whitney_p": stats.mann_whitney_p(base, cand) if base and cand else None,
    }


def _rows_section(shapes: list[Shape], modes: list[str], ev: G.Evidence, blocks: list[Block]) -> list[dict]:
    rows = []
    for shape in shapes:
        for mode in modes:
            r = ev.rows.get((shape.name, mode))
            if r is None:
                continue
            bases = {b: _basis_section(r, b) for b in ("graph", "eager", "device") if r.series.get(b)}
            primary = bases.get(r.primary) or {}
            stages = []
            for (sh, mo, st), series in sorted(ev.stages.items()):
                if (sh, mo) != (shape.name, mode):
                    continue
                stages.append({"stage": st, "baseline": stats.summarize(series.samples("base")).to_json(),
                               "candidate": stats.summarize(series.samples("cand")).to_json(),
                               "speedup": stats.ratio_interval(series, "base", "cand").to_json()})
            delta = None if r.base_peak is None or r.cand_peak is None else r.cand_peak - r.base_peak
            kernels = {side: _kernel_table(blocks, (shape.name, mode), side) for side in ("baseline", "candidate")}
            device = bases.get("device")
            empty = stats.summarize([]).to_json()
            rows.append({
                "shape": shape.name, "mode": mode, "name": _row_name(shape.name, mode), "dims": r.shape_dims,
                "primary_basis": r.primary, "graph_reason": r.graph_reason, "bases": bases,
                # the primary basis's numbers, where older readers of report.json look for them
                "baseline": primary.get("baseline", empty), "candidate": primary.get("candidate", empty),
                "speedup": primary.get("speedup") or stats.Interval(None, None, None, 0.95, 0, "none",
                                                                      note="no measurements").to_json(),
                "samples_ms": {"baseline": r.series[r.primary].samples("base") if r.primary in r.series else [],
                               "candidate": r.series[r.primary].samples("cand") if r.primary in r.series else []},
                "blocks": {"baseline": primary.get("pairs", 0), "candidate": primary.get("pairs", 0)},
                "mann_whitney_p": primary.get("mann_whitney_p"),
                "peak_bytes": {"baseline": r.base_peak, "candidate": r.cand_peak, "delta": delta,
                               "delta_fraction": delta / r.base_peak if delta is not None and r.base_peak else None},
                "stages": stages,
                "kernels": kernels,
                "device_ms": None if device is None else {
                    "baseline": device["baseline"]["median"], "candidate": device["candidate"]["median"],
                    "ratio": device["speedup"]["point"], "speedup": device["speedup"]},
                "failures": r.failures,
            })
    return rows


def _geomeans_section(loaded: LoadedExperiment, shapes: list[Shape], ev: G.Evidence) -> list[dict]:
    """Each declared geomean gate's set of rows, then every measured row per mode (on each row's
    primary basis)."""
    sets: list[tuple[str, str, list[str], str]] = []
    for g in loaded.exp.gates:
        if isinstance(g, GeomeanGate):
            sets.append((g.name, g.mode, list(g.rows), g.basis))
    for mode in loaded.exp.modes:
        sets.append((f"all rows ({mode})", mode, [s.name for s in shapes], "auto"))
    out = []
    for label, mode, names, basis in sets:
        series = [ev.rows[(n, mode)].get(basis) for n in names if (n, mode) in ev.rows]
        if len(series) != len(names) or any(not s for s in series):
            iv = stats.Interval(None, None, None, 0.95, 0, "none", note="a row of this set was not measured")
        else:
            iv = stats.geomean_interval(series, "base", "cand")
        out.append({"name": label, "mode": mode, "rows": [_row_name(n, mode) for n in names], **iv.to_json(),
                    "declared": not label.startswith("all rows"), "basis": basis})
    return out


def _phases(run_dir: Path, exp_dir: Path | None, damage: list[Damage] | None = None
            ) -> tuple[dict[str, dict | None], dict[str, G.PhaseVerdict]]:
    records: dict[str, dict | None] = {}
    for name in PHASE_FILES:
        rec = _read_json(run_dir / f"{name}.json", damage)
        if rec is None and name == "freeze" and exp_dir is not None:
            rec = _read_json(exp_dir / "freeze.json", damage)  # freeze runs once per experiment
        records[name] = rec
    verdicts: dict[str, G.PhaseVerdict] = {}
    for kind, pv in ((records.get("verify") or {}).get("gates") or {}).items():
        if isinstance(pv, dict):
            verdicts[kind] = G.PhaseVerdict.from_json(pv)
    for name, kind in PHASE_GATE.items():
        gate = (records.get(name) or {}).get("gate")
        if isinstance(gate, dict):
            verdicts[kind] = G.PhaseVerdict.from_json(gate)
    for name, entry in ((records.get("pytest") or {}).get("gates") or {}).items():  # one per pytest gate
        if isinstance(entry.get("gate"), dict):
            verdicts[f"pytest:{name}"] = G.PhaseVerdict.from_json(entry["gate"])
    return records, verdicts


def _training_first_losses(record: dict | None) -> dict:
    """training.json rows' optional {row: {first_loss: {baseline: [...], candidate: [...]}}}."""
    out = {}
    for name, sides in ((record or {}).get("rows") or {}).items():
        first = sides.get("first_loss") if isinstance(sides, dict) else None
        if isinstance(first, dict) and "baseline" in first and "candidate" in first:
            out[name] = (list(first["baseline"]), list(first["candidate"]))
    return out


def _run_training_rows(loaded: LoadedExperiment, run: dict) -> list[dict]:
    """The training rows this run measured (the cpu profile's on a CPU run), as dicts."""
    settings = run.get("settings") or {}
    if "training" in settings:
        return list(settings["training"] or [])
    return [t.model_dump() for t in loaded.exp.training]


def _training_section(rows: list[dict], ev: G.Evidence, blocks: list[Block]) -> list[dict]:
    """Per training row: the same statistics as an operator row over timed optimizer steps, plus
    tokens/s (tokens per step / median step time), peak allocation, and first-step losses."""
    out = []
    for cfg in rows:
        name = cfg["name"]
        series = ev.training.get(name) or stats.Series()
        base, cand = series.samples("base"), series.samples("cand")
        sb, sc = stats.summarize(base), stats.summarize(cand)
        tokens = int(cfg["B"]) * int(cfg["T"])
        per_side: dict[str, dict[str, list]] = {"baseline": {}, "candidate": {}}
        for b in blocks:
            rec = b.train_rows.get(name) if b.status == "ok" or b.pair is not None else None
            if rec is None or b.side not in per_side:
                continue
            d = per_side[b.side]
            if rec.get("peak_bytes") is not None:
                d.setdefault("peaks", []).append(int(rec["peak_bytes"]))
            d.setdefault("final", []).append(rec.get("final_loss"))
            d.setdefault("curves", []).append(b.train_losses.get(name, []))
        peaks = {side: (max(d["peaks"]) if d.get("peaks") else None) for side, d in per_side.items()}
        delta = None if None in peaks.values() else peaks["candidate"] - peaks["baseline"]
        curves = {}
        for side, d in per_side.items():
            cs = [c for c in d.get("curves", []) if c]
            n = min((len(c) for c in cs), default=0)
            curves[side] = [sum(c[i] for c in cs) / len(cs) for i in range(n)]
        first_b, first_c = ev.training_first_loss.get(name, ([], []))
        tps = {side: (tokens / (s.median / 1e3) if s.n and s.median else None)
               for side, s in (("baseline", sb), ("candidate", sc))}
        out.append({
            "name": name, "config": {k: v for k, v in cfg.items() if k != "name"}, "tokens_per_step": tokens,
            "mode": "varlen" if cfg.get("varlen") else "dense",
            "baseline": sb.to_json(), "candidate": sc.to_json(),
            "blocks": {"baseline": len(series.pairs), "candidate": len(series.pairs)},
            "samples_ms": {"baseline": base, "candidate": cand},
            "speedup": stats.ratio_interval(series, "base", "cand").to_json(),
            "mann_whitney_p": stats.mann_whitney_p(base, cand) if base and cand else None,
            "tokens_per_s": tps,
            "peak_bytes": {**peaks, "delta": delta,
                           "delta_fraction": delta / peaks["baseline"] if delta is not None and peaks["baseline"] else None},
            "first_loss": G.first_loss_agreement(first_b, first_c, cfg.get("first_loss_rtol", G.DEFAULT_FIRST_LOSS_RTOL)),
            "final_loss": {side: d.get("final", []) for side, d in per_side.items()},
            "loss_curve": curves,
            "failures": ev.training_failures.get(name, []),
        })
    return out


def _training_blocks(record: dict | None) -> dict:
    """training.json rows {row: {baseline: [[ms...] per block], candidate: [...]}} as Series (older runs)."""
    if not record:
        return {}
    out = {}
    for name, sides in (record.get("rows") or {}).items():
        if isinstance(sides, dict) and "baseline" in sides and "candidate" in sides:
            out[name] = stats.Series.from_blocks(sides["baseline"], sides["candidate"])
    return out


def _terminal_reason(phases: dict[str, dict | None], attempts: list[dict], state: dict, run: dict,
                     given: str | None) -> str | None:
    """Why this run is a NO-GO whatever its gates say: given by the caller, a red baseline in the
    freeze record, a candidate that failed verification (the verify record), a failed Amdahl
    pre-gate in the profile record, a terminal state for this baseline SHA, or a verdict capped by
    the attempt limit when the run was logged (so a re-render agrees with the original)."""
    if given:
        return given
    freeze = phases.get("freeze") or {}
    base_sha = ((run.get("revisions") or {}).get("baseline") or {}).get("sha")
    if freeze.get("terminal") and freeze.get("baseline_sha") in (None, base_sha):
        return f"red baseline: {freeze.get('reason') or 'the baseline failed its own oracle'}"
    unverified = candidate_terminal(phases.get("verify"))
    if unverified:  # the run stopped there, or measured anyway with its NO-GO standing
        return unverified
    pregate = pregate_terminal(phases.get("profile"), bool(run.get("cpu_mode")))
    if pregate:  # the run stopped there, or measured anyway with its NO-GO standing
        return pregate
    if state.get("state") == "TERMINAL_NO_GO":
        term_sha = (state.get("terminal") or {}).get("baseline_sha")
        if term_sha is None or base_sha is None or term_sha == base_sha:
            return f"terminal NO-GO: {state.get('reason')}"
    for entry in attempts:
        if entry.get("type") == "attempt" and entry.get("run_id") == run.get("run_id") and entry.get("capped"):
            return (f"measured {entry.get('measured_verdict')}, capped to {entry.get('verdict')}: the experiment "
                    f"had used its attempts ({state.get('reason') or 'see the attempt history'})")
    return None


def _provenance(run: dict, run_dir: Path, exp=None) -> dict:
    revs = dict(run.get("revisions") or {})
    for side in ("baseline", "candidate"):
        # runs recorded before sides carried their env: take it from the experiment file the report
        # is rendered with (report.experiment.matches_run says whether that is the run's own);
        # an A/A run ran the baseline's env on both sides
        if isinstance(revs.get(side), dict) and "env" not in revs[side] and exp is not None:
            revs[side] = {**revs[side], "env": dict(getattr(exp, declared_side(side, bool(run.get("aa")))).env)}
    versions = run.get("versions") or {}
    device = run.get("device") or {}
    # BENCH_BASE is the freeze's fixture commit (verify.json), never the harness's own SHA
    verify = _read_json(run_dir / "verify.json", []) or {}  # damage: listed by _phases already
    bench_base = ({"sha": verify["bench_base_sha"], "branch": verify.get("bench_base_branch")}
                  if verify.get("bench_base_sha") else None)
    return {
        "repo": revs.get("repo"), "baseline": revs.get("baseline"), "candidate": revs.get("candidate"),
        "bench_base": bench_base, "commands": run.get("commands") or [], "host": run.get("host") or device.get("host"),
        "device": device, "versions": versions, "timing": run.get("timing") or {}, "dtype": run.get("dtype"),
        "slurm": run.get("slurm"), "run_dir": str(run_dir),
    }


def _measurement_section(m: Measurement, run: dict, rows: list[dict]) -> dict:
    """How the comparison was measured: the engine and its settings, rounds left out for throttling,
    and the A/A control over every row and basis (identical code: its 95% intervals should contain 1.0
    in about 95 of 100 rows; many more misses say the instrument is biased)."""
    settings = (run.get("settings") or {}).get("measure")
    aa = [(r["name"], b["basis"], b["aa_control"]) for r in rows for b in (r.get("bases") or {}).values()
          if b.get("aa_control") and b["aa_control"].get("lo") is not None]
    misses = [f"{name} ({basis}): {iv['point']:.4f} [{iv['lo']:.4f}, {iv['hi']:.4f}]"
              for name, basis, iv in aa if not iv["lo"] <= 1.0 <= iv["hi"]]
    return {
        "engine": m.engine, "settings": settings,
        "throttled_rounds": [{"shape": s, "mode": mo, "basis": b, "pair": p, "round": i, "why": why}
                             for s, mo, b, p, i, why in m.throttled],
        "aa_control": {"intervals": len(aa), "containing_one": len(aa) - len(misses), "misses": misses},
        "autotune": _autotune_section(m),
    }


def _autotune_section(m: Measurement) -> dict | None:
    """Did every worker run the same tuned configs? The (kernel, tuning key) on which workers chose
    differently (measure/detail/autotune.py), each with the row whose prepare first tuned it; None
    for a run recorded before workers reported their choices."""
    if not m.configs:
        return None
    differences = [{"row": m.config_rows[(d["kernel"], d["key"])], **d}
                   for d in autotune.disagreements(list(m.configs.values()))]
    return {"rows": len(set(m.config_rows.values())), "workers": len(m.configs), "tuned": len(m.config_rows),
            "differences": differences}


def _aa_noise(run: dict, rows: list[dict]) -> float | None:
    """On an A/A run (baseline on both sides) the noise floor is the widest row's half-width."""
    if not run.get("aa"):
        return None
    widths = [(r["speedup"]["hi"] - r["speedup"]["lo"]) / 2 for r in rows
              if r["speedup"].get("lo") is not None and r["speedup"].get("hi") is not None]
    return max(widths) if widths else None


# --- the report ----------------------------------------------------------------------------------

def _attempt_history(exp_dir: Path | None, damage: list[Damage] | None = None) -> tuple[list[dict], dict]:
    """The experiment's attempt log and its state (profile/<experiment>/attempts.jsonl, state.json)."""
    if exp_dir is None:
        return [], {}
    damage = [] if damage is None else damage  # a damaged log or state never stops a report
    return read_jsonl(exp_dir / "attempts.jsonl", damage), _read_json(exp_dir / "state.json", damage) or {}


def with_attempt_history(report: dict, loaded: LoadedExperiment, run_dir: Path) -> dict:
    """`report` with the attempt log as it stands now: `harness run` logs a run's attempt from the
    verdict of its report, then publishes the report with that attempt in its history."""
    attempts, state = _attempt_history(_experiment_dir(loaded, Path(run_dir)))
    return {**report, "phases": {**report["phases"], "attempts": _clean(attempts),
                                 "experiment_state": _clean(state) or None}}


def build_report(loaded_experiment: LoadedExperiment, run_dir: Path, terminal: str | None = None) -> dict:
    """report.json for one run directory (see module docstring). `terminal` names a reason the
    run stopped before candidate work (red baseline, failed pre-gate); it forces NO-GO."""
    loaded, run_dir = loaded_experiment, Path(run_dir)
    run = _read_run(run_dir)
    exp = loaded.exp
    damage: list[Damage] = []  # quarantined lines and unreadable records: the report lists them
    measurement = load_measurement(run_dir / "samples.jsonl", damage)
    blocks = measurement.workers
    shapes = _run_shapes(loaded, run)
    exp_dir = _experiment_dir(loaded, run_dir)
    phase_records, phase_verdicts = _phases(run_dir, exp_dir, damage)
    attempts, state = _attempt_history(exp_dir, damage)
    aa_file = _read_json(run_dir / "aa.json", damage) or {}
    # training rows are measured with the operator rows; a training.json phase record (older runs)
    # supplies rows the measurement lacks
    ev = G.evidence_from_measurement(exp, measurement, phases=phase_verdicts,
                                     training=_training_blocks(phase_records.get("training")),
                                     training_first_loss=_training_first_losses(phase_records.get("training")),
                                     aa_noise=aa_file.get("noise_floor"), shapes=shapes)
    results = G.evaluate_gates(exp, ev)
    terminal = _terminal_reason(phase_records, attempts, state, run, terminal)
    status = G.verdict(results, terminal=terminal)
    deciding_status = "FAIL" if any(r.status == "FAIL" for r in results) else "INCONCLUSIVE"
    deciding = [] if status == "GO" else [
        {"name": r.name, "kind": r.kind, "status": r.status, "reason": r.reason}
        for r in results if r.status == deciding_status]
    rows = _rows_section(shapes, list(exp.modes), ev, blocks)
    run_section = _run_section(run, run_dir, blocks)
    report = {
        "schema_version": SCHEMA_VERSION,
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "units": {"time": "ms", "memory": "bytes",
                  "speedup": "baseline time / candidate time: exp of the mean over worker pairs of each pair's "
                             "mean per-round log ratio of burst medians"},
        "experiment": _experiment_section(loaded, run),
        "run": run_section,
        "verdict": status,
        "deciding_gates": deciding,
        "terminal": terminal,
        "no_gpu_verdict": NO_GPU_VERDICT if run_section["cpu_mode"] else None,
        "gates": [r.to_json() for r in results],
        "rows": rows,
        "geomeans": _geomeans_section(loaded, shapes, ev),
        "training": _training_section(_run_training_rows(loaded, run), ev, blocks),
        "measurement": _measurement_section(measurement, run, rows),
        "aa_noise_floor": ev.aa_noise if ev.aa_noise is not None else _aa_noise(run, rows),
        "blocks": _blocks_section(blocks, _boost_mhz(run, blocks)),
        "failures": ev.failures,
        "phases": {**phase_records, "attempts": attempts, "experiment_state": state or None},
        "provenance": _provenance(run, run_dir, exp),
        "damage": [d.to_json() for d in damage],
    }
    return _clean(report)


def write_report(report: dict, out_dir: Path) -> Path:
    """Write report.json and the index.html rendered from it alone; returns the HTML path."""
    from harness.report import render_html

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1, sort_keys=True, allow_nan=False)
    (out_dir / "report.json").write_text(text + "\n")
    html_path = out_dir / "index.html"
    html_path.write_text(render_html(json.loads(text)))
    return html_path
