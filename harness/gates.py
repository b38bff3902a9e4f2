"""Gates and the verdict (design: harness.md, "Gates and the verdict").

Every gate ends PASS, FAIL or INCONCLUSIVE and carries the numbers it used. Missing evidence
(no samples for a row on a side, no peak, no phase record) is INCONCLUSIVE, never PASS.
Timing gates read `Evidence`, built from completed block records by `evidence_from_blocks`;
evidence gates (correctness, frozen paths, Amdahl, ncu) are decided by their phase modules and
arrive here as a `PhaseVerdict`.
"""
from __future__ import annotations

import ast
import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Literal, Sequence

from harness import stats
from harness.spec import (AgreementGate, AmdahlGate, CorrectnessGate, Experiment, FrozenPathsGate, GeomeanGate, NcuGate,
                          NonRegressionGate, PeakAllocGate, PytestGate, Shape, SpeedupGate, TrainingGate)

Status = Literal["PASS", "FAIL", "INCONCLUSIVE"]
Blocks = list[list[float]]
RowKey = tuple[str, str]  # (shape, mode)
CHUNK = 64  # tokens per chunk for NT and channels per tile for NK in byte expressions
PHASE_KINDS = ("correctness", "frozen_paths", "amdahl", "ncu", "agreement")


@dataclass
class PhaseVerdict:
    """What an evidence phase hands over; status None means the phase could not decide."""

    status: Literal["PASS", "FAIL"] | None
    reason: str = ""
    numbers: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict | None) -> "PhaseVerdict | None":
        """From a phase record's `gate` field ({status, reason, numbers}); None stays None."""
        if d is None:
            return None
        return cls(status=d.get("status"), reason=d.get("reason", ""), numbers=dict(d.get("numbers") or {}))


@dataclass
class GateResult:
    name: str
    kind: str
    status: Status
    reason: str
    numbers: dict = field(default_factory=dict)
    rows: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class RowEvidence:
    """Everything measured of one (shape, mode): per timing basis its nested rounds (stats.Series:
    "graph", "eager" from the lockstep rounds or the first engine's blocks, "device" from profiled
    calls), which basis "auto" means for it, peaks, dims, failures, and how its rounds ended."""

    series: dict[str, stats.Series] = field(default_factory=dict)
    primary: str = "eager"
    base_peak: int | None = None
    cand_peak: int | None = None
    shape_dims: dict = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)  # failures that touch this row, either side
    graph_reason: str | None = None  # why the row has no graph basis
    stops: dict[str, dict] = field(default_factory=dict)  # basis -> its row_end record (what ended its rounds)
    excluded: dict[str, int] = field(default_factory=dict)  # basis -> rounds left out (throttled)
    retimed: dict[str, int] = field(default_factory=dict)  # basis -> calls timed again (late replays)

    @classmethod
    def from_blocks(cls, base_blocks: Blocks, cand_blocks: Blocks, base_device: Blocks = (),
                    cand_device: Blocks = (), **kw) -> "RowEvidence":
        """The first engine's per-block samples (pairs by position), eager and device."""
        series = {"eager": stats.Series.from_blocks(base_blocks, cand_blocks)}
        if base_device or cand_device:
            series["device"] = stats.Series.from_blocks(base_device, cand_device)
        return cls(series, **kw)

    def basis(self, basis: str = "auto") -> str:
        """The basis a gate's `basis` reads on this row ("auto": the row's primary)."""
        return self.primary if basis == "auto" else basis

    def get(self, basis: str = "auto") -> stats.Series | None:
        return self.series.get(self.basis(basis))


@dataclass
class Evidence:
    rows: dict[RowKey, RowEvidence] = field(default_factory=dict)
    stages: dict[tuple[str, str, str], stats.Series] = field(default_factory=dict)
    phases: dict[str, PhaseVerdict] = field(default_factory=dict)
    training: dict[str, stats.Series] = field(default_factory=dict)
    # per training row: first-step loss of each (ok) worker, (baseline, candidate), and its failures
    training_first_loss: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    training_failures: dict[str, list[dict]] = field(default_factory=dict)
    aa_noise: float | None = None  # an A/A run's noise floor given for the whole run (aa.json); None when not
    failures: list[dict] = field(default_factory=list)


# --- byte expressions --------------------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ExprError(ValueError):
    pass


def eval_bytes_expr(expr: str, dims: dict) -> float:
    """Evaluate an arithmetic expression over a row's dimension names (`shape_dims`) without
    `eval`: only numbers, those names, + - * / and parentheses are accepted."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"{expr!r} is not an arithmetic expression: {e.msg}") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in dims or dims[node.id] is None:
                raise ExprError(f"{expr!r}: {node.id} is not a dimension of this shape "
                                f"(it has {', '.join(k for k, v in dims.items() if v is not None)})")
            return dims[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ExprError(f"{expr!r}: division by zero")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ExprError(f"{expr!r}: {type(node).__name__} is not allowed (numbers, names, + - * / and parentheses only)")

    return float(ev(tree))


def shape_dims(shape: Shape) -> dict:
    """The names a byte expression may use: every declared dimension of the shape, and the derived
    tokens (B*T, or the sum of seqlens), NT (64-token chunks: ceil(T/64), summed over the sequences
    of a varlen shape) and NK (ceil(K/64)) where the shape has what they are made of. A varlen
    shape is packed into B=1, T=tokens."""
    dims = dict(shape.dims)
    if shape.seqlens is not None:
        dims.update(B=1, T=shape.tokens, NT=sum(math.ceil(n / CHUNK) for n in shape.seqlens))
    elif "T" in dims:
        dims["NT"] = math.ceil(dims["T"] / CHUNK)
    if shape.tokens is not None:
        dims["tokens"] = shape.tokens
    if "K" in dims:
        dims["NK"] = math.ceil(dims["K"] / CHUNK)
    return dims


# --- shared pieces -------------------------------------------------------------------------------

def _row_name(row: str, mode: str) -> str:
    return f"{row}/{mode}"


def _iv_numbers(iv: stats.Interval, prefix: str = "") -> dict:
    return {f"{prefix}point": iv.point, f"{prefix}lo": iv.lo, f"{prefix}hi": iv.hi,
            f"{prefix}confidence": iv.confidence, f"{prefix}n_pairs": iv.n_blocks, f"{prefix}n_rounds": iv.n_rounds,
            f"{prefix}n_base_blocks": iv.n_base_blocks, f"{prefix}n_cand_blocks": iv.n_cand_blocks,
            f"{prefix}ci_method": iv.method, **({f"{prefix}note": iv.note} if iv.note else {})}


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _missing_side(name: str, series: stats.Series | None) -> str | None:
    """Why a row cannot be judged (no record, or no samples on a side), or None."""
    if series is None or not series:
        return f"row {name}: no measurements"
    sides = [s for s, f in (("baseline", "base"), ("candidate", "cand")) if not series.has(f)]
    return f"row {name}: no samples on the {' and '.join(sides)} side" if sides else None


def _failure_text(failures: list[dict]) -> str:
    first = failures[0]
    where = f"{first['shape']}/{first.get('mode')}, " if first.get("shape") else ""
    # a lockstep failure is a worker's (its id is the record's block), the first engine's a block's
    who = (f"worker {first.get('block')} of pair {first['pair']}" if first.get("pair") is not None
           else f"block {first.get('block')}")
    return (f"{len(failures)} failure(s), first in {who} ({where}{first.get('side')}): "
            f"{first.get('error')}")


def _threshold_status(iv: stats.Interval, s: float) -> tuple[Status, str]:
    """Speedup rule: PASS if lo >= s; FAIL if hi < s; else INCONCLUSIVE."""
    if iv.lo is None or iv.hi is None:
        return "INCONCLUSIVE", f"no confidence interval ({iv.note or 'too few blocks'})"
    ci = f"{iv.point:.4f}x [{iv.lo:.4f}, {iv.hi:.4f}]"
    if iv.lo >= s:
        return "PASS", f"speedup {ci}: lower bound >= {s}"
    if iv.hi < s:
        return "FAIL", f"speedup {ci}: upper bound < {s}"
    return "INCONCLUSIVE", f"speedup {ci} straddles {s}"


def _ratio_status(iv: stats.Interval, limit: float) -> Status:
    """Non-regression rule on a candidate/baseline time ratio: PASS if hi <= limit; FAIL if lo > limit."""
    if iv.lo is None or iv.hi is None:
        return "INCONCLUSIVE"
    if iv.hi <= limit:
        return "PASS"
    if iv.lo > limit:
        return "FAIL"
    return "INCONCLUSIVE"


def _combine(statuses: Sequence[Status]) -> Status:
    if any(s == "FAIL" for s in statuses):
        return "FAIL"
    if statuses and all(s == "PASS" for s in statuses):
        return "PASS"
    return "INCONCLUSIVE"


def _no_pass_with_failures(status: Status, reason: str, failures: list[dict], name: str) -> tuple[Status, str]:
    """A row that failed in some block cannot PASS on the blocks that survived."""
    if failures and status == "PASS":
        return "INCONCLUSIVE", f"{reason}; but row {name} has {_failure_text(failures)}"
    if failures:
        return status, f"{reason}; row {name} has {_failure_text(failures)}"
    return status, reason


# --- the gates ---------------------------------------------------------------------------------

def _basis_tag(row: RowEvidence | None, basis: str) -> str:
    """' (graph)' etc. for a reason: the basis a row was judged on, with what 'auto' resolved to."""
    used = row.basis(basis) if row is not None else basis
    return f" ({used})"


def _speedup(gate: SpeedupGate, ev: Evidence) -> GateResult:
    row = ev.rows.get((gate.row, gate.mode))
    if gate.stage is not None:
        name = shown = _row_name(gate.row, gate.mode) + f"/{gate.stage}"
        series = ev.stages.get((gate.row, gate.mode, gate.stage))
    else:
        name = _row_name(gate.row, gate.mode)
        shown = name + _basis_tag(row, gate.basis)
        series = row.get(gate.basis) if row is not None else None
    numbers = {"threshold": gate.threshold, "stage": gate.stage,
               "basis": "device" if gate.stage else (row.basis(gate.basis) if row else gate.basis)}
    missing = _missing_side(shown, series)
    if missing:
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE", missing, numbers, [name])
    iv = stats.ratio_interval(series, "base", "cand")
    numbers.update(_iv_numbers(iv))
    status, reason = _threshold_status(iv, gate.threshold)
    status, reason = _no_pass_with_failures(status, reason, row.failures if row else [], name)
    return GateResult(gate.name, gate.kind, status, f"{shown}: {reason}", numbers, [name])


def _geomean(gate: GeomeanGate, ev: Evidence) -> GateResult:
    rows = [ev.rows.get((r, gate.mode)) for r in gate.rows]
    names = [_row_name(r, gate.mode) for r in gate.rows]
    numbers: dict = {"threshold": gate.threshold, "mode": gate.mode, "basis": gate.basis, "rows": {}}
    missing, failures, series_list = [], [], []
    for row, name in zip(rows, names):
        series = row.get(gate.basis) if row else None
        why = _missing_side(name + _basis_tag(row, gate.basis), series)
        if why:
            missing.append(why)
            continue
        failures += [f for f in row.failures if f not in failures]
        series_list.append(series)
        iv = stats.ratio_interval(series, "base", "cand")
        numbers["rows"][name] = {"point": iv.point, "lo": iv.lo, "hi": iv.hi, "basis": row.basis(gate.basis)}
    if missing:
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE", "; ".join(missing), numbers, names)
    iv = stats.geomean_interval(series_list, "base", "cand")
    numbers.update(_iv_numbers(iv))
    status, reason = _threshold_status(iv, gate.threshold)
    status, reason = _no_pass_with_failures(status, f"geomean over {len(names)} rows: {reason}", failures,
                                            "set")
    return GateResult(gate.name, gate.kind, status, reason, numbers, names)


def _known(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def noise_floor(series: stats.Series, run_floor: float | None = None) -> tuple[float | None, str]:
    """(floor, where it comes from): how far from 1.0 a comparison of identical code lands on this row.
    The A/A control (a baseline twin in every pair, measured in the same rounds) gives the largest
    deviation its 95% interval allows, max(1 - lo, hi - 1); without one, an A/A run's floor for
    the whole run (aa.json), else the baseline's own spread between pairs (a weaker stand-in)."""
    if series.has("control"):
        aa = stats.ratio_interval(series, "control", "base")
        if aa.lo is not None:
            return max(1 - aa.lo, aa.hi - 1, 0.0), (f"A/A control {aa.point:.4f} [{aa.lo:.4f}, {aa.hi:.4f}] "
                                                    f"over {aa.n_blocks} pairs")
    if _known(run_floor):
        return run_floor, "the A/A run's noise floor"
    spread = stats.pair_spread(series, "base")
    return (spread if _known(spread) else None), "the baseline's spread between worker pairs"


def _non_regression(gate: NonRegressionGate, ev: Evidence, exp: Experiment | None) -> GateResult:
    if gate.rows == "all":
        shapes = [s.name for s in exp.shapes] if exp is not None else sorted({r for r, _ in ev.rows})
    else:
        shapes = list(gate.rows)
    keys = [(r, m) for r in shapes for m in gate.modes if exp is None or m in exp.modes]
    skipped = [m for m in gate.modes if exp is not None and m not in exp.modes]
    limit = 1 + gate.margin
    numbers: dict = {"margin": gate.margin, "limit": limit, "basis": gate.basis, "rows": {}}
    if skipped:
        numbers["modes_not_measured"] = skipped
    names = [_row_name(*k) for k in keys]
    statuses: list[Status] = []
    notes: list[str] = []
    worst: tuple[float, str] | None = None
    for key, name in zip(keys, names):
        row = ev.rows.get(key)
        series = row.get(gate.basis) if row else None
        shown = name + _basis_tag(row, gate.basis)
        why = _missing_side(shown, series)
        if why:
            statuses.append("INCONCLUSIVE")
            notes.append(why)
            numbers["rows"][name] = {"status": "INCONCLUSIVE", "reason": why}
            continue
        iv = stats.ratio_interval(series, "cand", "base")
        floor, source = noise_floor(series, ev.aa_noise if row.basis(gate.basis) != "device" else None)
        # PASS needs the upper bound inside the margin AND evidence that identical code resolves
        # within the margin; FAIL needs the lower bound beyond both the margin and that noise
        st = _ratio_status(iv, limit)
        extra = ""
        if st == "PASS" and not (_known(floor) and floor < gate.margin):
            st = "INCONCLUSIVE"
            extra = (f" (noise floor {floor:.4f} from {source} is not below the margin)" if _known(floor)
                     else " (no noise floor: the margin is not shown to be resolvable)")
        elif st == "FAIL" and _known(floor) and iv.lo is not None and iv.lo <= 1 + floor:
            st = "INCONCLUSIVE"
            extra = f" (within noise {floor:.4f} from {source})"
        st, why = _no_pass_with_failures(st, f"{shown}: time ratio {_fmt(iv.point)} "
                                         f"[{_fmt(iv.lo)}, {_fmt(iv.hi)}] vs limit {limit:.4f}{extra}",
                                         row.failures, name)
        if st != "PASS" or row.failures:
            notes.append(f"{why} -> {st}")
        if iv.hi is not None and (worst is None or iv.hi > worst[0]):
            worst = (iv.hi, shown)
        statuses.append(st)
        numbers["rows"][name] = {"status": st, "basis": row.basis(gate.basis), "noise": floor, "noise_source": source,
                                 **_iv_numbers(iv)}
    if not keys:
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE", "no rows to check", numbers, names)
    status = _combine(statuses)
    if status == "PASS":
        reason = (f"every row's time-ratio upper bound <= {limit:.4f} (worst {worst[1]}: {worst[0]:.4f}), "
                  f"every row's noise floor < {gate.margin}")
    elif status == "FAIL":
        reason = f"a row's time-ratio lower bound > {limit:.4f} and beyond its noise"
    else:
        reason = "not every row is resolved within the margin"
    if notes:
        reason += " | " + "; ".join(notes)
    return GateResult(gate.name, gate.kind, status, reason, numbers, names)


def _peak_alloc(gate: PeakAllocGate, ev: Evidence, exp: Experiment | None) -> GateResult:
    names = [_row_name(r, gate.mode) for r in gate.rows]
    numbers: dict = {"expression": gate.min_reduction_bytes, "mode": gate.mode, "rows": {}}
    statuses: list[Status] = []
    notes: list[str] = []
    for r, name in zip(gate.rows, names):
        row = ev.rows.get((r, gate.mode))
        dims = dict(row.shape_dims) if row is not None and row.shape_dims else {}
        if not dims and exp is not None:
            try:
                dims = shape_dims(exp.shape(r))
            except KeyError:
                pass
        entry: dict = {"base_peak": row.base_peak if row else None, "cand_peak": row.cand_peak if row else None}
        numbers["rows"][name] = entry
        try:
            need = eval_bytes_expr(gate.min_reduction_bytes, dims)
        except ExprError as e:
            statuses.append("INCONCLUSIVE")
            notes.append(f"{name}: {e}")
            entry["status"] = "INCONCLUSIVE"
            continue
        entry["min_reduction_bytes"] = need
        if row is None or row.base_peak is None or row.cand_peak is None:
            side = "no record" if row is None else ", ".join(
                s for s, p in (("baseline", row.base_peak), ("candidate", row.cand_peak)) if p is None) + " peak missing"
            statuses.append("INCONCLUSIVE")
            notes.append(f"{name}: {side}")
            entry["status"] = "INCONCLUSIVE"
            continue
        reduction = row.base_peak - row.cand_peak
        st, why = _no_pass_with_failures("PASS" if reduction >= need else "FAIL",
                                         f"{name}: reduction {reduction} B vs required {need:.0f} B", row.failures, name)
        entry.update(reduction=reduction, status=st)
        if st != "PASS":
            notes.append(why)
        statuses.append(st)
    status = _combine(statuses)
    reason = {"PASS": f"every row's peak fell by at least {gate.min_reduction_bytes} bytes",
              "FAIL": "a row's peak did not fall by the required bytes",
              "INCONCLUSIVE": "peak evidence is missing or incomplete for some row"}[status]
    if notes:
        reason += " | " + "; ".join(notes)
    return GateResult(gate.name, gate.kind, status, reason, numbers, names)


def phase_key(gate) -> str:
    """The key of a gate's PhaseVerdict in Evidence.phases: its kind (one phase decides every gate
    of that kind), or pytest:<name> (each pytest gate runs its own test file)."""
    return f"pytest:{gate.name}" if isinstance(gate, PytestGate) else gate.kind


def _phase(gate, ev: Evidence) -> GateResult:
    pv = ev.phases.get(phase_key(gate))
    rows = [gate.row] if isinstance(gate, (AmdahlGate, NcuGate)) else list(getattr(gate, "rows", []) or [])
    if pv is None:
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE", f"no {gate.kind} record: missing evidence", {}, rows)
    numbers = dict(pv.numbers)
    if pv.status not in ("PASS", "FAIL"):
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE",
                          f"the {gate.kind} phase reached no decision" + (f": {pv.reason}" if pv.reason else ""),
                          numbers, rows)
    return GateResult(gate.name, gate.kind, pv.status, pv.reason or f"{gate.kind} phase: {pv.status}", numbers, rows)


DEFAULT_FIRST_LOSS_RTOL = 1e-3


def first_loss_agreement(base: list[float] | None, cand: list[float] | None, rtol: float) -> dict:
    """Do the two sides' first-step losses agree (same seed, same data)? Every block's first loss on
    either side is compared with the baseline's median: agree when the largest relative deviation
    is <= rtol. `status` is PASS / FAIL, or INCONCLUSIVE when a side has no first loss."""
    out: dict = {"baseline": list(base or []), "candidate": list(cand or []), "rtol": rtol}
    if not base or not cand:
        side = " and ".join(s for s, v in (("baseline", base), ("candidate", cand)) if not v)
        return {**out, "status": "INCONCLUSIVE", "reason": f"no first-step loss on the {side} side"}
    values = sorted(base)
    ref = values[len(values) // 2] if len(values) % 2 else 0.5 * (values[len(values) // 2 - 1] + values[len(values) // 2])
    if not all(math.isfinite(x) for x in [*base, *cand]):
        return {**out, "reference": ref, "status": "FAIL", "reason": "a first-step loss is not finite"}
    worst = max(abs(x - ref) for x in [*base, *cand])
    rel = worst / max(abs(ref), 1e-12)
    cand_dev = max(abs(x - ref) for x in cand) / max(abs(ref), 1e-12)
    status = "PASS" if rel <= rtol else "FAIL"
    reason = (f"first-step loss baseline {ref:.6g} (median of {len(base)}), candidate "
              f"{min(cand):.6g}..{max(cand):.6g}: largest relative deviation {rel:.3g} "
              f"{'<=' if status == 'PASS' else '>'} rtol {rtol:g}")
    return {**out, "reference": ref, "max_abs_diff": worst, "max_rel_diff": rel, "candidate_max_rel_diff": cand_dev,
            "status": status, "reason": reason}


def _first_loss_rtol(exp: Experiment | None, row: str) -> float:
    for t in (exp.training if exp is not None else []):
        if t.name == row:
            return t.first_loss_rtol
    return DEFAULT_FIRST_LOSS_RTOL


def _training(gate: TrainingGate, ev: Evidence, exp: Experiment | None = None) -> GateResult:
    limit = 1 + gate.neutral_margin
    numbers: dict = {"neutral_margin": gate.neutral_margin, "limit": limit,
                     "min_best_speedup": gate.min_best_speedup, "rows": {}}
    neutral: list[Status] = []
    best: list[Status] = []
    losses: list[Status] = []
    notes: list[str] = []
    for r in gate.rows:
        fb, fc = ev.training_first_loss.get(r, (None, None))
        agree = first_loss_agreement(fb, fc, _first_loss_rtol(exp, r))
        losses.append(agree["status"])
        if agree["status"] != "PASS":
            notes.append(f"{r}: {agree['reason']} -> {agree['status']}")
        failures = ev.training_failures.get(r, [])
        if failures:
            notes.append(f"{r}: {_failure_text(failures)}")
        series = ev.training.get(r)
        why = _missing_side(r, series)
        if why:
            neutral.append("INCONCLUSIVE")
            best.append("INCONCLUSIVE")
            notes.append(why)
            numbers["rows"][r] = {"status": "INCONCLUSIVE", "reason": why, "first_loss": agree,
                                  "failures": len(failures)}
            continue
        sp = stats.ratio_interval(series, "base", "cand")
        tr = stats.reciprocal(sp)
        n_st = _ratio_status(tr, limit)
        b_st: Status = ("INCONCLUSIVE" if sp.lo is None else "PASS" if sp.lo >= gate.min_best_speedup
                        else "FAIL" if sp.hi < gate.min_best_speedup else "INCONCLUSIVE")
        if failures:  # a row that failed in some block cannot pass on the blocks that survived
            n_st = "INCONCLUSIVE" if n_st == "PASS" else n_st
            b_st = "INCONCLUSIVE" if b_st == "PASS" else b_st
        neutral.append(n_st)
        best.append(b_st)
        if n_st != "PASS":
            notes.append(f"{r}: time ratio {_fmt(tr.point)} [{_fmt(tr.lo)}, {_fmt(tr.hi)}] vs {limit:.4f} -> {n_st}")
        numbers["rows"][r] = {"neutral": n_st, "speedup_point": sp.point, "speedup_lo": sp.lo,
                              "speedup_hi": sp.hi, "time_ratio_lo": tr.lo, "time_ratio_hi": tr.hi,
                              "n_pairs": sp.n_blocks, "n_rounds": sp.n_rounds, "first_loss": agree,
                              "failures": len(failures)}
    # at least one row must show the speedup: PASS if any row's lower bound reaches it, FAIL only
    # if every row's upper bound is below it
    best_status: Status = ("PASS" if "PASS" in best else "FAIL" if best and all(b == "FAIL" for b in best)
                           else "INCONCLUSIVE")
    neutral_status = _combine(neutral)  # a missing row is INCONCLUSIVE here, so never PASS
    loss_status = _combine(losses)  # a first-step loss mismatch beyond tolerance fails the gate
    numbers.update(neutral_status=neutral_status, best_speedup_status=best_status, first_loss_status=loss_status)
    status = _combine([neutral_status, best_status, loss_status])
    reason = (f"neutral within {gate.neutral_margin}: {neutral_status}; "
              f"best speedup lower bound >= {gate.min_best_speedup}: {best_status}; "
              f"first-step losses agree: {loss_status}")
    if notes:
        reason += " | " + "; ".join(notes)
    return GateResult(gate.name, gate.kind, status, reason, numbers, list(gate.rows))


def evaluate_gate(gate, evidence: Evidence, exp: Experiment | None = None) -> GateResult:
    """Decide one gate from the evidence. `exp` resolves rows: 'all' and the shapes' dimensions."""
    if isinstance(gate, SpeedupGate):
        return _speedup(gate, evidence)
    if isinstance(gate, GeomeanGate):
        return _geomean(gate, evidence)
    if isinstance(gate, NonRegressionGate):
        return _non_regression(gate, evidence, exp)
    if isinstance(gate, PeakAllocGate):
        return _peak_alloc(gate, evidence, exp)
    if isinstance(gate, (CorrectnessGate, FrozenPathsGate, AmdahlGate, NcuGate, AgreementGate, PytestGate)):
        return _phase(gate, evidence)
    if isinstance(gate, TrainingGate):
        return _training(gate, evidence, exp)
    raise TypeError(f"unknown gate type {type(gate).__name__}")


def evaluate_gates(exp: Experiment, evidence: Evidence) -> list[GateResult]:
    """Every gate of the experiment, in declaration order."""
    return [evaluate_gate(g, evidence, exp=exp) for g in exp.gates]


def verdict(results: Sequence[GateResult], terminal: str | None = None) -> Literal["GO", "NO-GO", "INCONCLUSIVE"]:
    """GO when every gate passes; NO-GO when any fails or `terminal` is set (a red baseline, a
    failed pre-gate, a stopped experiment); INCONCLUSIVE otherwise (including no gates at all)."""
    if terminal:
        return "NO-GO"
    statuses = [r.status for r in results]
    if any(s == "FAIL" for s in statuses):
        return "NO-GO"
    if statuses and all(s == "PASS" for s in statuses):
        return "GO"
    return "INCONCLUSIVE"


# --- from block records --------------------------------------------------------------------------

TRAIN_MODE = "train"  # the mode of a training row's failure records (harness/training.py)


def worker_series(workers, get) -> stats.Series:
    """One round per pair of a per-worker quantity (`get(worker)`: its samples of a row, its profiled
    calls' stage or device times, its timed training steps). Lockstep workers pair by their pair id;
    the first engine's blocks by position among the blocks that have the quantity (the i-th such
    baseline block with the i-th such candidate block), as that engine always paired them."""
    if any(w.pair is not None for w in workers):
        by_pair: dict[int, dict] = {}
        for w in workers:
            by_pair.setdefault(w.pair, {})[w.side] = w
        out = stats.Series()
        for pair in sorted(by_pair):
            sides = by_pair[pair]
            b = get(sides["baseline"]) if "baseline" in sides else None
            c = get(sides["candidate"]) if "candidate" in sides else None
            if b and c:
                out.add(pair, stats.Round(list(b), list(c)))
        return out
    ordered = sorted(workers, key=lambda w: w.index)
    base = [list(get(w)) for w in ordered if w.side == "baseline" and get(w)]
    cand = [list(get(w)) for w in ordered if w.side == "candidate" and get(w)]
    return stats.Series.from_blocks(base, cand)


def evidence_from_measurement(exp: Experiment, m, *, phases: dict[str, PhaseVerdict] | None = None,
                              training: dict[str, stats.Series] | None = None,
                              training_first_loss: dict[str, tuple[list[float], list[float]]] | None = None,
                              aa_noise: float | None = None, shapes: Sequence[Shape] | None = None) -> Evidence:
    """Evidence from a run's `records.Measurement` (either engine).

    Timed bases come from the measurement's rounds (lockstep) or its ok blocks (the first engine:
    the eager basis); device and stage times, peaks, training rows and failures from the workers
    (blocks). A failed block of the first engine took every row's samples with it, and a lost
    lockstep worker may have been lost to the code under test: either is a failure on every row, so
    no row may PASS on what survived. A side's peak is the largest its workers saw. `shapes`
    overrides exp.shapes (the cpu profile's on a CPU run). `training` and `training_first_loss`
    supply rows the measurement lacks (older runs' training.json)."""
    shape_list = list(shapes) if shapes is not None else list(exp.shapes)
    dims = {s.name: shape_dims(s) for s in shape_list}
    lockstep = m.engine != "blocks"
    workers = [w for w in m.workers if lockstep or w.status in ("ok", "failed")]
    ok = [w for w in workers if lockstep or w.status == "ok"]
    ev = Evidence(phases=dict(phases or {}), training=dict(training or {}),
                  training_first_loss=dict(training_first_loss or {}), aa_noise=aa_noise)
    train_names = {t.name for t in exp.training} | set(ev.training)
    keys = [(s.name, mo) for s in shape_list for mo in exp.modes]
    keys += sorted({(sh, mo) for sh, mo, _ in m.series if mo != TRAIN_MODE} - set(keys))
    keys += sorted({k for w in ok for k in (*w.samples, *w.peaks)} - set(keys))
    for key in keys:
        row = ev.rows[key] = RowEvidence(shape_dims=dims.get(key[0], {}))
        row.series = {basis: series for (sh, mo, basis), series in m.series.items() if (sh, mo) == key}
        if not lockstep:
            row.series["eager"] = worker_series(ok, lambda w: w.samples.get(key))
        device = worker_series(ok, lambda w: w.device_ms(key))
        if device:
            row.series["device"] = device
        method = m.methods.get(key)
        if method is not None:
            row.primary, row.graph_reason = method.primary, method.graph_reason
        row.stops = {b: {k: v for k, v in asdict(e).items() if k not in ("attempt", "shape", "mode")}
                     for (sh, mo, b), e in m.row_ends.items() if (sh, mo) == key}
        row.excluded = {b: n for (sh, mo, b), n in m.excluded.items() if (sh, mo) == key}
        row.retimed = {b: n for (sh, mo, b), n in m.retimed.items() if (sh, mo) == key}
        for side in ("baseline", "candidate"):
            peaks = [w.peaks[key] for w in ok if w.side == side and key in w.peaks]
            if peaks:
                setattr(row, "base_peak" if side == "baseline" else "cand_peak", max(peaks))
    for w in workers:
        origin = {"block": w.index, "side": w.side, **({"pair": w.pair} if w.pair is not None else {})}
        for f in w.failures:
            rec = {**origin, **f}
            ev.failures.append(rec)
            row = ev.rows.get((f.get("shape"), f.get("mode")))
            if row is not None:
                row.failures.append(rec)
            if f.get("mode") == TRAIN_MODE:
                ev.training_failures.setdefault(f.get("shape"), []).append(rec)
        if w.status == "failed":
            rec = {**origin, "shape": None, "mode": None,
                   "error": w.error or ("block failed" if not lockstep else "worker lost")}
            ev.failures.append(rec)
            for row in ev.rows.values():
                row.failures.append(rec)
            for name in train_names:
                ev.training_failures.setdefault(name, []).append(rec)
    for key in sorted({k for w in ok for k in w.stage_samples}):
        series = worker_series(ok, lambda w: w.stage_samples.get(key))
        if series:
            ev.stages[key] = series
    for name in sorted({n for w in ok for n in w.train_rows}):
        finished = [w for w in ok if name in w.train_rows]
        series = m.series.get((name, TRAIN_MODE, "eager")) if lockstep else worker_series(
            finished, lambda w: w.train_ms.get(name))
        if series:
            ev.training[name] = series
        first = tuple([float(w.train_rows[name]["first_loss"]) for w in sorted(finished, key=lambda w: w.index)
                       if w.side == side and w.train_rows[name].get("first_loss") is not None]
                      for side in ("baseline", "candidate"))
        if first[0] or first[1]:
            ev.training_first_loss[name] = first
    return ev


def evidence_from_blocks(exp: Experiment, blocks, **kw) -> Evidence:
    """Evidence from the first engine's completed blocks (see evidence_from_measurement)."""
    from harness.records import Measurement

    return evidence_from_measurement(exp, Measurement("blocks", list(blocks), {}), **kw)
