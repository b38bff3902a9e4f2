"""`verify`: one side against the BENCH_BASE fixtures, with the frozen tolerances.

For a side (baseline or candidate):
- frozen paths: the SHA-256 of every path in the manifest's `frozen_paths`, taken from the side's
  commit, must equal the manifest's (a change, a deletion, or an uncommitted edit in the side's
  worktree is a FAIL naming the path); fixture files that the side's commit carries under
  fixtures/<exp>/ must equal the manifest's hashes too (a side without that directory -- one
  branched from the baseline before the fixture commit -- is noted, not failed); the manifest
  itself must be the one recorded by freeze, the bench-base branch must still point at BENCH_BASE,
  and the experiment file must still declare the frozen reference, cases, seed, dtype and
  tolerances. No flag turns any of this off.
- correctness: the fixture files are read from the BENCH_BASE commit (never from a worktree) and
  checked against the manifest's hashes; then, in a fresh process in the side's worktree
  (harness/oracle_worker.py), the op runs on the stored inputs in every declared mode with
  NaN-poisoned allocators (torch.empty/empty_like/empty_strided/new_empty* fill their buffers with
  NaN, so an element the op never writes fails), and every output and gradient (of the stored
  cotangent) is compared with the reference's: per element |op - ref| <= atol + rtol*|ref|.
  Reported per case, mode and tensor: max abs error, max relative error, worst ratio to the
  tolerance (<= 1 passes), elements out of tolerance, non-finite elements, and the tolerances.

Records: VerifyRecord per side; verify.json in a run dir holds both sides and
`gates: {correctness: {status, reason, numbers}, frozen_paths: {status, reason, numbers}}`.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness import fixtures as fx
from harness.results import results_root
from harness.revisions import Revisions
from harness.spec import SIDES, LoadedExperiment

VERIFY_FILE = "verify.json"
POISONING = ("torch.empty, empty_like, empty_strided, Tensor.new_empty and new_empty_strided are wrapped in the "
             "verifying process (installed before the op is imported) to fill every buffer they return with NaN "
             "(integers with their dtype's max); an output element the op does not write stays NaN and fails")


class VerifyError(Exception):
    """Verification cannot start (no PASS freeze record, unknown side)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class VerifyRecord:
    experiment: str
    side: str
    sha: str
    ref: str
    worktree: str
    bench_base_sha: str
    manifest_sha256: str | None
    device: str
    rtol: float | None = None
    atol: float | None = None
    dtype: str | None = None
    cases: list[dict] = field(default_factory=list)  # per case x mode: status, error, tensors [...]
    frozen_paths: list[dict] = field(default_factory=list)  # {path, expected, actual, status, problem}
    fixture_files: list[dict] = field(default_factory=list)  # BENCH_BASE blobs and the side's copies
    contract_changes: list[str] = field(default_factory=list)
    imported: dict = field(default_factory=dict)
    error: str | None = None
    gates: dict = field(default_factory=dict)  # {"correctness": PV, "frozen_paths": PV}
    poisoning: str = POISONING
    created: str = ""
    artifacts: str | None = None

    @property
    def passed(self) -> bool:
        return all((g or {}).get("status") == "PASS" for g in self.gates.values())

    def to_json(self) -> dict:
        d = asdict(self)
        d["kind"] = "verify_side"
        return d

    @classmethod
    def from_json(cls, d: dict) -> "VerifyRecord":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _freeze_dict(freeze_record) -> fx.FreezeRecord:
    if isinstance(freeze_record, dict):
        return fx.FreezeRecord.from_json(freeze_record)
    return freeze_record


def _dirty(worktree: str, path: str) -> str:
    if not Path(worktree).exists():
        return ""
    proc = subprocess.run(["git", "-C", worktree, "status", "--porcelain", "--", path], capture_output=True)
    return proc.stdout.decode(errors="replace").strip()


def check_frozen_paths(repo: str, side_sha: str, worktree: str, manifest: dict) -> list[dict]:
    rows = []
    for path, info in sorted(manifest.get("frozen_paths", {}).items()):
        now = fx.hash_tree_path(repo, side_sha, path)
        row = {"path": path, "kind": info.get("kind"), "expected": info.get("sha256"),
               "actual": now.get("sha256") if now else None, "status": "PASS", "problem": None}
        if now is None:
            row.update(status="FAIL", problem=f"frozen path {path} was deleted")
        elif now["sha256"] != info.get("sha256"):
            if info.get("kind") == "dir" and now.get("kind") == "dir":
                old, new = info.get("files", {}), now.get("files", {})
                changed = sorted(f for f in set(old) | set(new) if old.get(f) != new.get(f))
                row["changed_files"] = [f"{path}/{f}" for f in changed]
                row.update(status="FAIL", problem=f"frozen path {path} changed: {', '.join(row['changed_files'][:10])}")
            else:
                row.update(status="FAIL", problem=f"frozen path {path} changed")
        dirty = _dirty(worktree, path)
        if dirty:
            row.update(status="FAIL", problem=(row["problem"] + "; " if row["problem"] else "")
                       + f"uncommitted change in the worktree: {dirty.splitlines()[0]}")
        rows.append(row)
    return rows


def check_side_fixtures(repo: str, side_sha: str, exp_name: str, manifest: dict, manifest_sha256: str) -> list[dict]:
    """Fixture files the side's commit carries must be the frozen ones (a side may carry none)."""
    prefix = fx.fixture_prefix(exp_name)
    now = fx.hash_tree_path(repo, side_sha, prefix)
    if now is None:
        return [{"path": prefix + "/", "where": f"side {side_sha[:12]}", "status": "ABSENT", "expected": None,
                 "actual": None, "problem": "the side's commit has no fixtures (not based on BENCH_BASE); "
                                            "fixtures are read from BENCH_BASE"}]
    expected = {**manifest.get("files", {}), "manifest.json": manifest_sha256}
    actual = now.get("files", {}) if now["kind"] == "dir" else {}
    rows = []
    for fname in sorted(set(expected) | set(actual)):
        e, a = expected.get(fname), actual.get(fname)
        row = {"path": f"{prefix}/{fname}", "where": f"side {side_sha[:12]}", "expected": e, "actual": a,
               "status": "PASS", "problem": None}
        if e is None:
            row.update(status="FAIL", problem=f"fixture file {prefix}/{fname} was added")
        elif a is None:
            row.update(status="FAIL", problem=f"fixture file {prefix}/{fname} was deleted")
        elif a != e:
            row.update(status="FAIL", problem=f"fixture file {prefix}/{fname} changed (sha256 {a[:12]} != manifest {e[:12]})")
        rows.append(row)
    return rows


def _tensor_rows(cases: list[dict]) -> list[dict]:
    return [t for c in cases for t in c.get("tensors", [])]


def verify_side(loaded: LoadedExperiment, revisions: Revisions, freeze_record, side: str, device: str | None = None,
                log: Callable[[str], None] = print, profile_root=None, timeout: float | None = None) -> VerifyRecord:
    """Check one side against the frozen oracle. The side's own failures are its result; only a
    worker that measured nothing (the op does not import, the worker died, the baseline op raised)
    raises spec.SetupError."""
    if side not in SIDES:
        raise VerifyError(f"side must be one of {SIDES}, got {side!r}")
    frec = _freeze_dict(freeze_record)
    if frec is None or frec.status != "PASS" or not frec.bench_base_sha:
        raise VerifyError(f"no green freeze for {loaded.exp.name!r} (run `harness freeze` first; "
                          f"state: {getattr(frec, 'reason', 'no freeze record')})")
    exp = loaded.exp
    repo = revisions.repo
    rs = getattr(revisions, side)
    device = device or fx._default_device()
    if profile_root is None:  # the freeze's artifacts live in <profile_root>/<exp>/freeze/<stamp>
        profile_root = Path(frec.artifacts).parents[2] if frec.artifacts else results_root(loaded.path) / "profile"
    profile_root = Path(profile_root)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + os.urandom(2).hex()
    art = profile_root / exp.name / "verify" / f"{stamp}-{side}"
    rec = VerifyRecord(experiment=exp.name, side=side, sha=rs.sha, ref=rs.ref, worktree=rs.worktree,
                       bench_base_sha=frec.bench_base_sha, manifest_sha256=None, device=device, created=_now(),
                       artifacts=str(art))
    frozen_problems: list[str] = []
    try:
        manifest, digest = fx.read_manifest_at(repo, frec.bench_base_sha, exp.name)
    except fx.FreezeError as e:
        rec.error = str(e)
        rec.gates = {"correctness": fx.phase_verdict("FAIL", f"{side}: {e}", {}),
                     "frozen_paths": fx.phase_verdict("FAIL", f"{side}: {e}", {})}
        return rec
    rec.manifest_sha256, rec.rtol, rec.atol, rec.dtype = digest, manifest["rtol"], manifest["atol"], manifest["dtype"]
    if digest != frec.manifest_sha256:
        frozen_problems.append(f"manifest at BENCH_BASE has sha256 {digest[:12]}, freeze recorded "
                               f"{str(frec.manifest_sha256)[:12]}")
    branch = fx.branch_name(exp.name, frec.device)
    branch_now = fx.ref_sha(repo, f"refs/heads/{branch}")
    if branch_now != frec.bench_base_sha:
        frozen_problems.append(f"branch {branch} moved from {frec.bench_base_sha[:12]} to "
                               f"{(branch_now or 'nothing')[:12]}")
    rec.contract_changes = fx.contract_changes(loaded, manifest, frec.device)
    frozen_problems += [f"experiment file changed the frozen oracle: {c}" for c in rec.contract_changes]

    rec.frozen_paths = check_frozen_paths(repo, rs.sha, rs.worktree, manifest)
    side_fixture_rows = check_side_fixtures(repo, rs.sha, exp.name, manifest, digest)
    bench_rows = fx.extract_fixtures(repo, frec.bench_base_sha, exp.name, manifest, art / "fixtures")
    rec.fixture_files = bench_rows + side_fixture_rows
    frozen_problems += [r["problem"] for r in rec.frozen_paths if r["status"] == "FAIL"]
    frozen_problems += [r["problem"] for r in side_fixture_rows if r["status"] == "FAIL"]
    bad_bench = [r for r in bench_rows if r["status"] != "PASS"]

    correctness_problems: list[str] = []
    if bad_bench:
        correctness_problems += [f"fixture file {r['path']} at BENCH_BASE has sha256 {str(r['actual'])[:12]}, "
                                 f"manifest {r['expected'][:12]}" for r in bad_bench]
        frozen_problems += correctness_problems
    else:
        job = {"action": "check", "worktree": rs.worktree, "op": fx.side_op(loaded, side)[1], "reference": None,
               "inputs_file": None, "inputs_fn": None,
               "cases": [{k: c[k] for k in ("name", "shape", "seed", "cotangent_seed", "input_dtype", "rel_l2") if k in c}
                         for c in manifest["cases"]],
               "modes": manifest["modes"], "dtype": manifest["dtype"], "device": device,
               "rtol": manifest["rtol"], "atol": manifest["atol"],
               "fixture_dir": str(art / "fixtures"), "out_dir": str(art / "op")}
        log(f"verify: {side} {rs.sha[:12]} against BENCH_BASE {frec.bench_base_sha[:12]} "
            f"({len(manifest['cases'])} cases x {len(manifest['modes'])} modes, {device})")
        result = fx.run_worker(job, fx.worker_env(loaded, side, profile_root, device), art, timeout=timeout)
        fx.raise_if_unmeasured(loaded, side, result, f"verify: {side}")
        rec.cases, rec.imported, rec.error = result.get("cases", []), result.get("imported", {}), result.get("error")
        correctness_problems += fx.case_failures(result, side)
        expected_checks = len(manifest["cases"]) * len(manifest["modes"])
        if not rec.error and len(rec.cases) != expected_checks:
            correctness_problems.append(f"{side}: {len(rec.cases)} checks ran, {expected_checks} expected")

    tensors = _tensor_rows(rec.cases)
    ratios = [t["worst_ratio"] for t in tensors if isinstance(t.get("worst_ratio"), (int, float))]
    worst = max(ratios, default=None)
    if any(t.get("worst_ratio") in ("inf", "nan") for t in tensors):
        worst = float("inf")
    c_numbers = {"cases": len(manifest["cases"]), "checks": len(rec.cases),
                 "failed_checks": sum(1 for c in rec.cases if c.get("status") != "PASS"),
                 "tensors": len(tensors), "failed_tensors": sum(1 for t in tensors if t.get("status") == "FAIL"),
                 "worst_ratio": worst if worst is None or worst != float("inf") else "inf",
                 "max_rel_err": max((t["max_rel_err"] for t in tensors if isinstance(t.get("max_rel_err"), (int, float))),
                                    default=None),
                 "rtol": manifest["rtol"], "atol": manifest["atol"]}
    f_numbers = {"paths": len(rec.frozen_paths), "changed_paths": [r["path"] for r in rec.frozen_paths if r["status"] == "FAIL"],
                 "changed_fixtures": [r["path"] for r in rec.fixture_files if r["status"] == "FAIL"],
                 "contract_changes": len(rec.contract_changes)}
    low = [c for c in manifest["cases"] if c.get("input_dtype")]
    low_note = ("; " + ", ".join(sorted({f"{c['input_dtype']} cases within rel_l2={c['rel_l2']}" for c in low}))) if low else ""
    c_numbers["low_precision_cases"] = len(low)
    if correctness_problems:
        reason = f"{side}: " + "; ".join(correctness_problems[:4]) + (
            f"; ... ({len(correctness_problems)} problems)" if len(correctness_problems) > 4 else "")
        rec.gates["correctness"] = fx.phase_verdict("FAIL", reason, c_numbers)
    else:
        rec.gates["correctness"] = fx.phase_verdict(
            "PASS", f"{side}: {c_numbers['checks']} checks, {c_numbers['tensors']} tensors within rtol={manifest['rtol']}, "
                    f"atol={manifest['atol']}{low_note} (worst {worst:.3g} of tolerance)" if worst is not None else
                    f"{side}: {c_numbers['checks']} checks passed", c_numbers)
    if frozen_problems:
        rec.gates["frozen_paths"] = fx.phase_verdict("FAIL", f"{side}: " + "; ".join(frozen_problems[:6]), f_numbers)
    else:
        rec.gates["frozen_paths"] = fx.phase_verdict(
            "PASS", f"{side}: {len(rec.frozen_paths)} frozen paths and the fixtures match the manifest", f_numbers)
    log(f"verify: {side}: correctness {rec.gates['correctness']['status']}, "
        f"frozen paths {rec.gates['frozen_paths']['status']}")
    return rec


def combine(records: list[VerifyRecord]) -> dict:
    """The two gates over the verified sides: FAIL if any side fails, PASS if all pass."""
    gates = {}
    for kind in ("correctness", "frozen_paths"):
        vs = [(r.side, r.gates.get(kind) or {}) for r in records]
        if not vs:
            gates[kind] = fx.phase_verdict(None, "no side verified", {})
            continue
        failed = [(s, v) for s, v in vs if v.get("status") == "FAIL"]
        status = "FAIL" if failed else ("PASS" if all(v.get("status") == "PASS" for _, v in vs) else None)
        reason = " | ".join(v.get("reason", "") for _, v in (failed or vs))
        gates[kind] = fx.phase_verdict(status, reason, {s: v.get("numbers", {}) for s, v in vs})
    return gates


CANDIDATE_FAILED = "candidate failed verification"


def candidate_terminal(record: dict | None) -> str | None:
    """The terminal reason a candidate that failed verification (correctness or frozen paths)
    gives a run: no timing can make a wrong candidate ship, so the run stops before profile and
    bench (device time is the scarce thing) unless it is measured anyway. One wording for the run
    that stops on it and for any later re-render of that run. None when the candidate passed, was
    not verified, or the record is absent."""
    side = ((record or {}).get("sides") or {}).get("candidate") or {}
    failed = [(kind, g) for kind, g in sorted((side.get("gates") or {}).items()) if (g or {}).get("status") == "FAIL"]
    if not failed:
        return None
    return f"{CANDIDATE_FAILED}: " + " | ".join(f"{kind}: {g.get('reason')}" for kind, g in failed)


def verify_json(records: list[VerifyRecord], freeze_record) -> dict:
    frec = _freeze_dict(freeze_record)
    return {"kind": "verify", "experiment": frec.experiment, "bench_base_sha": frec.bench_base_sha,
            "bench_base_branch": frec.bench_base_branch, "manifest_sha256": frec.manifest_sha256,
            "baseline_gate": frec.gate, "created": _now(), "poisoning": POISONING,
            "sides": {r.side: r.to_json() for r in records}, "gates": combine(records)}


def write_verify(run_dir: Path, records: list[VerifyRecord], freeze_record) -> dict:
    data = verify_json(records, freeze_record)
    fx._write_json(Path(run_dir) / VERIFY_FILE, data)
    return data


def verify_run(loaded: LoadedExperiment, revisions: Revisions, freeze_record, run_dir: Path, cpu_mode: bool = False,
               log: Callable[[str], None] = print, sides: tuple[str, ...] = SIDES, profile_root=None) -> dict:
    """Both sides (or `sides`) against the oracle, `fx.workers_at_once` at a time; writes
    run_dir/verify.json and returns it."""
    from concurrent.futures import ThreadPoolExecutor

    device = "cpu" if cpu_mode else fx._default_device()
    with ThreadPoolExecutor(max_workers=fx.workers_at_once(device)) as pool:
        records = list(pool.map(lambda side: verify_side(loaded, revisions, freeze_record, side, device=device, log=log,
                                                         profile_root=profile_root), sides))
    return write_verify(run_dir, records, freeze_record)


def format_record(rec: VerifyRecord) -> str:
    """Per case, mode and tensor: the errors and the tolerance, then the frozen-path problems."""
    lines = [f"{rec.side} {rec.sha[:12]} vs BENCH_BASE {rec.bench_base_sha[:12]}  rtol={rec.rtol} atol={rec.atol}"]
    head = ("case", "mode", "tensor", "max_abs_err", "max_rel_err", "worst/tol", "bad", "status")
    rows = [head]

    def num(x):
        return f"{x:.3g}" if isinstance(x, (int, float)) else ("-" if x is None else str(x))

    for c in rec.cases:
        if not c.get("tensors"):
            rows.append((c["case"], c.get("mode") or "-", "-", "-", "-", "-", "-", c["status"]))
        for t in c.get("tensors", []):
            rows.append((c["case"], c.get("mode") or "-", t["name"], num(t.get("max_abs_err")), num(t.get("max_rel_err")),
                         num(t.get("worst_ratio")), str(t.get("n_bad", "-")), t["status"]))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows]
    for c in rec.cases:
        if c.get("status") != "PASS" and c.get("error"):
            lines.append(f"  {c['case']} {c.get('mode')}: {c['error']}")
    if rec.error:
        lines.append(f"  error: {rec.error}")
    for r in rec.frozen_paths + rec.fixture_files:
        if r.get("status") == "FAIL":
            lines.append(f"  FROZEN: {r['problem']}")
    for c in rec.contract_changes:
        lines.append(f"  FROZEN: experiment file changed the oracle: {c}")
    for kind, g in rec.gates.items():
        lines.append(f"gate {kind}: {g.get('status')}  {g.get('reason')}")
    return "\n".join(lines)
