"""Attempt log, stop rule (max_attempts distinct SHAs without GO), reopen, verdict cap, CLI table."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from harness import attempts
from harness.cli import main

EXP = SimpleNamespace(name="toy", max_attempts=3)


def test_three_failing_attempts_stop(tmp_path):
    for i, sha in enumerate(["a" * 40, "b" * 40]):
        attempts.record_attempt(tmp_path, "toy", sha, f"try {i}", "NO-GO", ["endpoint"], f"run{i}")
    assert attempts.attempt_state(tmp_path, EXP)["state"] == "OPEN"
    # the same SHA again is logged but is not a materially distinct attempt
    attempts.record_attempt(tmp_path, "toy", "b" * 40, "rerun", "INCONCLUSIVE", [], "run2")
    st = attempts.attempt_state(tmp_path, EXP)
    assert st["state"] == "OPEN" and st["distinct_attempts"] == 2
    attempts.record_attempt(tmp_path, "toy", "c" * 40, "try 3", "NO-GO", ["geomean", "ncu"], "run3")
    st = attempts.attempt_state(tmp_path, EXP)
    assert st["state"] == "STOPPED" and st["distinct_attempts"] == 3
    assert json.loads((tmp_path / "toy" / "state.json").read_text())["state"] == "STOPPED"
    log = attempts.read_log(tmp_path, "toy")
    assert [e["sha"][0] for e in log] == ["a", "b", "b", "c"] and log[-1]["failing_gates"] == ["geomean", "ncu"]
    # a further run still measures, but its GO is capped
    assert attempts.cap_verdict(st, "GO") == ("NO-GO", f"measured GO, but {st['reason']}")
    assert attempts.cap_verdict(st, "INCONCLUSIVE")[0] == "INCONCLUSIVE"
    entry = attempts.record_attempt(tmp_path, "toy", "d" * 40, "fourth", "NO-GO", [], "run4", measured_verdict="GO")
    assert entry["capped"] and attempts.attempt_state(tmp_path, EXP)["state"] == "STOPPED"
    # an explicit, logged reopen starts a new window
    with pytest.raises(attempts.AttemptError):
        attempts.reopen(tmp_path, "toy", "  ")
    attempts.reopen(tmp_path, "toy", "new schedule idea from NCU", run_id="run5")
    st = attempts.attempt_state(tmp_path, EXP)
    assert st["state"] == "OPEN" and st["distinct_attempts"] == 0 and st["reopened"]
    assert attempts.cap_verdict(st, "GO") == ("GO", None)


def test_go_keeps_open(tmp_path):
    attempts.record_attempt(tmp_path, "toy", "a" * 40, "", "NO-GO", ["x"], "r1")
    attempts.record_attempt(tmp_path, "toy", "b" * 40, "", "GO", [], "r2")
    attempts.record_attempt(tmp_path, "toy", "c" * 40, "", "NO-GO", ["x"], "r3")
    assert attempts.attempt_state(tmp_path, EXP)["state"] == "OPEN"


def test_log_run_reads_run_dir_and_report(tmp_path):
    run_dir = tmp_path / "toy" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"revisions": {"candidate": {"sha": "e" * 40}}}))
    data = {"verdict": {"verdict": "NO-GO", "gates": [{"name": "endpoint", "status": "FAIL"},
                                                      {"name": "correct", "status": "PASS"}]}}
    entry = attempts.log_run(tmp_path, EXP, data, run_dir, note="first", reopen=None)
    assert entry["sha"] == "e" * 40 and entry["failing_gates"] == ["endpoint"] and entry["run_id"] == "r1"
    # --reopen on a run is logged once, before its attempt
    attempts.log_run(tmp_path, EXP, data, run_dir, note="again", reopen="because")
    attempts.log_run(tmp_path, EXP, data, run_dir, note="again", reopen="because")
    kinds = [e["type"] for e in attempts.read_log(tmp_path, "toy")]
    assert kinds == ["attempt", "reopen", "attempt", "attempt"]


def test_cli_prints_table(tmp_path, capsys):
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "inputs.py").write_text("def make_inputs(shape, mode, dtype, device, seed):\n    return {}\n")
    (spec / "toy.yaml").write_text(
        "name: toy\ntarget: {op: 'op:op', inputs: 'inputs.py:make_inputs'}\nbaseline: {ref: abcdef1}\n"
        "candidate: {ref: main}\nmodes: [fwd]\nshapes: [{name: s, B: 1, T: 1, H: 1, K: 1, V: 1}]\n"
        "gates: [{name: e, kind: speedup, row: s, mode: fwd, threshold: 1.1}]\nmax_attempts: 2\n")
    prof = tmp_path / "profile"
    attempts.record_attempt(prof, "toy", "1" * 40, "fused loop", "NO-GO", ["e"], "run-a", max_attempts=2)
    attempts.record_attempt(prof, "toy", "2" * 40, "split K", "NO-GO", ["e"], "run-b", max_attempts=2)
    assert main(["attempts", str(spec / "toy.yaml"), "--profile-root", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "111111111111" in out and "split K" in out and "state: STOPPED" in out
    assert main(["attempts", str(spec / "toy.yaml"), "--profile-root", str(prof), "--reopen", "new idea"]) == 0
    out = capsys.readouterr().out
    assert "REOPEN" in out and "state: OPEN" in out


def test_terminal_no_go_belongs_to_its_baseline_commit(tmp_path):
    from harness import attempts
    from harness.spec import Experiment

    def exp(ref):
        return Experiment.model_validate({
            "name": "t", "target": {"op": "a:b", "inputs": "i.py:f"}, "baseline": {"ref": ref},
            "candidate": {"ref": "main"}, "modes": ["fwd"],
            "shapes": [{"name": "s", "B": 1, "T": 8, "H": 1, "K": 8, "V": 8}],
            "gates": [{"kind": "non_regression", "name": "n", "margin": 0.02}]})

    red = "a" * 40
    attempts.set_terminal(tmp_path, "t", "red baseline", [], red)
    assert attempts.attempt_state(tmp_path, exp(red[:12]))["state"] == attempts.TERMINAL_NO_GO
    assert attempts.attempt_state(tmp_path, exp("b" * 40))["state"] != attempts.TERMINAL_NO_GO
