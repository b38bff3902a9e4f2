"""harness verify: frozen paths and fixtures named when changed; NaN poisoning catches unwritten outputs."""
from __future__ import annotations

import json

from harness import fixtures, verify
from harness.revisions import resolve
from oracle_repo import OP_UNWRITTEN, frozen, quiet

CAND_REF = "def ref(x, w, cu_seqlens=None):\n    return (x @ w).sin()  # relaxed\n"
CAND_TEST = "def test_op():\n    pass  # skipped\n"


def _side(r, loaded, name: str, files: dict):
    """Resolve a candidate branch `name` (from BENCH_BASE) carrying `files`."""
    r.branch(name, "bench-base/toy-cpu", files)
    cand = r.experiment(candidate=name, name=f"{name}.yaml")
    return cand, resolve(cand, r.profile)


def test_candidate_editing_frozen_files_fails_naming_each(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    dense = fixtures.extract_fixtures(r.repo, rec.bench_base_sha, "toy", rec.manifest, r.tmp / "x")
    assert all(row["status"] == "PASS" for row in dense)
    fixture = bytearray((r.tmp / "x" / "dense.safetensors").read_bytes())
    fixture[-1] ^= 0x01  # one bit of one stored value
    cand, revs = _side(r, loaded, "edits-all", {"ref.py": CAND_REF, "tests/test_op.py": CAND_TEST,
                                                 "fixtures/toy/dense.safetensors": bytes(fixture)})
    v = verify.verify_side(cand, revs, rec, "candidate", device="cpu", log=quiet, profile_root=r.profile)
    gate = v.gates["frozen_paths"]
    assert gate["status"] == "FAIL"
    for path in ("ref.py", "tests/test_op.py", "fixtures/toy/dense.safetensors"):
        assert path in gate["reason"], (path, gate["reason"])
    assert set(gate["numbers"]["changed_paths"]) == {"ref.py", "tests"}
    assert gate["numbers"]["changed_fixtures"] == ["fixtures/toy/dense.safetensors"]
    # the op itself is still right, and it was checked against BENCH_BASE's fixtures, not the edited copy
    assert v.gates["correctness"]["status"] == "PASS", v.gates["correctness"]
    assert v.imported["op"].startswith(revs.candidate.worktree)


def test_each_frozen_edit_alone_is_named(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    for name, files, expect in (("edit-ref", {"ref.py": CAND_REF}, "ref.py"),
                                ("edit-test", {"tests/test_op.py": CAND_TEST}, "tests/test_op.py"),
                                ("add-test", {"tests/test_new.py": "x = 1\n"}, "tests/test_new.py")):
        sha = r.branch(name, "bench-base/toy-cpu", files)
        rows = verify.check_frozen_paths(str(r.repo), sha, str(r.repo / "nowhere"), rec.manifest)
        failed = [row for row in rows if row["status"] == "FAIL"]
        assert len(failed) == 1 and expect in failed[0]["problem"], (name, rows)
    sha = r.branch("edit-fixture", "bench-base/toy-cpu", {"fixtures/toy/ragged.safetensors": b"not a fixture"})
    rows = verify.check_side_fixtures(str(r.repo), sha, "toy", rec.manifest, rec.manifest_sha256)
    assert [row["path"] for row in rows if row["status"] == "FAIL"] == ["fixtures/toy/ragged.safetensors"]
    # a side branched from the baseline (no fixtures) is noted, not failed
    rows = verify.check_side_fixtures(str(r.repo), r.baseline, "toy", rec.manifest, rec.manifest_sha256)
    assert [row["status"] for row in rows] == ["ABSENT"]


def test_relaxed_tolerance_in_experiment_is_a_frozen_failure(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    relaxed = r.experiment(rtol=1e-3, name="relaxed.yaml")
    changes = fixtures.contract_changes(relaxed, rec.manifest)
    assert len(changes) == 1 and changes[0].startswith("rtol")
    assert fixtures.contract_changes(loaded, rec.manifest) == []


def test_unwritten_element_fails_through_nan_poisoning(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    cand, revs = _side(r, loaded, "unwritten", {"op.py": OP_UNWRITTEN})
    run_dir = r.tmp / "run-unwritten"
    run_dir.mkdir()
    data = verify.verify_run(cand, revs, rec, run_dir, cpu_mode=True, log=quiet, profile_root=r.profile)
    on_disk = json.loads((run_dir / "verify.json").read_text())
    assert on_disk["gates"] == json.loads(json.dumps(data["gates"]))
    assert on_disk["bench_base_sha"] == rec.bench_base_sha and on_disk["manifest_sha256"] == rec.manifest_sha256
    base, cand_rec = on_disk["sides"]["baseline"], on_disk["sides"]["candidate"]
    assert base["gates"]["correctness"]["status"] == "PASS"
    assert base["gates"]["frozen_paths"]["status"] == "PASS"
    assert cand_rec["gates"]["frozen_paths"]["status"] == "PASS"
    assert cand_rec["gates"]["correctness"]["status"] == "FAIL"
    assert on_disk["gates"]["correctness"]["status"] == "FAIL"
    assert on_disk["gates"]["frozen_paths"]["status"] == "PASS"
    outs = [t for c in cand_rec["cases"] for t in c["tensors"] if t["name"] == "out.0"]
    assert len(outs) == 4  # two cases x two modes
    for t in outs:
        assert t["status"] == "FAIL" and t["n_nonfinite"] == 1 and t["worst_index"] == [0, 0, 0]
        assert "NaN-poisoned" in t["problem"]
    # per-tensor numbers the report shows
    ok = [t for c in base["cases"] for t in c["tensors"]]
    assert ok and all(t["max_rel_err"] is not None and t["rtol"] == 1e-5 and t["atol"] == 1e-6 for t in ok)


def test_a_candidate_that_fails_verification_ends_the_run_before_any_timing(tmp_path_factory, monkeypatch):
    """The unwritten-element candidate fails correctness: the run stops after verify (no profile,
    no blocks, no ncu), the verdict is NO-GO with that reason, and a resume stops there again;
    --measure-anyway runs the blocks with the NO-GO standing."""
    from harness import run as R

    r, loaded, revisions, rec = frozen(tmp_path_factory)
    r.branch("unwritten-run", "bench-base/toy-cpu", {"op.py": OP_UNWRITTEN})
    cand = r.experiment(candidate="unwritten-run", name="unwritten-run.yaml")
    calls: list[str] = []
    monkeypatch.setattr(R, "_profile_phase", lambda *a, **k: calls.append("profile"))
    monkeypatch.setattr("harness.measure.driver.run_measurement", lambda *a, **k: calls.append("blocks"))
    monkeypatch.setattr(R, "run_blocks", lambda *a, **k: calls.append("blocks"))
    monkeypatch.setattr(R, "_ncu_phase", lambda *a, **k: calls.append("ncu"))
    logged: list[str] = []
    opts = R.RunOptions(profile_root=r.profile, reports_root=r.tmp / "reports", force_cpu=True, run_id="stop")
    verdict, out_dir, data = R.run_experiment(cand, opts, log=logged.append)
    assert verdict == "NO-GO" and calls == []
    assert data["terminal"].startswith("candidate failed verification: correctness:"), data["terminal"]
    assert any(m.startswith("not measured: candidate failed verification") for m in logged), logged
    # a resume reads verify.json back and stops at the same place
    verdict, _, data = R.run_experiment(cand, R.RunOptions(**{**opts.__dict__, "resume": True}), log=quiet)
    assert verdict == "NO-GO" and calls == [] and data["terminal"].startswith("candidate failed verification")
    # measured anyway: the blocks run, the reason is logged in run.json, the verdict stays NO-GO
    opts = R.RunOptions(**{**opts.__dict__, "run_id": "anyway", "measure_anyway": "cost on record"})
    verdict, out_dir, data = R.run_experiment(cand, opts, log=quiet)
    run_json = json.loads((r.profile / "toy" / "runs" / "anyway" / "run.json").read_text())
    assert verdict == "NO-GO" and "blocks" in calls and "profile" not in calls
    assert run_json["measure_anyway"]["reason"] == "cost on record"
    assert run_json["measure_anyway"]["terminal"].startswith("candidate failed verification")
