"""Profile first: stage attribution of the untouched baseline and the Amdahl pre-gate.

`profile_run` runs harness/profile_worker.py in a fresh process on the BASELINE worktree (side env
and Triton cache from harness.measure.sides.side_env) at the experiment's `profile.rows` (plus any
Amdahl gate's row), modes fwdbwd (and fwd when the experiment declares it), and writes
`run_dir/profile.json` (the worker's job, raw result and log go to run_dir/profile-work/):

    {schema, experiment, side: "baseline", sha, worktree, cpu_mode, device, versions, dtype, iters,
     warmup, timing {endpoint, l2_flush, device}, copy_bandwidth {bytes_per_s, buffer_bytes, ...},
     stages {stage: [baseline patterns]}, stage_visible {stage: bool}, notes [str], errors [..],
     rows: [{row "<shape>/<mode>", shape, mode, dims {B,T,H,K,V,tokens,NK,NT}, error,
             endpoint_ms, endpoint_samples_ms, device_total_ms, device_total_samples_ms,
             gap_ms (endpoint - device total: host launch overhead and gaps),
             stages {stage: {ms, samples_ms, share_wall, share_device, kernels}},
             unassigned_ms, unassigned [{name, ms, launches}],
             kernels [{name, ms, launches, stage, share_device}]   (largest first),
             stage_share_wall {stage..., unassigned, host/gaps}    (stacked bars, wall denominator),
             stage_share_device {stage..., unassigned}             (stacked bars, device denominator),
             removable [{name, expr, bytes_per_pass, passes, bytes, floor_ms}],
             removable_bytes, removable_floor_ms}],
     gates [{name, stage, row, status, reason, numbers}],
     gate {status PASS|FAIL|null, reason, numbers}}

Medians over the `iters` calls: endpoint_ms, device_total_ms, each stage's ms and unassigned_ms.
Per kernel: the mean ms and launches per profiled call (so a kernel's rows add up).

Denominators. "wall": the endpoint as the caller sees it (CUDA events around the whole call, host
launch overhead and gaps included). "device": the summed device time of every kernel of the call.
A stage's share is its kernel time over either; the gate uses the one the AmdahlGate declares and
the record shows both.

Amdahl bounds with T the denominator's time: removing the `removable` traffic (bytes x passes at the
measured copy bandwidth, capped at the stage's own time) bounds the full-op speedup at
T / (T - removable_ms); removing the whole stage at T / (T - stage_ms) (looser). The gate PASSes
when share >= min_share and the removable bound >= min_bound under the declared denominator (the
whole-stage bound when no `removable` is declared); else FAIL, a terminal NO-GO before candidate
work. It is INCONCLUSIVE (status null) when the evidence is missing: a failed row, an error below, or
stages that are invisible on this machine.

Errors (the record's `errors`, each naming what is wrong): a kernel whose deciding name matches two
stages; a stage pattern that matches nothing; a removable expression that does not evaluate; the
op or the worker failing. The "matches nothing" rule: on GPU every stage must match at least one
kernel in the profiled fwdbwd calls (the union over rows; fwd calls lack backward stages), and the
gated stage must match in the gated row. On CPU stage patterns are matched against op and
record_function names; GPU kernel names (Triton under the interpreter) are invisible there. So on
CPU the same rule applies only when the op exposes stage names at all (some stage matched
something); when no stage matches anything on CPU, every stage is recorded as not visible, with a
note, and the gate is INCONCLUSIVE.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness import children
from harness.gates import ExprError, eval_bytes_expr, shape_dims
from harness.measure.sides import side_env
from harness.spec import AmdahlGate, LoadedExperiment, Shape

SCHEMA_VERSION = 1
GATED_MODE = "fwdbwd"
COPY_BYTES_GPU = 1 << 30  # 1 GiB: well past any L2
COPY_BYTES_CPU = 64 << 20
BAD_INPUT_ERRORS = ("overlap", "stage_unmatched", "removable_expr")


class ProfileError(Exception):
    """The profile cannot be set up (no profile section, a row with no shape)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# --- what to measure ---------------------------------------------------------------------------

def pregate_terminal(record: dict | None, cpu_mode: bool) -> str | None:
    """The terminal reason a failed Amdahl pre-gate gives a run (None when it passed, was
    inconclusive, or the run is a CPU smoke test, whose timings decide nothing). One wording for
    the run that stops on it and for any later re-render of that run."""
    gate = (record or {}).get("gate") or {}
    if gate.get("status") == "FAIL" and not cpu_mode:
        return f"Amdahl pre-gate failed: {gate.get('reason')}"
    return None


def profile_shapes(loaded: LoadedExperiment, cpu_mode: bool) -> list[Shape]:
    """The shapes of `profile.rows` and of every Amdahl gate's row. On CPU with a `cpu:` profile,
    only the rows it has a stand-in for (a GPU-sized row under the interpreter would take hours);
    without one, the declared shapes."""
    exp = loaded.exp
    if exp.profile is None:
        raise ProfileError(f"experiment {exp.name!r} has no `profile:` section")
    names = list(exp.profile.rows)
    names += [g.row for g in amdahl_gates(loaded) if g.row not in names]  # a gated row is always profiled
    if cpu_mode and exp.cpu is not None:
        cpu_shapes = {s.name: s for s in exp.cpu.shapes}
        return [cpu_shapes[name] for name in names if name in cpu_shapes]
    return [exp.shape(name) for name in names]


def profile_modes(loaded: LoadedExperiment) -> list[str]:
    return [GATED_MODE] + (["fwd"] if "fwd" in loaded.exp.modes else [])


def amdahl_gates(loaded: LoadedExperiment) -> list[AmdahlGate]:
    return [g for g in loaded.exp.gates if isinstance(g, AmdahlGate)]


def build_job(loaded: LoadedExperiment, worktree: str, out_path: Path, cpu_mode: bool) -> dict:
    exp = loaded.exp
    shapes = profile_shapes(loaded, cpu_mode)
    _, inputs_fn = exp.target.inputs.split(":")
    cpu = exp.cpu if cpu_mode else None
    return {
        "out_path": str(out_path.resolve()), "worktree": worktree, "op": exp.baseline.op or exp.target.op,
        "inputs_file": str(loaded.inputs_file), "inputs_fn": inputs_fn,
        "rows": [(s.model_dump(exclude_none=True), m) for s in shapes for m in profile_modes(loaded)],
        "dtype": "float32" if cpu_mode else exp.dtype, "seed": exp.seed,
        "warmup": cpu.warmup if cpu is not None else exp.warmup,
        # on CPU each interpreted call costs seconds and shows no stage: the cpu profile's count
        "iters": cpu.profile_iters if cpu is not None else exp.profile.iters,
        "timing": "wall" if cpu_mode else exp.timing,
        "l2_flush": exp.l2_flush and not cpu_mode,
        "stage_patterns": {name: list(p.baseline) for name, p in exp.stages.items()},
        "copy_bytes": COPY_BYTES_CPU if cpu_mode else COPY_BYTES_GPU,
    }


# --- from the worker's result to the record ----------------------------------------------------

def _row_record(raw: dict, stages: list[str], loaded: LoadedExperiment, bandwidth: float | None,
                errors: list[dict]) -> dict:
    shape = Shape.model_validate(raw["shape_dims"])
    dims = shape_dims(shape)
    row = {"row": f"{raw['shape']}/{raw['mode']}", "shape": raw["shape"], "mode": raw["mode"], "dims": dims,
           "error": raw.get("error")}
    if raw.get("error") or "kernels" not in raw:
        row["error"] = row["error"] or "no measurement"
        return row
    wall = _median(raw["endpoint_samples_ms"])
    dev = _median(raw["device_total_samples_ms"])
    row.update(endpoint_ms=wall, endpoint_samples_ms=raw["endpoint_samples_ms"], device_total_ms=dev,
               device_total_samples_ms=raw["device_total_samples_ms"], gap_ms=wall - dev)

    def share(ms: float, total: float | None) -> float | None:
        return ms / total if total else None

    row["stages"] = {}
    for s in stages:
        samples = raw["stage_samples_ms"][s]
        ms = _median(samples) or 0.0
        row["stages"][s] = {"ms": ms, "samples_ms": samples, "share_wall": share(ms, wall),
                            "share_device": share(ms, dev),
                            "kernels": sum(1 for k in raw["kernels"] if k["stage"] == s)}
    row["unassigned_ms"] = _median(raw["unassigned_samples_ms"]) or 0.0
    row["unassigned"] = [{"name": k["name"], "ms": k["ms"], "launches": k["launches"]}
                         for k in raw["kernels"] if k["stage"] is None]
    row["kernels"] = [{**k, "share_device": share(k["ms"], dev)} for k in raw["kernels"]]
    row["stage_share_wall"] = {s: row["stages"][s]["share_wall"] or 0.0 for s in stages}
    row["stage_share_wall"]["unassigned"] = share(row["unassigned_ms"], wall) or 0.0
    row["stage_share_wall"]["host/gaps"] = max(0.0, share(wall - dev, wall) or 0.0)
    row["stage_share_device"] = {s: row["stages"][s]["share_device"] or 0.0 for s in stages}
    row["stage_share_device"]["unassigned"] = share(row["unassigned_ms"], dev) or 0.0

    removable, total_bytes, floor = [], 0.0, 0.0
    for r in loaded.exp.profile.removable:
        try:
            per_pass = eval_bytes_expr(r.bytes, dims)
        except ExprError as e:
            errors.append({"kind": "removable_expr", "row": row["row"], "removable": r.name,
                           "message": f"profile.removable {r.name!r}: {e}"})
            continue
        nbytes = per_pass * r.passes
        ms = nbytes / bandwidth * 1e3 if bandwidth else None
        removable.append({"name": r.name, "expr": r.bytes, "bytes_per_pass": per_pass, "passes": r.passes,
                          "bytes": nbytes, "floor_ms": ms})
        total_bytes += nbytes
        floor = floor + ms if (ms is not None and floor is not None) else None
    row.update(removable=removable, removable_bytes=total_bytes, removable_floor_ms=floor if removable else 0.0)
    return row


def _bound(total: float | None, removed: float | None) -> float | None:
    """T / (T - removed); inf when the removed part is all of T; None without a total."""
    if not total or removed is None:
        return None
    return math.inf if removed >= total else total / (total - removed)


def amdahl_verdict(gate: AmdahlGate, row: dict | None, has_removable: bool, cpu_mode: bool = False) -> dict:
    """{name, stage, row, status, reason, numbers} for one Amdahl gate from its row's record."""
    out = {"name": gate.name, "stage": gate.stage, "row": f"{gate.row}/{GATED_MODE}"}
    numbers: dict = {"stage": gate.stage, "row": gate.row, "mode": GATED_MODE, "denominator": gate.denominator,
                     "min_share": gate.min_share, "min_bound": gate.min_bound, "cpu_mode": cpu_mode}
    if row is None or row.get("error") or gate.stage not in (row.get("stages") or {}):
        why = (row or {}).get("error") or "the row was not profiled"
        return {**out, "status": None, "reason": f"no profile of {gate.row}/{GATED_MODE}: {why}", "numbers": numbers}
    st = row["stages"][gate.stage]
    if st["kernels"] == 0:
        return {**out, "status": None, "numbers": numbers,
                "reason": f"stage {gate.stage!r} ran no kernel at {gate.row}/{GATED_MODE}: its share cannot be measured"}
    stage_ms = st["ms"]
    floor = row.get("removable_floor_ms")
    removed = min(floor, stage_ms) if floor is not None else None  # the removable part lies inside the stage
    totals = {"wall": row["endpoint_ms"], "device": row["device_total_ms"]}
    for d, T in totals.items():
        numbers[f"share_{d}"] = stage_ms / T if T else None
        numbers[f"bound_removable_{d}"] = _bound(T, removed) if has_removable else None
        numbers[f"bound_stage_{d}"] = _bound(T, stage_ms)
    numbers.update(endpoint_ms=totals["wall"], device_total_ms=totals["device"], stage_ms=stage_ms,
                   removable_bytes=row.get("removable_bytes"), removable_floor_ms=floor,
                   removable_ms_used=removed if has_removable else None,
                   removable_capped_at_stage=bool(has_removable and floor is not None and floor > stage_ms))
    d, other = gate.denominator, ("device" if gate.denominator == "wall" else "wall")
    share = numbers[f"share_{d}"]
    bound = numbers[f"bound_removable_{d}"] if has_removable else numbers[f"bound_stage_{d}"]
    numbers.update(share=share, bound=bound, bound_kind="removable" if has_removable else "whole stage",
                   other_denominator=other)
    if share is None or bound is None:
        return {**out, "status": None, "reason": "no time to divide by", "numbers": _json_numbers(numbers)}
    ok_share, ok_bound = share >= gate.min_share, bound >= gate.min_bound
    status = "PASS" if ok_share and ok_bound else "FAIL"
    label = {"wall": "wall-clock endpoint", "device": "summed device time"}

    def fb(b):
        return "unbounded" if b is not None and math.isinf(b) else ("n/a" if b is None else f"{b:.3f}x")

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    what = (f"removing {removed:.4g} ms of removable traffic ({row.get('removable_bytes', 0):.4g} B)"
            if has_removable else "removing the whole stage")
    reason = (f"{gate.stage} is {share:.1%} of the {label[d]} of {gate.row}/{GATED_MODE} "
              f"({totals[d]:.4g} ms; {label[other]}: {pct(numbers[f'share_{other}'])} of {totals[other]:.4g} ms); "
              f"{what} bounds the speedup at {fb(bound)} under {d} "
              f"({fb(numbers[f'bound_removable_{other}'] if has_removable else numbers[f'bound_stage_{other}'])} under {other}"
              + (f"; whole stage {fb(numbers[f'bound_stage_{d}'])}" if has_removable else "") + "); "
              f"needs share >= {gate.min_share:.0%} {'ok' if ok_share else 'FAILS'} and bound >= {gate.min_bound}x "
              f"{'ok' if ok_bound else 'FAILS'}; gated on the {d} denominator")
    if status == "FAIL":
        reason = "terminal NO-GO before candidate work: " + reason
    if cpu_mode:
        reason += " [CPU smoke test]"
    return {**out, "status": status, "reason": reason, "numbers": _json_numbers(numbers)}


def _json_numbers(numbers: dict) -> dict:
    """inf -> None with a flag (profile.json stays strict JSON)."""
    out = {}
    for k, v in numbers.items():
        if isinstance(v, float) and math.isinf(v):
            out[k], out[f"{k}_unbounded"] = None, True
        else:
            out[k] = v
    return out


def combine(gates: list[dict], errors: list[dict]) -> dict:
    """One {status, reason, numbers} for the amdahl kind: any FAIL fails; all PASS passes; errors or
    an INCONCLUSIVE gate leave it INCONCLUSIVE (status null)."""
    if errors:
        return {"status": None, "reason": "profile error: " + "; ".join(e["message"] for e in errors),
                "numbers": {"errors": [e["message"] for e in errors]}}
    if not gates:
        return {"status": None, "reason": "the experiment declares no amdahl gate", "numbers": {}}
    if len(gates) == 1:
        g = gates[0]
        return {"status": g["status"], "reason": g["reason"], "numbers": g["numbers"]}
    statuses = [g["status"] for g in gates]
    status = "FAIL" if "FAIL" in statuses else "PASS" if all(s == "PASS" for s in statuses) else None
    return {"status": status, "reason": " | ".join(f"{g['name']}: {g['reason']}" for g in gates),
            "numbers": {"gates": {g["name"]: g["numbers"] for g in gates}}}


def build_record(loaded: LoadedExperiment, raw: dict, cpu_mode: bool, side: dict | None = None) -> dict:
    """profile.json from the worker's raw result (pure: no processes, no files)."""
    exp = loaded.exp
    stages = list(exp.stages)
    errors = [dict(e) for e in raw.get("errors", [])]
    bw = (raw.get("copy_bandwidth") or {}).get("bytes_per_s")
    rows = [_row_record(r, stages, loaded, bw, errors) for r in raw.get("rows", [])]
    notes: list[str] = []
    measured = [r for r in rows if not r.get("error")]
    scope = [r for r in measured if r["mode"] == GATED_MODE] or measured
    visible = {s: any(r["stages"][s]["kernels"] > 0 for r in scope) for s in stages}
    if scope and stages:
        if cpu_mode and not any(visible.values()):
            notes.append("no stage pattern matches any CPU op or record_function name: the stages are not "
                         "visible on CPU (GPU kernel names are), so no share is measured here")
        else:
            for s in stages:
                if not visible[s]:
                    errors.append({"kind": "stage_unmatched", "stage": s,
                                   "message": f"stage {s!r}: its baseline patterns {exp.stages[s].baseline} "
                                              f"match no kernel in the profiled {GATED_MODE} calls"})
    by_row = {r["row"]: r for r in rows}
    has_rem = bool(exp.profile.removable)
    gates = [amdahl_verdict(g, by_row.get(f"{g.row}/{GATED_MODE}"), has_rem, cpu_mode) for g in amdahl_gates(loaded)]
    if cpu_mode and stages and scope and not any(visible.values()):
        for g in gates:
            g["status"], g["reason"] = None, f"stage {g['stage']!r} is not visible on CPU: no share measured"
    record = {
        "schema": SCHEMA_VERSION, "experiment": exp.name, "side": "baseline", **(side or {}),
        "cpu_mode": cpu_mode, "device": raw.get("device"), "versions": raw.get("versions"),
        "op_file": raw.get("op_file"), "timing": raw.get("timing"),
        "iters": exp.profile.iters, "copy_bandwidth": raw.get("copy_bandwidth"),
        "stages": {s: list(exp.stages[s].baseline) for s in stages}, "stage_visible": visible,
        "removable": [r.model_dump() for r in exp.profile.removable],
        "rows": rows, "errors": errors, "notes": notes, "gates": gates,
        "gate": combine(gates, errors),
    }
    return record


# --- the phase ---------------------------------------------------------------------------------

def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str, allow_nan=False))
    tmp.replace(path)


def measure(loaded: LoadedExperiment, worktree: str, work_dir: Path, profile_root: Path, cpu_mode: bool,
            log: Callable[[str], None] = print) -> dict:
    """Run the profile worker on `worktree` in a fresh process; its raw result (errors included)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    out_path = work_dir / "profile-raw.json"
    out_path.unlink(missing_ok=True)
    job = build_job(loaded, worktree, out_path, cpu_mode)
    job_path = work_dir / "profile-job.json"
    job_path.write_text(json.dumps(job, indent=1))
    log_path = work_dir / "profile-worker.log"
    log(f"profile: baseline at {len(job['rows'])} rows x {job['iters']} iters ({worktree})")
    with log_path.open("w") as out:
        proc = children.run([sys.executable, "-m", "harness.profile_worker", str(job_path)], cwd=work_dir,
                            env=side_env(loaded, "baseline", profile_root, cpu_mode),
                            stdout=out, stderr=subprocess.STDOUT)
    if not out_path.is_file():
        tail = log_path.read_text()[-2000:]
        return {"rows": [], "errors": [{"kind": "worker_failed",
                                        "message": f"profile worker exited {proc.returncode} without a result: {tail}"}]}
    return json.loads(out_path.read_text())


def profile_run(loaded: LoadedExperiment, revisions, run_dir: Path, profile_root: Path, cpu_mode: bool = False,
                log: Callable[[str], None] = print) -> dict:
    """Profile the baseline, decide the Amdahl pre-gate, write run_dir/profile.json; return the record."""
    run_dir = Path(run_dir)
    base = revisions.baseline
    started = _now()
    raw = measure(loaded, base.worktree, run_dir / "profile-work", Path(profile_root), cpu_mode, log)
    record = build_record(loaded, raw, cpu_mode, side={"sha": base.sha, "ref": base.ref, "worktree": base.worktree})
    record.update(started=started, finished=_now())
    _write_json(run_dir / "profile.json", record)
    g = record["gate"]
    log(f"profile: amdahl pre-gate {g['status'] or 'INCONCLUSIVE'}: {g['reason']}")
    return record


def exit_code(record: dict) -> int:
    """0 PASS, 1 FAIL, 2 bad input or an error, 3 INCONCLUSIVE (the gate could not decide)."""
    if record.get("errors"):
        return 2
    return {"PASS": 0, "FAIL": 1}.get(record["gate"]["status"], 3)
