"""Agreement gate: both sides on the same inputs, every output and gradient within tolerance."""
from __future__ import annotations

import json

from test_e2e import run_exp

AGREE = """\
- {kind: agreement, name: same-function, rows: [small], modes: [fwd, fwdbwd], rtol: 1.0e-5, atol: 1.0e-6}
"""


def agreement_record(repo, name) -> dict:
    [path] = (repo.root / "profile" / name / "runs").glob("*/agreement.json")
    return json.loads(path.read_text())


def test_same_function_agrees_and_a_different_one_fails_naming_the_tensor(temp_repo):
    temp_repo.branch("same", work=4, message="candidate: same rounds, new commit")
    temp_repo.branch("other", work=3)
    exp = temp_repo.experiment("agree", "same", AGREE, extra="modes: [fwd, fwdbwd]\n")
    exp.write_text(exp.read_text().replace("modes: [fwd]\n", "", 1))
    res = run_exp(temp_repo, exp)
    assert res.returncode in (0, 3), res.stdout + res.stderr
    rec = agreement_record(temp_repo, "agree")
    assert rec["gate"]["status"] == "PASS"
    # fwd: the output; fwdbwd: the output and both gradients
    assert sorted((c["mode"], c["tensor"]) for c in rec["checks"]) == [("fwd", "0"), ("fwdbwd", "0"), ("fwdbwd", "1"), ("fwdbwd", "2")]
    # agreed outputs are dropped once compared (they are hundreds of MB at model rows); logs stay
    [work] = (temp_repo.root / "profile" / "agree" / "runs").glob("*/agreement-work")
    assert not list(work.glob("*.safetensors")) and (work / "candidate.log").exists()

    exp2 = temp_repo.experiment("disagree", "other", AGREE, extra="modes: [fwd, fwdbwd]\n")
    exp2.write_text(exp2.read_text().replace("modes: [fwd]\n", "", 1))
    res = run_exp(temp_repo, exp2)
    assert res.returncode == 1, res.stdout + res.stderr
    rec = agreement_record(temp_repo, "disagree")
    assert rec["gate"]["status"] == "FAIL" and "small/fwd 0: worst ratio" in rec["gate"]["reason"]
    # a disagreement keeps both sides' outputs for a look
    [work] = (temp_repo.root / "profile" / "disagree" / "runs").glob("*/agreement-work")
    assert sorted(p.name for p in work.glob("*.safetensors")) == ["baseline.safetensors", "candidate.safetensors"]
    [report] = (temp_repo.root / "reports" / "disagree").glob("*/report.json")
    gate = next(g for g in json.loads(report.read_text())["gates"] if g["name"] == "same-function")
    assert gate["status"] == "FAIL"


def test_a_hanging_worker_times_out_with_its_log_and_stacks(tmp_path):
    import sys

    from harness.agreement import run_worker

    code = ("import faulthandler, time; print('first row: started', flush=True); "
            "faulthandler.dump_traceback_later(0.5, repeat=True); time.sleep(30)")
    log = tmp_path / "side.log"
    problem = run_worker([sys.executable, "-c", code], log, {}, tmp_path, timeout=2)
    assert problem.startswith("worker timed out after 2 s") and "first row: started" in problem
    text = log.read_text()
    assert "first row: started" in text and "Thread" in text  # the stack dump reached the log
    assert run_worker([sys.executable, "-c", "print('ok')"], tmp_path / "ok.log", {}, tmp_path, timeout=30) is None
    failed = run_worker([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "bad.log", {}, tmp_path, timeout=30)
    assert failed.startswith("worker exited 3")


def test_declared_side_follows_the_run_record(tmp_path):
    from harness.records import declared_side, run_is_aa

    assert not run_is_aa(tmp_path)  # no run.json yet: each side its own
    (tmp_path / "run.json").write_text(json.dumps({"aa": False}))
    assert not run_is_aa(tmp_path) and declared_side("candidate", False) == "candidate"
    (tmp_path / "run.json").write_text(json.dumps({"aa": True}))
    assert run_is_aa(tmp_path)
    assert declared_side("candidate", True) == "baseline" and declared_side("baseline", True) == "baseline"
