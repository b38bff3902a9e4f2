"""`harness validate`'s look at the setup, beyond the schema: does every name in the file lead
somewhere, on both sides, before any run spends time on it?

- target.repo is a git repository; baseline.ref and candidate.ref resolve in it (each side gets its
  worktree under the results root, as a run would);
- each git side, in its own process (harness/oracle_worker.py, action "setup": the harness from this
  checkout first, then the side's worktree only): its op imports from the worktree; on the baseline
  the reference too (a module of the repository, or the adapter file); the inputs factory builds
  one small input (the first fixture case, else the first CPU row, else the first row) on the CPU.
  An installed-package side imports its op and has the declared version;
- every frozen path and every pytest gate's test file exists at the baseline commit, and each
  pytest gate's -k selection (and its cpu_k) selects at least one test there.

Nothing is called: an op may compile for minutes, which a run finds out soon enough. Every problem
is reported with its field (spec.SetupError, exit 2).
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from harness import children
from harness import fixtures as fx
from harness import revisions as rev
from harness.spec import SIDES, LoadedExperiment, PytestGate, setup_error

Problem = tuple[str, str]  # (field, what is wrong)


def _setup_case(loaded: LoadedExperiment) -> dict:
    """The one input the setup check builds: the first fixture case, else the first CPU row, else the
    first row (each with the seed the run would give it)."""
    exp = loaded.exp
    if exp.fixtures is not None:
        return fx.cases_for(loaded)[0]
    shape = (exp.cpu.shapes if exp.cpu is not None else exp.shapes)[0]
    return {"name": shape.name, "shape": shape.model_dump(exclude_none=True), "seed": exp.seed, "cotangent_seed": 0}


def _side_job(loaded: LoadedExperiment, side: rev.ResolvedSide) -> dict:
    exp = loaded.exp
    declared = getattr(exp, side.side)
    job = {"action": "setup", "worktree": side.worktree, "op": declared.op or exp.target.op,
           "inputs_file": str(loaded.inputs_file), "inputs_fn": exp.target.inputs.split(":")[1],
           "cases": [_setup_case(loaded)], "modes": list(exp.modes), "device": "cpu",
           "dtype": exp.fixtures.dtype if exp.fixtures is not None else "float32"}
    if side.kind == "package":
        job["package"] = {"name": side.package, "version": side.version}
    elif side.side == "baseline" and exp.fixtures is not None:
        job.update(reference=exp.fixtures.reference, **fx.reference_job(loaded))
    return job


def _side_problems(loaded: LoadedExperiment, side: rev.ResolvedSide, result: dict) -> list[Problem]:
    if not result.get("error"):
        return []
    field = fx.STAGE_FIELDS.get(result.get("stage"), fx.side_op(loaded, side.side)[0])
    return [(field, f"{side.side} ({side.ref}): {result['error']} (log: {result.get('log')})")]


def _describe_side(side: rev.ResolvedSide, result: dict) -> str:
    imported = result.get("imported") or {}
    made = result.get("inputs") or {}
    tensors = ", ".join(f"{k.split('.')[-1]}{v}" for k, v in (made.get("tensors") or {}).items())
    return (f"{side.side} {side.ref}: op from {imported.get('op')}"
            + (f"; reference from {imported['reference']}" if imported.get("reference") else "")
            + (f"; inputs of case {made.get('case')}: {tensors}" if made else ""))


def collect_tests(loaded: LoadedExperiment, side: rev.ResolvedSide, gate: PytestGate, k: str | None,
                  profile_root: Path, cpu_mode: bool) -> tuple[int, list[str], str]:
    """(pytest's exit code, the test ids it selects, its output's tail): --collect-only in the worktree."""
    from harness.pytest_gate import pytest_env

    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", gate.path]
    if k:
        argv += ["-k", k]
    proc = children.run(argv, cwd=side.worktree, env=pytest_env(loaded, side, profile_root, cpu_mode),
                        capture_output=True, text=True, timeout=gate.timeout_s)
    out = proc.stdout + proc.stderr
    tests = [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    return proc.returncode, tests, out[-1500:]


def _pytest_problems(loaded, revisions, i: int, gate: PytestGate, profile_root: Path,
                     log: Callable[[str], None]) -> list[Problem]:
    base = revisions.baseline
    if fx.hash_tree_path(revisions.repo, base.sha, gate.path) is None:
        return [(f"gates[{i}].path", f"{gate.path} does not exist at baseline {base.sha[:12]} in {revisions.repo}")]
    out = []
    selections = [("k", gate.k, False)] + ([("cpu_k", gate.cpu_k, True)] if gate.cpu_k is not None else [])
    # (a CPU run with run_on_cpu: false runs nothing; with no cpu_k it runs `k`, checked here)
    for name, k, cpu in selections:
        rc, tests, tail = collect_tests(loaded, base, gate, k, profile_root, cpu)
        where = f"{gate.path}{f' -k {k!r}' if k else ''} at baseline {base.sha[:12]}"
        if rc == 5 or (rc == 0 and not tests):
            out.append((f"gates[{i}].{name}", f"{where} selects no test"))
        elif rc != 0:
            out.append((f"gates[{i}].{'path' if rc in (2, 3, 4) else name}",
                        f"pytest --collect-only of {where} exited {rc}:\n{tail}"))
        else:
            log(f"ok: gates[{i}] {gate.name}: {where} selects {len(tests)} test{'' if len(tests) == 1 else 's'}")
    return out


def check_setup(loaded: LoadedExperiment, profile_root: Path, log: Callable[[str], None] = print) -> None:
    """Every check in the module docstring; raises spec.SetupError listing every problem found."""
    exp = loaded.exp
    problems: list[Problem] = []
    git_sides = [s for s in SIDES if not getattr(exp, s).is_package]
    revisions = None
    if git_sides:
        try:
            repo = rev.open_repo(loaded.target_repo)
            log(f"ok: target.repo {loaded.target_repo}")
        except rev.RevisionError as e:
            raise setup_error(loaded, ("target.repo", str(e))) from None
        for s in git_sides:
            try:
                sha, _ = rev.resolve_ref(repo, getattr(exp, s).ref, f"{s}.ref")
                log(f"ok: {s}.ref {getattr(exp, s).ref} = {sha[:12]} {repo.commit(sha).summary!r}")
            except rev.RevisionError as e:
                problems.append((f"{s}.ref", str(e)))
        if problems:
            raise setup_error(loaded, *problems)
    try:
        revisions = rev.resolve(loaded, profile_root)
    except rev.RevisionError as e:
        raise setup_error(loaded, ("baseline.ref", str(e))) from None

    base = revisions.baseline
    if base.kind == "git":
        for i, path in enumerate(exp.frozen_paths):
            if fx.hash_tree_path(revisions.repo, base.sha, path.strip("/")) is None:
                problems.append((f"frozen_paths[{i}]", f"{path} does not exist at baseline {base.sha[:12]}"))
    sides = [revisions.baseline, revisions.candidate]
    if sides[0].kind == sides[1].kind == "git" and sides[0].sha == sides[1].sha and not exp.candidate.op:
        sides = sides[:1]  # an env-only candidate imports the very same code

    def run_side(side: rev.ResolvedSide) -> dict:
        work = profile_root / exp.name / "validate" / side.side
        env = fx.worker_env(loaded, side.side, profile_root, "cpu")
        return fx.run_worker(_side_job(loaded, side), env, work, timeout=600)

    with ThreadPoolExecutor(max_workers=len(sides) + 1) as pool:
        futures = [(side, pool.submit(run_side, side)) for side in sides]
        pytest_futures = [pool.submit(_pytest_problems, loaded, revisions, i, g, profile_root, log)
                          for i, g in enumerate(exp.gates) if isinstance(g, PytestGate)]
        for side, fut in futures:
            result = fut.result()
            side_problems = _side_problems(loaded, side, result)
            problems += side_problems
            if not side_problems:
                log(f"ok: {_describe_side(side, result)}")
        for fut in pytest_futures:
            problems += fut.result()
    if problems:
        raise setup_error(loaded, *problems)
