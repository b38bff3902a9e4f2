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
                          NonRegressionGate, PeakAllocGate, Shape, SpeedupGate, TrainingGate)

Status = Literal["PASS", "FAIL", "INCONCLUSIVE"]
Blocks = list[list[float]]
RowKey = tuple[str, str]  # (shape, mode)
CHUNK = 64  # tokens per chunk for NT and channels per tile for NK in byte expressions
EXPR_NAMES = ("B", "T", "H", "K", "V", "tokens", "NK", "NT")
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
    base_blocks: Blocks
    cand_blocks: Blocks
    base_peak: int | None = None
    cand_peak: int | None = None
    shape_dims: dict = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)  # per-block failures of this row, either side
    # summed device time per profiled call, per block (gates with basis: device)
    base_device: Blocks = field(default_factory=list)
    cand_device: Blocks = field(default_factory=list)

    def blocks(self, basis: str = "wall") -> tuple[Blocks, Blocks]:
        """(baseline, candidate) blocks of the call's wall-clock samples or of its summed device time."""
        return (self.base_device, self.cand_device) if basis == "device" else (self.base_blocks, self.cand_blocks)


@dataclass
class Evidence:
    rows: dict[RowKey, RowEvidence] = field(default_factory=dict)
    stages: dict[tuple[str, str, str], tuple[Blocks, Blocks]] = field(default_factory=dict)
    phases: dict[str, PhaseVerdict] = field(default_factory=dict)
    training: dict[str, tuple[Blocks, Blocks]] = field(default_factory=dict)
    # per training row: first-step loss of each (ok) block, (baseline, candidate), and its failures
    training_first_loss: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    training_failures: dict[str, list[dict]] = field(default_factory=dict)
    aa_noise: float | None = None  # A/A noise floor as a fraction; None when not measured
    failures: list[dict] = field(default_factory=list)


# --- byte expressions --------------------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ExprError(ValueError):
    pass


def eval_bytes_expr(expr: str, dims: dict) -> float:
    """Evaluate an arithmetic expression over B, T, H, K, V, tokens, NK, NT without `eval`:
    only numbers, those names, + - * / and parentheses are accepted."""
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
            if node.id not in EXPR_NAMES:
                raise ExprError(f"{expr!r}: unknown name {node.id!r} (allowed: {', '.join(EXPR_NAMES)})")
            if dims.get(node.id) is None:
                raise ExprError(f"{expr!r}: {node.id} is not known for this shape")
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
    """The names a byte expression may use. A varlen shape is packed into B=1, T=tokens, and NT
    counts the 64-token chunks summed over its sequences; a dense one has NT = ceil(T/64)."""
    if shape.seqlens is not None:
        B, T = 1, shape.tokens
        NT = sum(math.ceil(n / CHUNK) for n in shape.seqlens)
    else:
        B, T = shape.B, shape.T
        NT = math.ceil(T / CHUNK)
    return {"B": B, "T": T, "H": shape.H, "K": shape.K, "V": shape.V, "tokens": shape.tokens,
            "NK": math.ceil(shape.K / CHUNK), "NT": NT}


# --- shared pieces -------------------------------------------------------------------------------

def _row_name(row: str, mode: str) -> str:
    return f"{row}/{mode}"


def _iv_numbers(iv: stats.Interval, prefix: str = "") -> dict:
    return {f"{prefix}point": iv.point, f"{prefix}lo": iv.lo, f"{prefix}hi": iv.hi,
            f"{prefix}confidence": iv.confidence, f"{prefix}n_pairs": iv.n_blocks,
            f"{prefix}n_base_blocks": iv.n_base_blocks, f"{prefix}n_cand_blocks": iv.n_cand_blocks,
            f"{prefix}ci_method": iv.method, **({f"{prefix}note": iv.note} if iv.note else {})}


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _missing_side(name: str, base: Blocks | None, cand: Blocks | None) -> str | None:
    """Why a row cannot be judged (no record, or no samples on a side), or None."""
    if base is None or cand is None:
        return f"row {name}: no measurements"
    sides = [s for s, b in (("baseline", base), ("candidate", cand)) if not any(len(x) for x in b)]
    return f"row {name}: no samples on the {' and '.join(sides)} side" if sides else None


def _failure_text(failures: list[dict]) -> str:
    first = failures[0]
    where = f"{first['shape']}/{first.get('mode')}, " if first.get("shape") else ""
    return (f"{len(failures)} failure(s), first in block {first.get('block')} ({where}{first.get('side')}): "
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

def _basis_tag(basis: str) -> str:
    return " (device time)" if basis == "device" else ""


def _speedup(gate: SpeedupGate, ev: Evidence, seed: int) -> GateResult:
    name = _row_name(gate.row, gate.mode) + (f"/{gate.stage}" if gate.stage else "") + _basis_tag(gate.basis)
    row = ev.rows.get((gate.row, gate.mode))
    if gate.stage is not None:
        pair = ev.stages.get((gate.row, gate.mode, gate.stage))
        base, cand = pair if pair is not None else (None, None)
    else:
        base, cand = row.blocks(gate.basis) if row is not None else (None, None)
    numbers = {"threshold": gate.threshold, "stage": gate.stage, "basis": gate.basis}
    missing = _missing_side(name, base, cand)
    if missing:
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE", missing, numbers, [name])
    iv = stats.paired_block_speedup(base, cand, seed=seed)
    numbers.update(_iv_numbers(iv))
    status, reason = _threshold_status(iv, gate.threshold)
    status, reason = _no_pass_with_failures(status, reason, row.failures if row else [], name)
    return GateResult(gate.name, gate.kind, status, f"{name}: {reason}", numbers, [name])


def _geomean(gate: GeomeanGate, ev: Evidence, seed: int) -> GateResult:
    names = [_row_name(r, gate.mode) + _basis_tag(gate.basis) for r in gate.rows]
    numbers: dict = {"threshold": gate.threshold, "mode": gate.mode, "basis": gate.basis, "rows": {}}
    missing, failures, pairs = [], [], []
    for r, name in zip(gate.rows, names):
        row = ev.rows.get((r, gate.mode))
        base, cand = row.blocks(gate.basis) if row else (None, None)
        why = _missing_side(name, base, cand)
        if why:
            missing.append(why)
            continue
        failures += [f for f in row.failures if f not in failures]
        pairs.append((base, cand))
        iv = stats.paired_block_speedup(base, cand, seed=seed)
        numbers["rows"][name] = {"point": iv.point, "lo": iv.lo, "hi": iv.hi}
    if missing:
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE", "; ".join(missing), numbers, names)
    iv = stats.geomean_speedup(pairs, seed=seed)
    numbers.update(_iv_numbers(iv))
    status, reason = _threshold_status(iv, gate.threshold)
    status, reason = _no_pass_with_failures(status, f"geomean over {len(names)} rows: {reason}", failures,
                                            "set")
    return GateResult(gate.name, gate.kind, status, reason, numbers, names)


def _known(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _non_regression(gate: NonRegressionGate, ev: Evidence, seed: int, exp: Experiment | None) -> GateResult:
    if gate.rows == "all":
        shapes = [s.name for s in exp.shapes] if exp is not None else sorted({r for r, _ in ev.rows})
    else:
        shapes = list(gate.rows)
    keys = [(r, m) for r in shapes for m in gate.modes if exp is None or m in exp.modes]
    skipped = [m for m in gate.modes if exp is not None and m not in exp.modes]
    limit = 1 + gate.margin
    numbers: dict = {"margin": gate.margin, "limit": limit, "aa_noise": ev.aa_noise, "basis": gate.basis, "rows": {}}
    if skipped:
        numbers["modes_not_measured"] = skipped
    names = [_row_name(*k) + _basis_tag(gate.basis) for k in keys]
    # the A/A floor is a wall-clock spread; device time is judged against its own block spread
    aa_noise = ev.aa_noise if gate.basis == "wall" else None
    statuses: list[Status] = []
    notes: list[str] = []
    worst: tuple[float, str] | None = None
    for key, name in zip(keys, names):
        row = ev.rows.get(key)
        base, cand = row.blocks(gate.basis) if row else (None, None)
        why = _missing_side(name, base, cand)
        if why:
            statuses.append("INCONCLUSIVE")
            notes.append(why)
            numbers["rows"][name] = {"status": "INCONCLUSIVE", "reason": why}
            continue
        iv = stats.time_ratio(base, cand, seed=seed)
        st = _ratio_status(iv, limit)
        # "non-regressing within the margin outside noise": a regression FAILs only beyond both the
        # margin and the noise (the A/A floor, else the baseline's own block-to-block spread)
        row_noise = aa_noise if _known(aa_noise) else stats.block_spread(base)
        noise_note = ""
        if st == "FAIL" and _known(row_noise) and iv.lo is not None and iv.lo <= 1 + row_noise:
            st = "INCONCLUSIVE"
            noise_note = f" (within noise {row_noise:.4f})"
        st, why = _no_pass_with_failures(st, f"{name}: time ratio {_fmt(iv.point)} "
                                         f"[{_fmt(iv.lo)}, {_fmt(iv.hi)}] vs limit {limit:.4f}{noise_note}",
                                         row.failures, name)
        if st != "PASS" or row.failures:
            notes.append(f"{why} -> {st}")
        if iv.hi is not None and (worst is None or iv.hi > worst[0]):
            worst = (iv.hi, name)
        statuses.append(st)
        numbers["rows"][name] = {"status": st, "noise": row_noise, **_iv_numbers(iv)}
    if not keys:
        return GateResult(gate.name, gate.kind, "INCONCLUSIVE", "no rows to check", numbers, names)
    status = _combine(statuses)
    if status == "PASS":
        reason = f"every row's time-ratio upper bound <= {limit:.4f} (worst {worst[1]}: {worst[0]:.4f})"
    elif status == "FAIL":
        reason = "a row's time-ratio lower bound > " + f"{limit:.4f}" + " and beyond its noise"
    else:
        reason = "not every row is resolved within the margin"
    noise = aa_noise
    if gate.basis == "device":
        reason += ("; on summed device time (a regression must also exceed the baseline's own "
                   "block-to-block spread to FAIL)")
    elif noise is None or (isinstance(noise, float) and math.isnan(noise)):
        reason += ("; no A/A noise floor is known (a regression must also exceed the baseline's own "
                   "block-to-block spread to FAIL)")
    elif noise > gate.margin:
        reason += f"; the A/A noise floor {noise:.4f} is wider than the margin {gate.margin}"
        if status == "PASS":
            status = "INCONCLUSIVE"
            reason += ", so the margin cannot be resolved: INCONCLUSIVE, not PASS"
    else:
        reason += f"; A/A noise floor {noise:.4f} <= margin {gate.margin}"
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


def _phase(gate, ev: Evidence) -> GateResult:
    pv = ev.phases.get(gate.kind)
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


def _training(gate: TrainingGate, ev: Evidence, seed: int, exp: Experiment | None = None) -> GateResult:
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
        base, cand = ev.training.get(r, (None, None))
        why = _missing_side(r, base, cand)
        if why:
            neutral.append("INCONCLUSIVE")
            best.append("INCONCLUSIVE")
            notes.append(why)
            numbers["rows"][r] = {"status": "INCONCLUSIVE", "reason": why, "first_loss": agree,
                                  "failures": len(failures)}
            continue
        sp = stats.paired_block_speedup(base, cand, seed=seed)
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
                              "n_pairs": sp.n_blocks, "n_base_blocks": sp.n_base_blocks,
                              "n_cand_blocks": sp.n_cand_blocks, "first_loss": agree,
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


def evaluate_gate(gate, evidence: Evidence, seed: int = 0, exp: Experiment | None = None) -> GateResult:
    """Decide one gate from the evidence. `exp` resolves rows: 'all' and the shapes' dimensions."""
    if isinstance(gate, SpeedupGate):
        return _speedup(gate, evidence, seed)
    if isinstance(gate, GeomeanGate):
        return _geomean(gate, evidence, seed)
    if isinstance(gate, NonRegressionGate):
        return _non_regression(gate, evidence, seed, exp)
    if isinstance(gate, PeakAllocGate):
        return _peak_alloc(gate, evidence, exp)
    if isinstance(gate, (CorrectnessGate, FrozenPathsGate, AmdahlGate, NcuGate, AgreementGate)):
        return _phase(gate, evidence)
    if isinstance(gate, TrainingGate):
        return _training(gate, evidence, seed, exp)
    raise TypeError(f"unknown gate type {type(gate).__name__}")


def evaluate_gates(exp: Experiment, evidence: Evidence, seed: int | None = None) -> list[GateResult]:
    """Every gate of the experiment, in declaration order (seed defaults to the experiment's)."""
    s = exp.seed if seed is None else seed
    return [evaluate_gate(g, evidence, seed=s, exp=exp) for g in exp.gates]


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


def training_from_blocks(blocks) -> tuple[dict[str, tuple[Blocks, Blocks]], dict[str, tuple[list[float], list[float]]]]:
    """(timed step times per block, first-step loss per block), per training row and side, from
    the 'ok' blocks in block-index order (like the operator rows). A block counts for a row only
    when the row finished in it (its train_row record)."""
    times: dict[str, tuple[Blocks, Blocks]] = {}
    first: dict[str, tuple[list[float], list[float]]] = {}
    for b in sorted((b for b in blocks if b.status == "ok"), key=lambda b: b.index):
        side = 0 if b.side == "baseline" else 1 if b.side == "candidate" else None
        if side is None:
            continue
        for name, rec in getattr(b, "train_rows", {}).items():
            ms = b.train_ms.get(name) or []
            if ms:
                times.setdefault(name, ([], []))[side].append(list(ms))
            if rec.get("first_loss") is not None:
                first.setdefault(name, ([], []))[side].append(float(rec["first_loss"]))
    return times, first


def evidence_from_blocks(exp: Experiment, blocks, shape_dims_by_row: dict[str, dict] | None = None, *,
                         phases: dict[str, PhaseVerdict] | None = None,
                         training: dict[str, tuple[Blocks, Blocks]] | None = None,
                         training_first_loss: dict[str, tuple[list[float], list[float]]] | None = None,
                         aa_noise: float | None = None, shapes: Sequence[Shape] | None = None) -> Evidence:
    """Per-row block lists from completed `records.Block`s, in block-index order per side, so the
    i-th baseline block pairs with the i-th candidate block.

    Only blocks with status 'ok' contribute samples, stage times and peaks; a block that has no
    samples for a row (that shape failed in it) is left out of that row's list. Failures of every
    completed block are kept, per row and overall. A side's peak is the largest seen in its blocks.
    `shapes` overrides exp.shapes (e.g. the cpu profile's shapes); dimensions come from
    `shape_dims_by_row` when given, else from the shapes."""
    shape_list = list(shapes) if shapes is not None else list(exp.shapes)
    dims = {s.name: shape_dims(s) for s in shape_list}
    dims.update(shape_dims_by_row or {})
    ordered = sorted((b for b in blocks if b.status in ("ok", "failed")), key=lambda b: b.index)
    ev = Evidence(phases=dict(phases or {}), training=dict(training or {}),
                  training_first_loss=dict(training_first_loss or {}), aa_noise=aa_noise)
    train_names = {t.name for t in exp.training} | set(ev.training)
    keys = [(s.name, m) for s in shape_list for m in exp.modes]
    for key in keys:
        ev.rows[key] = RowEvidence([], [], None, None, dims.get(key[0], {}))
    peaks: dict[tuple[RowKey, str], list[int]] = {}
    stage_lists: dict[tuple[str, str, str], tuple[Blocks, Blocks]] = {}
    for b in ordered:
        side = 0 if b.side == "baseline" else 1 if b.side == "candidate" else None
        for f in b.failures:
            rec = {"block": b.index, "side": b.side, **f}
            ev.failures.append(rec)
            row = ev.rows.get((f.get("shape"), f.get("mode")))
            if row is not None:
                row.failures.append(rec)
            if f.get("mode") == TRAIN_MODE:
                ev.training_failures.setdefault(f.get("shape"), []).append(rec)
        if b.status != "ok":
            # a failed block takes every row's samples with it: no row may PASS on the rest
            rec = {"block": b.index, "side": b.side, "shape": None, "mode": None, "error": b.error or "block failed"}
            ev.failures.append(rec)
            for row in ev.rows.values():
                row.failures.append(rec)
            for name in train_names:
                ev.training_failures.setdefault(name, []).append(rec)
            continue
        if side is None:
            continue
        for key, ms in b.samples.items():
            if not ms:
                continue
            row = ev.rows.setdefault(key, RowEvidence([], [], None, None, dims.get(key[0], {})))
            (row.base_blocks, row.cand_blocks)[side].append(list(ms))
        for key, ms in b.stage_samples.items():
            if ms:
                stage_lists.setdefault(key, ([], []))[side].append(list(ms))
        for key in set(b.samples) | set(b.device_samples) | set(b.kernels):
            dev = b.device_ms(key)
            if dev:
                row = ev.rows.setdefault(key, RowEvidence([], [], None, None, dims.get(key[0], {})))
                (row.base_device, row.cand_device)[side].append(dev)
        for key, nbytes in b.peaks.items():
            peaks.setdefault((key, b.side), []).append(int(nbytes))
    for (key, side_name), values in peaks.items():
        row = ev.rows.setdefault(key, RowEvidence([], [], None, None, dims.get(key[0], {})))
        if side_name == "baseline":
            row.base_peak = max(values)
        else:
            row.cand_peak = max(values)
    ev.stages = stage_lists
    return ev
