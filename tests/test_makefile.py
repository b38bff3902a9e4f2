"""The Makefile's jobs, run by a real `make`: the pinned setup runs once and again only when the
pins or pyproject change, `make run` succeeds whenever a verdict was produced (the verdict's own
exit code stays `harness run`'s, for CI), and EXP takes a name or a path."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAMP = ".venv/.setup-done"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make(*args, cwd: Path = ROOT, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def project(tmp_path) -> Path:
    """The Makefile and pyproject.toml beside a .venv whose python is this interpreter."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    return tmp_path


def test_setup_runs_pip_only_when_the_pins_or_pyproject_changed(project):
    first = make("-n", "setup", cwd=project)
    assert "pip install -q torch==" in first.stdout and "--no-deps -e ." in first.stdout
    (project / STAMP).touch()
    again = make("-n", "run", "EXP=x", cwd=project)
    assert "pip install" not in again.stdout, again.stdout
    os.utime(project / "pyproject.toml")  # newer than the stamp, as after an edit
    stamp_time = (project / STAMP).stat().st_mtime
    os.utime(project / "pyproject.toml", (stamp_time + 5, stamp_time + 5))
    assert "pip install -q torch==" in make("-n", "test", cwd=project).stdout


@pytest.mark.parametrize("exp, expected", [
    ("pkda-dAqk", "experiments/pkda-dAqk.yaml"),
    ("elsewhere/mine.yaml", "elsewhere/mine.yaml"),
    ("/abs/path/exp.yml", "/abs/path/exp.yml"),
    ("local.yaml", "local.yaml"),
])
def test_exp_is_a_name_or_a_path(project, exp, expected):
    (project / STAMP).touch()
    out = make("-n", "validate", f"EXP={exp}", cwd=project).stdout
    assert f"-m harness validate {expected}\n" in out, out


def test_a_verdict_is_success_for_make_and_no_verdict_is_not(tmp_path):
    """`make report` (the same verdict rule as `make run`, on a finished run's records: seconds, not
    a whole run) succeeds on a NO-GO and names it; `make run` on a missing file fails with harness's code."""
    from test_report import build_run_dir  # tests/ is on sys.path

    loaded, run_dir = build_run_dir(tmp_path)  # a finished run whose verdict is NO-GO
    roots = f"--profile-root {tmp_path / 'profile'} --reports-root {tmp_path / 'reports'}"
    # -o: the setup stamp counts as up to date (this interpreter already has the pinned stack)
    res = make("-o", STAMP, "report", f"VPY={sys.executable}", f"EXP={loaded.path}", f"ARGS={roots}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"NO-GO: {tmp_path / 'reports' / loaded.exp.name / run_dir.name / 'index.html'}" in res.stdout
    assert "make report: a verdict was produced (harness exit 1: 0 GO, 1 NO-GO, 3 INCONCLUSIVE); make succeeds" \
        in res.stdout
    missing = make("-o", STAMP, "run", f"VPY={sys.executable}", f"EXP={tmp_path / 'no-such.yaml'}")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "make run: no verdict: harness exited 2" in missing.stderr
