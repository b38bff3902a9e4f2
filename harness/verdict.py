"""Verdict lines: the at-a-glance reading of one report.json, shared by every format.

One `VerdictLine` per measured (row, mode): the time each side took on the basis the row's gates
read (median, p10 and p90), the speedup with its 95% interval, the marks of every gate that
judged the row, and the dims the row really ran at. `Verdict` adds the gates (deciding first,
each with a one-line summary). The terminal table, `harness report --format md|junit`, the
compare table and the HTML verdict box are all rendered from these (harness/formats.py,
harness/report.py), so a number reads the same everywhere.

Report fields are read through the accessors below (`row_bases`, `row_primary_basis`,
`row_basis`, `row_dims`, `row_stop`, `row_aa`, `row_plan`): each reads the measurement details of a
schema-2 row (its `bases` map: per basis the timings, what ended its rounds, the A/A control,
worker pairs and rounds) and falls back to what schema-1 reports have (`baseline`/`candidate`/
`speedup` on wall-clock time, `device_ms` on summed device time). New row fields plug in there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

STATUSES = ("PASS", "FAIL", "INCONCLUSIVE")  # the one word for each gate status, everywhere
SUMMARY_CHARS = 160  # a gate summary longer than this is cut at a word; the full reason is kept
# shape names as declared; the dims a byte expression may use are derived, so not shown again
DIM_KEYS = ("B", "T", "H", "K", "V")


# --- accessors: the one place that knows where a row keeps its numbers ---------------------------

def _interval(d) -> dict | None:
    return d if isinstance(d, dict) and d.get("point") is not None else None


def row_bases(row: dict) -> dict[str, dict]:
    """{basis: {"baseline": summary, "candidate": summary, "speedup": interval, ...}} for every
    timing basis the row measured: the row's `bases` map (graph, eager, device, each also with its
    A/A control, pairs, rounds and what ended it); for reports before it, the wall-clock fields and
    the summed device time (medians only)."""
    bases = row.get("bases")
    if isinstance(bases, dict) and bases:
        return {str(k): {**v, "baseline": v.get("baseline") or {}, "candidate": v.get("candidate") or {},
                         "speedup": v.get("speedup") or {}} for k, v in bases.items() if isinstance(v, dict)}
    out = {"wall": {"baseline": row.get("baseline") or {}, "candidate": row.get("candidate") or {},
                    "speedup": row.get("speedup") or {}}}
    dv = row.get("device_ms")
    if isinstance(dv, dict) and (dv.get("baseline") is not None or dv.get("candidate") is not None):
        out["device"] = {"baseline": {"median": dv.get("baseline")}, "candidate": {"median": dv.get("candidate")},
                         "speedup": dv.get("speedup") or {}}
    return out


def row_primary_basis(row: dict) -> str:
    """The basis a gate declared `auto` reads on this row (its `primary_basis`; wall-clock before)."""
    bases = row_bases(row)
    primary = row.get("primary_basis")
    return primary if primary in bases else next(iter(bases))


def row_basis(row: dict, gate_bases: list[str] = ()) -> str:
    """The basis a line shows: the first one a gate on this row reads, else the row's primary."""
    bases = row_bases(row)
    for b in gate_bases:
        if b in bases:
            return b
    return row_primary_basis(row)


def row_stop(row: dict, basis: str) -> str | None:
    """What ended the row's rounds on `basis` (resolved, budget, limit, fixed, failed), when recorded."""
    stop = row_bases(row).get(basis, {}).get("stop")
    if isinstance(stop, dict):
        return stop.get("reason")
    return stop if isinstance(stop, str) else None


def row_aa(row: dict, basis: str) -> dict | None:
    """The A/A control interval on `basis` (baseline against a baseline twin) when measured."""
    return _interval(row_bases(row).get(basis, {}).get("aa_control"))


def row_plan(row: dict, basis: str) -> dict:
    """How the row was measured on `basis`: worker pairs and rounds, else (older reports) blocks."""
    entry = row_bases(row).get(basis, {})
    out = {k: entry[k] for k in ("pairs", "rounds") if isinstance(entry.get(k), int)}
    if not out and isinstance(row.get("blocks"), dict):
        out = {"blocks": row["blocks"]}
    return out


def row_dims(row: dict) -> dict:
    """The dims the row ran at (B, T, H, K, V; the cpu profile's on a CPU run)."""
    dims = row.get("dims") or {}
    return {k: dims[k] for k in DIM_KEYS if dims.get(k) is not None}


def dims_text(dims: dict) -> str:
    """`B4 T2048 H16 K128 V128`: the dims of a row, compact enough for a table cell."""
    return " ".join(f"{k}{v}" for k, v in dims.items()) or "n/a"


def _shape_dims(shape: dict) -> dict:
    """A declared shape's dims as a row reports them: a varlen shape runs packed, B=1 and T=tokens."""
    if shape.get("seqlens"):
        shape = {**shape, "B": 1, "T": sum(shape["seqlens"])}
    return {k: shape[k] for k in DIM_KEYS if shape.get(k) is not None}


def declared_dims(report: dict) -> dict[str, dict]:
    """Each declared shape's dims by name (the experiment file's shapes, GPU-sized)."""
    return {s["name"]: _shape_dims(s)
            for s in (report.get("experiment") or {}).get("shapes") or [] if isinstance(s, dict) and "name" in s}


# --- gates -------------------------------------------------------------------------------------

def gate_basis(gate: dict, row_name: str | None = None) -> str | None:
    """The timing basis a gate reads (timing gates carry it in their numbers; `auto` is each row's
    primary basis, resolved per row in numbers.rows where the gate judges several)."""
    numbers = gate.get("numbers") or {}
    for name, entry in (numbers.get("rows") or {}).items() if row_name else ():
        if gate_row_matches(str(name), row_name) and isinstance(entry, dict) and isinstance(entry.get("basis"), str):
            return entry["basis"]
    b = numbers.get("basis")
    return b if isinstance(b, str) else None


def gate_row_matches(gate_row: str, row_name: str) -> bool:
    """A gate names a row as `shape/mode`, optionally followed by `/stage` or ` (device time)`."""
    return gate_row == row_name or gate_row.startswith((row_name + "/", row_name + " "))


def gate_row_status(gate: dict, row_name: str) -> str | None:
    """The gate's status for one row: its per-row status where it keeps one (non_regression,
    peak_alloc), else the gate's own status when it names the row; None when it does not."""
    per_row = (gate.get("numbers") or {}).get("rows")
    if isinstance(per_row, dict):
        for name, entry in per_row.items():
            if gate_row_matches(str(name), row_name) and isinstance(entry, dict) and entry.get("status"):
                return entry["status"]
    if any(gate_row_matches(str(r), row_name) for r in gate.get("rows") or []):
        return gate.get("status")
    return None


def _cut(text: str, limit: int = SUMMARY_CHARS) -> str:
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " …"


def gate_summary(gate: dict) -> str:
    """One line for a gate: per-row counts for gates that judge many rows, the bound for the Amdahl
    pre-gate, else the reason's head (before its ' | ' per-row notes), cut at a word."""
    numbers = gate.get("numbers") or {}
    reason = str(gate.get("reason") or "")
    per_row = numbers.get("rows")
    if isinstance(per_row, dict) and per_row and all(isinstance(e, dict) and "status" in e for e in per_row.values()):
        counts = {s: [n for n, e in per_row.items() if e["status"] == s] for s in STATUSES}
        parts = [f"{len(counts[s])} {s}" for s in ("FAIL", "INCONCLUSIVE", "PASS") if counts[s]]
        text = f"{len(per_row)} row{'s' if len(per_row) != 1 else ''}: " + ", ".join(parts)
        worst = next((counts[s] for s in ("FAIL", "INCONCLUSIVE") if counts[s]), None)
        if worst:
            name = worst[0]
            e = per_row[name]
            if e.get("point") is not None and e.get("lo") is not None:
                limit = numbers.get("limit")
                text += (f"; first: {name} ratio {e['point']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"
                         + (f" vs limit {limit:.3f}" if isinstance(limit, (int, float)) else ""))
            elif e.get("reduction") is not None and e.get("min_reduction_bytes") is not None:
                text += f"; first: {name} reduction {e['reduction']:,} B < {e['min_reduction_bytes']:,.0f} B"
            else:
                text += f"; first: {name}"
        return _cut(text)
    if gate.get("kind") == "amdahl" and isinstance(numbers.get("bound"), (int, float)) and numbers.get("min_bound"):
        share = numbers.get("share")
        share_text = (f"; share {share:.1%} (needs {numbers['min_share']:.0%})"
                      if isinstance(share, (int, float)) and numbers.get("min_share") else "")
        return _cut(f"bound {numbers['bound']:.3f}x (needs {numbers['min_bound']}x){share_text}")
    return _cut(reason.split(" | ", 1)[0])


def short_reason(text: str | None) -> str | None:
    """The head of a long reason ("Amdahl pre-gate failed: ..." -> "Amdahl pre-gate failed")."""
    if not text:
        return None
    head = text.split(": ", 1)[0]
    return head if len(head) <= 60 else _cut(text, 60)


# --- lines -------------------------------------------------------------------------------------

@dataclass
class Side:
    median: float | None
    p10: float | None
    p90: float | None
    n: int | None

    @classmethod
    def of(cls, summary: dict) -> "Side":
        return cls(summary.get("median"), summary.get("p10"), summary.get("p90"), summary.get("n"))


@dataclass
class GateMark:
    name: str
    status: str
    basis: str | None
    deciding: bool


@dataclass
class VerdictLine:
    row: str
    shape: str
    mode: str
    dims: dict
    declared_dims: dict | None  # the declared shape's dims when the row ran at others (CPU smoke)
    basis: str
    bases: list[str]  # every basis the row measured
    baseline: Side
    candidate: Side
    speedup: dict  # {point, lo, hi, ...} (baseline / candidate)
    marks: list[GateMark] = field(default_factory=list)
    deciding: bool = False
    stop: str | None = None
    aa: dict | None = None
    plan: dict = field(default_factory=dict)

    @property
    def ran_elsewhere(self) -> bool:
        return self.declared_dims is not None


@dataclass
class GateLine:
    name: str
    kind: str
    status: str
    basis: str | None
    summary: str
    reason: str
    deciding: bool


@dataclass
class Verdict:
    experiment: str
    run_id: str
    verdict: str
    cpu_mode: bool
    terminal: str | None
    no_gpu_verdict: str | None
    baseline: dict
    candidate: dict
    device: str | None
    started: str | None
    lines: list[VerdictLine]
    gates: list[GateLine]

    @property
    def deciding(self) -> list[GateLine]:
        return [g for g in self.gates if g.deciding]


def side_label(side: dict) -> str:
    """A side as a person names it: `fla-core==0.6.0` for a package, else its commit (12 hex) with
    the branch, or the ref when it is not the commit itself (`HEAD`, a tag)."""
    if side.get("kind") == "package":
        return side.get("ref") or f"{side.get('package')}=={side.get('version')}"
    sha, ref = side.get("sha") or "", side.get("ref") or ""
    name = side.get("branch") or ("" if not ref or sha.startswith(ref) else ref)
    return (sha[:12] or "?") + (f" ({name})" if name else "")


def _gate_lines(report: dict) -> list[GateLine]:
    deciding = {g.get("name") for g in report.get("deciding_gates") or []}
    lines = [GateLine(name=g["name"], kind=g.get("kind", ""), status=g.get("status") or "INCONCLUSIVE",
                      basis=gate_basis(g), summary=gate_summary(g), reason=str(g.get("reason") or ""),
                      deciding=g["name"] in deciding) for g in report.get("gates") or []]
    return [g for g in lines if g.deciding] + [g for g in lines if not g.deciding]


def verdict_lines(report: dict) -> list[VerdictLine]:
    """One line per measured (row, mode), the rows a deciding gate judged first (in the order of
    those gates), then the rest in report order."""
    gates = report.get("gates") or []
    deciding = [g["name"] for g in report.get("deciding_gates") or []]
    declared = declared_dims(report)
    lines = []
    for row in report.get("rows") or []:
        name = row["name"]
        marks = []
        for g in gates:
            st = gate_row_status(g, name)
            if st is not None:
                # a row decides with a gate only where its own status is the gate's (a no-regression
                # FAIL is decided by the rows that failed, not by those left INCONCLUSIVE)
                marks.append(GateMark(g["name"], st, gate_basis(g, name), g["name"] in deciding and st == g.get("status")))
        marks.sort(key=lambda m: not m.deciding)
        basis = row_basis(row, [m.basis for m in marks if m.basis and m.basis != "auto"])
        numbers = row_bases(row)[basis]
        dims = row_dims(row)
        want = declared.get(row.get("shape"))
        lines.append(VerdictLine(
            row=name, shape=row.get("shape", name), mode=row.get("mode", ""), dims=dims,
            declared_dims=want if want and dims and want != dims else None,
            basis=basis, bases=list(row_bases(row)), baseline=Side.of(numbers["baseline"]),
            candidate=Side.of(numbers["candidate"]), speedup=numbers["speedup"], marks=marks,
            deciding=any(m.deciding for m in marks), stop=row_stop(row, basis), aa=row_aa(row, basis),
            plan=row_plan(row, basis)))

    def order(line: VerdictLine) -> int:
        ranks = [deciding.index(m.name) for m in line.marks if m.deciding]
        return min(ranks) if ranks else len(deciding)

    return sorted(lines, key=order)  # stable: report order within a rank


def build_verdict(report: dict) -> Verdict:
    prov = report.get("provenance") or {}
    run = report.get("run") or {}
    return Verdict(
        experiment=(report.get("experiment") or {}).get("name", "?"), run_id=str(run.get("id", "?")),
        verdict=report.get("verdict") or "INCONCLUSIVE", cpu_mode=bool(run.get("cpu_mode")),
        terminal=report.get("terminal"), no_gpu_verdict=report.get("no_gpu_verdict"),
        baseline=prov.get("baseline") or {}, candidate=prov.get("candidate") or {},
        device=(prov.get("device") or {}).get("name"), started=run.get("started"),
        lines=verdict_lines(report), gates=_gate_lines(report))
