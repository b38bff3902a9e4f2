"""Any repository: the whole protocol through `harness run` on a throwaway foreign repository
(tests/foreign_repo.py: dims M, N, D, a reference adapter, its own pytest file as a gate), the
results root beside the experiment file, `harness publish`, and setup errors that name their field
(from `harness validate`, and at run time without counting as an attempt)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from foreign_repo import TESTS, TESTS_EDITED, ForeignRepo
from harness.results import RESULTS_ENV

ROOT = Path(__file__).resolve().parent.parent


def harness(*args, cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != RESULTS_ENV}
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=cwd, timeout=timeout,
                          env={**base, "PYTHONPATH": str(ROOT), **(env or {})}, capture_output=True, text=True)


def line(path: Path, text: str) -> int:
    return next(i for i, got in enumerate(path.read_text().splitlines(), 1) if text in got)


@pytest.fixture
def foreign(tmp_path) -> ForeignRepo:
    return ForeignRepo(tmp_path)


@pytest.mark.timing  # a verdict from CPU timings (the marker in pyproject.toml)
def test_whole_protocol_on_a_foreign_repository(foreign, tmp_path):
    foreign.slow_candidate(rounds=16)
    exp = foreign.experiment()
    res = harness("run", exp, "--run-id", "r1", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr  # NO-GO: the candidate is slower

    # everything under results/ beside the experiment file, nothing in the harness's own reports/
    results = foreign.bench / "results"
    assert (results / "profile" / "tiny" / "runs" / "r1" / "run.json").is_file()
    report = json.loads((results / "reports" / "tiny" / "r1" / "report.json").read_text())
    assert not (ROOT / "reports" / "tiny").exists()
    jsonschema.validate(report, json.loads((ROOT / "docs" / "report.schema.json").read_text()),
                        cls=jsonschema.Draft202012Validator)

    assert report["verdict"] == "NO-GO"
    status = {g["name"]: g["status"] for g in report["gates"]}
    assert status == {"pre-gate": "PASS", "frozen-fixtures": "PASS", "frozen-paths": "PASS", "own-tests": "PASS",
                      "endpoint": "FAIL", "one-mn-buffer-less": "INCONCLUSIVE"}, report["gates"]
    assert [g["name"] for g in report["deciding_gates"]] == ["endpoint"]
    # the byte expression over the free-form dims was evaluated on the row (peaks do not exist on a CPU)
    peak = next(g for g in report["gates"] if g["name"] == "one-mn-buffer-less")
    assert f"{4 * 160 * 128}" in json.dumps(peak["numbers"]), peak
    # rows carry their own dims, nothing invented
    assert {(r["shape"], r["mode"]) for r in report["rows"]} == {("m160_n128_d192", "fwd"), ("m160_n128_d192", "fwdbwd")}
    assert all(r["dims"] == {"M": 160, "N": 128, "D": 192} for r in report["rows"])
    assert all(r["speedup"]["point"] < 0.8 for r in report["rows"] if r["mode"] == "fwdbwd")

    # the oracle: computed through the adapter, frozen by its hash; the test file is a frozen path
    manifest = report["phases"]["freeze"]["manifest"]
    adapter = foreign.bench / "adapter.py"
    assert manifest["reference"] == "adapter.py:sqdist_rows"
    assert manifest["reference_adapter"] == {"file": str(adapter), "sha256": hashlib.sha256(adapter.read_bytes()).hexdigest()}
    assert set(manifest["frozen_paths"]) == {"tinyops/reference.py", "tests/test_pairwise.py"}
    assert report["phases"]["freeze"]["runs"][0]["imported"]["reference"] == str(adapter)

    # the repository's own tests: each selected test, on each side
    pt = report["phases"]["pytest"]["gates"]["own-tests"]
    for side in ("baseline", "candidate"):
        tests = {t["test"]: t["outcome"] for t in pt["sides"][side]["tests"]}
        assert tests == {"tests/test_pairwise.py::test_matches_reference[3-4-5]": "passed",
                         "tests/test_pairwise.py::test_matches_reference[16-8-32]": "passed"}, tests
    html = (results / "reports" / "tiny" / "r1" / "index.html").read_text()
    assert 'id="pytest-table-own-tests"' in html and "test_matches_reference[16-8-32]" in html

    attempts = (results / "profile" / "tiny" / "attempts.jsonl").read_text().splitlines()
    assert len(attempts) == 1 and json.loads(attempts[0])["verdict"] == "NO-GO"

    # publishing is its own step, into the folder it is given
    published = tmp_path / "published"
    res = harness("publish", exp, "--run", "r1", "--as", "cpu", "--into", published, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((published / "tiny" / "cpu" / "report.json").read_text())["verdict"] == "NO-GO"
    assert 'href="tiny/cpu/index.html"' in (published / "index.html").read_text()
    res = harness("publish", exp, "--run", "nosuch", "--into", published, cwd=tmp_path)
    assert res.returncode == 2 and "no report.json and index.html in" in res.stderr


@pytest.mark.timing  # a verdict from CPU timings (the marker in pyproject.toml)
def test_a_setup_error_at_run_time_is_no_attempt_and_not_terminal(foreign, tmp_path):
    foreign.slow_candidate()
    exp = foreign.experiment(op="tinyops.pairwise:pairwise_sqdis")  # a typo
    results = tmp_path / "res"
    res = harness("run", exp, cwd=tmp_path, env={RESULTS_ENV: str(results)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{exp}:{line(exp, 'op:')}: target.op: freeze: baseline gate run 1/2 measured nothing" in res.stderr
    assert "has no function 'pairwise_sqdis'" in res.stderr
    exp_dir = results / "profile" / "tiny"
    assert not (exp_dir / "attempts.jsonl").exists() and not (exp_dir / "state.json").exists()
    assert not (exp_dir / "freeze.json").exists()
    # fixed, the same results root runs the protocol up to its verdict
    exp = foreign.experiment()
    res = harness("run", exp, cwd=tmp_path, env={RESULTS_ENV: str(results)})
    assert res.returncode == 1, res.stdout + res.stderr


def test_validate_checks_the_setup_for_real(foreign, tmp_path):
    foreign.slow_candidate()
    res = harness("validate", foreign.experiment(), "--results", tmp_path / "res", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok: candidate.ref slow" in res.stdout and "selects 2 tests" in res.stdout
    assert f"reference from {foreign.bench / 'adapter.py'}" in res.stdout

    # three broken names at once: each reported with its field and line
    exp = foreign.experiment(op="tinyops.pairwise:nope", reference="adapter.py:sqdist_cols", k="no_such_test")
    res = harness("validate", exp, "--results", tmp_path / "res", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    op_line = line(exp, "  op:")
    assert f"{exp}:{op_line}: target.op: baseline" in res.stderr and "has no function 'nope'" in res.stderr
    assert f"{exp}:{op_line}: target.op: candidate (slow)" in res.stderr
    assert f"{exp}:{line(exp, 'kind: pytest')}: gates[3].k: tests/test_pairwise.py -k 'no_such_test'" in res.stderr
    assert "selects no test" in res.stderr

    exp = foreign.experiment(reference="adapter.py:sqdist_cols")
    res = harness("validate", exp, "--results", tmp_path / "res", cwd=tmp_path)
    assert res.returncode == 2 and f"{exp}:{line(exp, 'reference:')}: fixtures.reference: baseline" in res.stderr, \
        res.stderr
    assert "adapter.py has no function 'sqdist_cols'" in res.stderr

    exp = foreign.experiment(candidate="no-such-branch")
    res = harness("validate", exp, "--results", tmp_path / "res", cwd=tmp_path)
    assert res.returncode == 2 and f"{exp}:{line(exp, 'ref: no-such-branch')}: candidate.ref: candidate.ref " \
        "'no-such-branch' does not resolve" in res.stderr, res.stderr

    exp.write_text(exp.read_text().replace("repo: ../tinyops", "repo: ../elsewhere"))
    res = harness("validate", exp, "--results", tmp_path / "res", cwd=tmp_path)
    assert res.returncode == 2 and f"{exp}:{line(exp, 'repo:')}: target.repo: target.repo {tmp_path / 'elsewhere'} " \
        "is not a git" in res.stderr, res.stderr


def test_pytest_gate_runs_the_frozen_test_file_on_the_candidate(foreign, tmp_path):
    from harness import fixtures as fx
    from harness import pytest_gate
    from harness.revisions import resolve
    from harness.spec import load_experiment

    foreign.branch("edits-tests", {"tests/test_pairwise.py": TESTS_EDITED})
    loaded = load_experiment(foreign.experiment(candidate="edits-tests"))
    assert "tests/test_pairwise.py" in fx.frozen_path_list(loaded, foreign.repo, foreign.baseline)
    revisions = resolve(loaded, tmp_path / "profile")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = pytest_gate.pytest_run(loaded, revisions, run_dir, tmp_path / "profile", cpu_mode=True, log=lambda m: None)
    entry = record["gates"]["own-tests"]
    cand = {t["test"]: t["outcome"] for t in entry["sides"]["candidate"]["tests"]}
    assert cand == {"tests/test_pairwise.py::test_matches_reference[3-4-5]": "passed",
                    "tests/test_pairwise.py::test_matches_reference[16-8-32]": "passed"}
    assert entry["gate"]["status"] == "PASS" and entry["frozen_from"] == foreign.baseline
    assert entry["files"] == {"tests/test_pairwise.py": hashlib.sha256(TESTS.encode()).hexdigest()}
    # the candidate's worktree is back to its own commit
    wt = Path(revisions.candidate.worktree)
    assert (wt / "tests" / "test_pairwise.py").read_text() == TESTS_EDITED
    assert subprocess.run(["git", "-C", str(wt), "status", "--porcelain"], capture_output=True, text=True).stdout == ""
    assert json.loads((run_dir / "pytest.json").read_text()) == json.loads(json.dumps(record))


def test_pytest_gate_keeps_each_finished_side_for_a_resumed_run(foreign, tmp_path):
    from harness import pytest_gate
    from harness.revisions import resolve
    from harness.spec import load_experiment

    foreign.slow_candidate()
    loaded = load_experiment(foreign.experiment())
    revisions = resolve(loaded, tmp_path / "profile")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines: list[str] = []
    first = pytest_gate.pytest_run(loaded, revisions, run_dir, tmp_path / "profile", cpu_mode=True, log=lines.append)
    assert any("on baseline" in m and "and candidate" in m and m.endswith("at once") for m in lines), lines
    base, cand = (first["gates"]["own-tests"]["sides"][s] for s in ("baseline", "candidate"))
    assert not base["reused"] and not cand["reused"] and not base["alone"] and not cand["alone"]
    # they did run at the same time
    assert base["started"] < cand["started"] + cand["seconds"] and cand["started"] < base["started"] + base["seconds"]
    assert "harness.pytest_tf32" in base["argv"]  # a CPU run's tests multiply fp32 as its workers do

    # an interrupted run: pytest.json never written, the baseline's result kept, the candidate's a
    # pytest that could not run (exit 2: no decision, so tried again)
    (run_dir / "pytest.json").unlink()
    cand_done = run_dir / "pytest" / "own-tests" / "candidate" / pytest_gate.SIDE_FILE
    cand_done.write_text(json.dumps({**json.loads(cand_done.read_text()), "returncode": 2}))
    lines.clear()
    again = pytest_gate.pytest_run(loaded, revisions, run_dir, tmp_path / "profile", cpu_mode=True, log=lines.append)
    sides = again["gates"]["own-tests"]["sides"]
    assert sides["baseline"]["reused"] and sides["baseline"]["seconds"] == base["seconds"]
    assert not sides["candidate"]["reused"] and sides["candidate"]["returncode"] == 0
    assert any("baseline" in m and "earlier, reused" in m for m in lines), lines
    assert again["gates"]["own-tests"]["gate"]["status"] == "PASS"

    # another selection is never a reuse
    narrower = load_experiment(foreign.experiment(k="matches_reference and 16"))
    third = pytest_gate.pytest_run(narrower, revisions, run_dir, tmp_path / "profile", cpu_mode=True, log=lambda m: None)
    assert not any(s["reused"] for s in third["gates"]["own-tests"]["sides"].values())
    assert third["gates"]["own-tests"]["sides"]["baseline"]["counts"]["passed"] == 1


def test_pytest_gate_runs_a_side_that_fails_beside_the_other_again_alone(foreign, tmp_path):
    from harness import pytest_gate
    from harness.revisions import resolve
    from harness.spec import load_experiment

    foreign.branch("wrong", {"tinyops/pairwise.py": "def pairwise_sqdist(x, y):\n    return (x @ y.t()) * 0\n"})
    loaded = load_experiment(foreign.experiment(candidate="wrong"))
    revisions = resolve(loaded, tmp_path / "profile")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines: list[str] = []
    record = pytest_gate.pytest_run(loaded, revisions, run_dir, tmp_path / "profile", cpu_mode=True, log=lines.append)
    entry = record["gates"]["own-tests"]
    cand = entry["sides"]["candidate"]
    assert cand["alone"] and cand["returncode"] == 1 and cand["beside"]["returncode"] == 1
    assert any("beside the other side; again alone" in m for m in lines), lines
    assert entry["gate"]["status"] == "FAIL" and not entry["sides"]["baseline"]["alone"]
    # the alone result is the one kept: a resumed run reuses it
    (run_dir / "pytest.json").unlink()
    again = pytest_gate.pytest_run(loaded, revisions, run_dir, tmp_path / "profile", cpu_mode=True, log=lambda m: None)
    assert all(s["reused"] for s in again["gates"]["own-tests"]["sides"].values())


def test_pytest_gate_sides_sharing_a_worktree_run_one_after_the_other(foreign, tmp_path):
    import dataclasses

    from harness import pytest_gate
    from harness.revisions import resolve
    from harness.spec import load_experiment

    foreign.branch("edits-tests", {"tests/test_pairwise.py": TESTS_EDITED})
    loaded = load_experiment(foreign.experiment(candidate="edits-tests"))
    revisions = resolve(loaded, tmp_path / "profile")
    shared = dataclasses.replace(revisions, candidate=dataclasses.replace(revisions.candidate,
                                                                          worktree=revisions.baseline.worktree))
    wt = Path(revisions.baseline.worktree)
    before = (wt / "tests" / "test_pairwise.py").read_text()
    lines: list[str] = []
    (tmp_path / "run").mkdir()
    record = pytest_gate.pytest_run(loaded, shared, tmp_path / "run", tmp_path / "profile", cpu_mode=True,
                                    log=lines.append)
    sides = record["gates"]["own-tests"]["sides"]
    assert all(s["alone"] for s in sides.values()) and record["gates"]["own-tests"]["gate"]["status"] == "PASS"
    assert sides["baseline"]["started"] + sides["baseline"]["seconds"] <= sides["candidate"]["started"] + 0.01
    assert any(m.endswith("one after the other (one worktree)") for m in lines), lines
    assert (wt / "tests" / "test_pairwise.py").read_text() == before


def test_pytest_env_leaves_autotune_results_uncached(foreign, tmp_path, monkeypatch):
    from harness.pytest_gate import pytest_env
    from harness.revisions import resolve
    from harness.spec import load_experiment

    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    foreign.slow_candidate()
    loaded = load_experiment(foreign.experiment())
    revisions = resolve(loaded, tmp_path / "profile")
    for cpu_mode in (True, False):
        env = pytest_env(loaded, revisions.baseline, tmp_path / "profile", cpu_mode)
        assert "TRITON_CACHE_AUTOTUNING" not in env
        assert env["PYTHONPATH"].split(os.pathsep)[0] == revisions.baseline.worktree
