"""The repository's own test file as a gate (`kind: pytest`): the frozen file, run on both sides.

For each pytest gate and side (a git worktree): the test file and every conftest.py above it are
taken as they are at BENCH_BASE (the baseline commit when the experiment freezes no fixtures:
BENCH_BASE adds only fixtures/<exp>/ to it), written over the side's copies for the run and put
back afterwards, so a candidate never runs a test file it edited. Then, in the worktree,
`python -m pytest FILE [-k K] -p no:cacheprovider --junitxml=...` runs with the side's block
environment (its declared env, the experiment's Triton cache, the interpreter on a CPU run) and
the worktree first on PYTHONPATH (on a CPU, with TF32 dots emulated as in the side workers:
harness/pytest_tf32.py); each test's outcome comes from the JUnit XML. The two sides run at the
same time when each has its own worktree: the gate judges outcomes, never times, and on a cold GPU
machine most of a side's minutes are compiles. A side that is not green beside the other runs
again alone, and that result counts (two processes on one GPU can fail a test neither fails alone).
Their autotune results are not cached (TRITON_CACHE_AUTOTUNING unset, as in harness/warm.py):
benchmarks that overlap on the GPU would be noise, and the timed workers must not find them. Each
side's result that counts is kept beside its log (side.json) as soon as it ends, and a resumed run
reuses it when pytest decided (exit 0 or 1) and its resume key (`resume_key`) is the same: an
interrupted gate never runs a finished side again.

The gate: PASS when each side ran at least one test and none failed or errored; FAIL when a test
failed or errored on a side (one the baseline fails too is named so: it cannot judge the
candidate); no decision (INCONCLUSIVE) when pytest selected no test or could not run (its exit
codes 2-5, a timeout). A CPU run uses the gate's `cpu_k` selection, or runs nothing when the gate
says `run_on_cpu: false` (no decision there).

Record: <run dir>/pytest.json {kind, gates: {<gate name>: {path, k, frozen_from, files,
sides: {<side>: {returncode, counts, tests: [{test, outcome, time_s, message}], log, files, key, started,
seconds, alone, reused, beside (the result beside the other side, when it was run again alone)}}, gate}}}.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Callable

from harness import children, interpreter_tf32
from harness import fixtures as fx
from harness.measure.sides import side_env
from harness.revisions import ResolvedSide, Revisions
from harness.spec import SIDES, LoadedExperiment, PytestGate, setup_error

PYTEST_FILE = "pytest.json"
SIDE_FILE = "side.json"  # one side's finished result, beside its log: what a resumed run reuses
OUTCOMES = ("passed", "failed", "error", "skipped")
# pytest's exit codes that mean it did not run the selection to the end (usage, internal error,
# interrupted, nothing collected): no decision, whatever the tests did
PYTEST_NO_DECISION = {2: "interrupted", 3: "internal error", 4: "usage error", 5: "no test selected"}


def frozen_test_files(repo: Path | str, commit: str, path: str) -> dict[str, bytes] | None:
    """The test file and the conftest.py files in its folder and every folder above it, as they
    are in `commit` (repository-relative path -> bytes); None when the test file is not there."""
    import git

    tree = git.Repo(repo).commit(commit).tree
    folders = [str(p) for p in PurePosixPath(path).parents]
    out = {}
    for rel in [path] + [("" if f == "." else f + "/") + "conftest.py" for f in folders]:
        try:
            out[rel] = (tree / rel).data_stream.read()
        except KeyError:
            if rel == path:
                return None
    return out


def parse_junit(path: Path, test_file: str) -> list[dict]:
    """One row per test case of a JUnit XML report: {test, outcome, time_s, message}."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            child = case.find(tag)
            if child is not None:
                outcome, message = name, (child.get("message") or (child.text or "").strip()[:500] or None)
                break
        rows.append({"test": f"{test_file}::{case.get('name')}", "outcome": outcome,
                     "time_s": float(case.get("time") or 0.0), "message": message})
    return rows


def _overlay(worktree: Path, files: dict[str, bytes]) -> dict[str, bytes | None]:
    """Write the frozen files over the worktree's; returns what was there (None: nothing)."""
    before = {}
    for rel, data in files.items():
        target = worktree / rel
        before[rel] = target.read_bytes() if target.is_file() else None
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return before


def _restore(worktree: Path, before: dict[str, bytes | None]) -> None:
    for rel, data in before.items():
        target = worktree / rel
        if data is None:
            target.unlink(missing_ok=True)
        else:
            target.write_bytes(data)


def pytest_env(loaded: LoadedExperiment, side: ResolvedSide, profile_root: Path, cpu_mode: bool) -> dict[str, str]:
    """The side's block environment with its worktree first on PYTHONPATH (the tests import the
    repository's package from there, never an installed copy)."""
    env = side_env(loaded, side.side, profile_root, cpu_mode)
    env["PYTHONPATH"] = os.pathsep.join([side.worktree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TRITON_CACHE_AUTOTUNING", None)  # the sides run at once: see the module docstring
    return env


def run_side(loaded: LoadedExperiment, gate: PytestGate, side: ResolvedSide, files: dict[str, bytes],
             work_dir: Path, profile_root: Path, cpu_mode: bool, alone: bool) -> dict:
    """The frozen test file on one side; {side, sha, returncode, k, argv, files, key, counts, tests,
    log, started, seconds, alone, reused}. `alone`: no other side's pytest runs beside it. A
    finished result with the same resume key in work_dir is reused (see the module docstring)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    junit, log, done = work_dir / "junit.xml", work_dir / "pytest.log", work_dir / SIDE_FILE
    k = (gate.cpu_k or gate.k) if cpu_mode else gate.k
    env = pytest_env(loaded, side, profile_root, cpu_mode)
    argv = [sys.executable, "-m", "pytest", gate.path, "-p", "no:cacheprovider", f"--junitxml={junit}", "-q"]
    if env.get(interpreter_tf32.ENV) == "1":
        argv += ["-p", "harness.pytest_tf32"]  # the test process's dots as the side workers' (TF32 emulated)
    if k:
        argv += ["-k", k]
    digests = {rel: fx.sha256_bytes(data) for rel, data in files.items()}
    key = resume_key(loaded, gate, side, digests, k, cpu_mode, env)
    earlier = _finished_side(done, key)
    if earlier is not None:
        return {**earlier, "reused": True}
    junit.unlink(missing_ok=True)
    worktree = Path(side.worktree)
    before = _overlay(worktree, files)
    t0 = time.time()
    try:
        with log.open("w") as out:
            proc = children.run(argv, cwd=worktree, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=gate.timeout_s)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        _restore(worktree, before)
    tests = parse_junit(junit, gate.path) if junit.is_file() else []
    counts = {o: sum(1 for t in tests if t["outcome"] == o) for o in OUTCOMES}
    result = {"side": side.side, "sha": side.sha, "returncode": rc, "k": k, "argv": argv[1:], "files": digests,
              "key": key, "counts": counts, "tests": tests, "log": str(log), "started": round(t0, 3),
              "seconds": round(time.time() - t0, 2), "alone": alone, "reused": False}
    # kept for a resumed run: a green side, or any side that ran alone; not a side the harness's stop
    # killed (it did not finish), nor one that was not green beside the other side (run again alone)
    if children.stop_signal() is None and (rc == 0 or alone):
        done.write_text(json.dumps(result, indent=1, sort_keys=True))
    return result


def resume_key(loaded: LoadedExperiment, gate: PytestGate, side: ResolvedSide, digests: dict[str, str],
               k: str | None, cpu_mode: bool, env: dict[str, str]) -> dict:
    """What a side's pytest result depends on, as far as the harness can name it: the commit, the
    frozen files, the selection, the machine kind, the side's declared env, a CPU run's
    `cpu.python_path` and TF32 emulation, and the torch and Triton versions (never a path of this
    run: a resumed run may live elsewhere)."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    setting = {"declared_env": getattr(loaded.exp, side.side).env,
               "python_path": list(loaded.exp.cpu.python_path) if cpu_mode and loaded.exp.cpu else [],
               "emulate_tf32": env.get(interpreter_tf32.ENV)}
    return {"sha": side.sha, "files": digests, "path": gate.path, "k": k, "cpu": cpu_mode,
            "setting": fx.sha256_bytes(json.dumps(setting, sort_keys=True).encode()),
            "torch": version("torch"), "triton": version("triton")}


def _finished_side(path: Path, key: dict) -> dict | None:
    """The side's earlier result at `path` when its resume key is `key` and pytest decided (exit 0
    or 1); a timeout or a pytest that could not run is tried again."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(earlier, dict):
        return None
    return earlier if earlier.get("key") == key and earlier.get("returncode") in (0, 1) else None


def gate_verdict(gate: PytestGate, sides: dict[str, dict]) -> dict:
    """{status, reason, numbers} of one pytest gate from its sides' results (see the module doc)."""
    numbers = {side: r["counts"] for side, r in sides.items()}
    undecided = []
    for side, r in sides.items():
        rc = r["returncode"]
        if rc == "timeout":
            undecided.append(f"{side}: pytest ran past timeout_s={gate.timeout_s}")
        elif rc in PYTEST_NO_DECISION:
            undecided.append(f"{side}: pytest exit {rc} ({PYTEST_NO_DECISION[rc]}; log {r['log']})")
        elif rc not in (0, 1):
            undecided.append(f"{side}: pytest exit {rc} (log {r['log']})")
    red = {side: [t["test"] for t in r["tests"] if t["outcome"] in ("failed", "error")] for side, r in sides.items()}
    if any(red.values()):
        base_red = set(red.get("baseline", []))
        parts = []
        for side, names in red.items():
            if names:
                both = [n for n in names if side == "candidate" and n in base_red]
                parts.append(f"{side}: {len(names)} failed ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                             + (f"; {len(both)} of them fail on the baseline too" if both else ""))
        return fx.phase_verdict("FAIL", f"{gate.path}: " + "; ".join(parts), numbers)
    if undecided:
        return fx.phase_verdict(None, f"{gate.path}: " + "; ".join(undecided), numbers)
    ran = {side: r["counts"]["passed"] for side, r in sides.items()}
    if not all(ran.values()):
        return fx.phase_verdict(None, f"{gate.path}: no test passed on {[s for s, n in ran.items() if not n]} "
                                      "(all skipped or none selected)", numbers)
    skipped = {side: r["counts"]["skipped"] for side, r in sides.items() if r["counts"]["skipped"]}
    return fx.phase_verdict("PASS", f"{gate.path}{' -k ' + repr(sides['baseline']['k']) if sides['baseline']['k'] else ''}: "
                                    + ", ".join(f"{side} {n} passed" for side, n in ran.items())
                                    + (f" (skipped by the frozen file: {skipped})" if skipped else ""), numbers)


def run_sides(loaded: LoadedExperiment, gate: PytestGate, revisions: Revisions, files: dict[str, bytes],
              work_dir: Path, profile_root: Path, cpu_mode: bool, log: Callable[[str], None]) -> dict[str, dict]:
    """One gate on both sides: at once when they have worktrees of their own, and any side that was
    not green beside the other run again alone, whose result is the one kept (a test that fails
    only when two processes share the GPU, e.g. out of memory or an exclusive-process GPU, is no
    verdict on the code)."""
    sides = {side: getattr(revisions, side) for side in SIDES}
    together = len({rs.worktree for rs in sides.values()}) == len(sides)  # else the overlays would collide
    log(f"pytest: {gate.name}: {gate.path} on " + " and ".join(f"{side} {rs.sha[:12]}" for side, rs in sides.items())
        + (" at once" if together else " one after the other (one worktree)"))

    def one(side: str, alone: bool) -> dict:
        return run_side(loaded, gate, sides[side], files, work_dir / side, profile_root, cpu_mode, alone)

    with ThreadPoolExecutor(max_workers=len(sides) if together else 1) as pool:
        results = dict(zip(sides, pool.map(lambda side: one(side, not together), sides)))
    for side, r in results.items():
        if not r["alone"] and not r["reused"] and r["returncode"] != 0:
            log(f"pytest: {gate.name}: {side}: exit {r['returncode']} beside the other side; again alone")
            results[side] = {**one(side, True), "beside": {k: r[k] for k in ("returncode", "counts", "seconds")}}
    for side, r in results.items():
        log(f"pytest: {gate.name}: {side}: " + ", ".join(f"{n} {o}" for o, n in r["counts"].items() if n)
            + f" (exit {r['returncode']}, "
            + (f"{r['seconds']} s earlier, reused)" if r["reused"] else f"{r['seconds']} s)"))
    return results


def pytest_run(loaded: LoadedExperiment, revisions: Revisions, run_dir: Path, profile_root: Path,
               cpu_mode: bool, log: Callable[[str], None] = print, freeze_record=None) -> dict:
    """Every pytest gate on both sides; writes run_dir/pytest.json and returns it."""
    base = revisions.baseline
    frozen_from = freeze_record.bench_base_sha if freeze_record is not None and freeze_record.bench_base_sha \
        else base.sha
    record: dict = {"kind": "pytest", "frozen_from": frozen_from, "gates": {}}
    for i, gate in enumerate(loaded.exp.gates):
        if not isinstance(gate, PytestGate):
            continue
        files = frozen_test_files(revisions.repo, frozen_from, gate.path)
        if files is None:
            raise setup_error(loaded, (f"gates[{i}].path", f"{gate.path} does not exist at {frozen_from[:12]} "
                                                          f"in {revisions.repo}"))
        entry = {"path": gate.path, "k": gate.k, "cpu_k": gate.cpu_k, "frozen_from": frozen_from,
                 "files": {rel: fx.sha256_bytes(data) for rel, data in files.items()}, "sides": {}}
        record["gates"][gate.name] = entry
        if cpu_mode and not gate.run_on_cpu:
            entry["gate"] = fx.phase_verdict(None, f"{gate.path}: not run on a CPU machine (run_on_cpu: false)", {})
            log(f"pytest: {gate.name}: not run on CPU (run_on_cpu: false)")
            continue
        entry["sides"] = run_sides(loaded, gate, revisions, files, run_dir / "pytest" / gate.name, profile_root,
                                   cpu_mode, log)
        entry["gate"] = gate_verdict(gate, entry["sides"])
    (run_dir / PYTEST_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    return record
