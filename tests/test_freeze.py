"""harness freeze: baseline gate (twice), fixtures in safetensors, BENCH_BASE by plumbing, terminal NO-GO."""
from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from harness import attempts, fixtures
from harness.cli import main
from harness.spec import LoadedExperiment
from oracle_repo import OP_WRONG, OracleRepo, frozen, git, quiet


def blob(repo, rev_path: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "cat-file", "blob", rev_path], check=True,
                          capture_output=True).stdout


def test_freeze_creates_bench_base_with_matching_manifest(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    assert rec.status == "PASS" and not rec.terminal, rec.failures
    assert rec.gate["status"] == "PASS"
    assert rec.reproducibility["status"] == "PASS" and rec.reproducibility["bitwise"] is True
    sha = git(r.repo, "rev-parse", "refs/heads/bench-base/toy-cpu")
    assert sha == rec.bench_base_sha
    assert git(r.repo, "rev-parse", f"{sha}^") == r.baseline
    # only fixtures/toy/ was added on top of the baseline
    added = git(r.repo, "diff", "--name-status", r.baseline, sha).splitlines()
    assert sorted(added) == ["A\tfixtures/toy/dense.safetensors", "A\tfixtures/toy/manifest.json",
                             "A\tfixtures/toy/ragged.safetensors"]
    raw = blob(r.repo, f"{sha}:fixtures/toy/manifest.json")
    manifest = json.loads(raw)
    assert hashlib.sha256(raw).hexdigest() == rec.manifest_sha256
    assert manifest == rec.manifest
    assert set(manifest["files"]) == {"dense.safetensors", "ragged.safetensors"}
    for fname, digest in manifest["files"].items():
        assert hashlib.sha256(blob(r.repo, f"{sha}:fixtures/toy/{fname}")).hexdigest() == digest
    assert (manifest["seed"], manifest["dtype"], manifest["rtol"], manifest["atol"]) == (7, "float32", 1e-5, 1e-6)
    assert [c["name"] for c in manifest["cases"]] == ["dense", "ragged"]
    assert manifest["cases"][1]["shape"]["seqlens"] == [3, 0, 4]
    assert {"in.kwargs.x", "in.kwargs.w", "in.kwargs.cu_seqlens", "out.0", "cot.0", "grad.kwargs.x",
            "grad.kwargs.w"} <= set(manifest["cases"][1]["tensors"])
    # frozen paths: declared ones (a file and a directory), hashed at BENCH_BASE
    assert set(manifest["frozen_paths"]) == {"ref.py", "tests"}
    assert manifest["frozen_paths"]["ref.py"]["sha256"] == hashlib.sha256(blob(r.repo, f"{sha}:ref.py")).hexdigest()
    assert manifest["frozen_paths"]["tests"]["files"]["test_op.py"] == hashlib.sha256(
        blob(r.repo, f"{sha}:tests/test_op.py")).hexdigest()
    # the user's checkout and index are untouched
    assert git(r.repo, "status", "--porcelain") == ""
    assert git(r.repo, "rev-parse", "HEAD") == r.baseline
    assert git(r.repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    saved = fixtures.load_freeze(r.profile, "toy")
    assert saved.bench_base_sha == sha and saved.runs and saved.runs[0]["cases"][0]["tensors"]
    assert attempts.attempt_state(r.profile, loaded.exp)["state"] == "OPEN"


def test_second_freeze_reuses_bench_base(tmp_path_factory, capsys):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    again = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
    assert again.status == "PASS" and again.bench_base_reused and again.bench_base_sha == rec.bench_base_sha
    assert again.manifest_sha256 == rec.manifest_sha256
    # the CLI with --reuse returns the green record without re-running
    rc = main(["freeze", str(loaded.path), "--profile-root", str(r.profile), "--device", "cpu", "--reuse"])
    out = capsys.readouterr().out
    assert rc == 0 and rec.bench_base_sha in out


def test_refuses_to_move_bench_base(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    from pathlib import Path

    fixture_dir = Path(rec.artifacts) / "run1" / "fixtures"
    relaxed = {**rec.manifest, "rtol": 1e-2}
    with pytest.raises(fixtures.FreezeError, match=r"refusing to move.*rtol"):
        fixtures.commit_bench_base(r.repo, "toy", r.baseline, fixture_dir, relaxed, log=quiet, device="cpu")
    with pytest.raises(fixtures.FreezeError, match="not the baseline"):
        fixtures.commit_bench_base(r.repo, "toy", rec.bench_base_sha, fixture_dir, rec.manifest, log=quiet, device="cpu")
    assert git(r.repo, "rev-parse", "refs/heads/bench-base/toy-cpu") == rec.bench_base_sha


def test_run_against_a_bench_base_of_other_content_is_bad_input_saying_how_to_settle_it(tmp_path, capsys):
    """An oracle branch frozen from another definition is the user's to settle: exit 2 naming the
    branch and how to delete it, never a harness error (4) or a verdict; the branch stays."""
    r = OracleRepo(tmp_path / "own")  # its own repository: the shared frozen one's branch never moves
    loaded = r.experiment()
    rec = fixtures.freeze(loaded, r.resolve(loaded), r.profile, device="cpu", recheck=True, log=quiet)
    from pathlib import Path

    fixture_dir = Path(rec.artifacts) / "run1" / "fixtures"
    git(r.repo, "branch", "-D", "bench-base/toy-cpu")
    other, _ = fixtures.commit_bench_base(r.repo, "toy", r.baseline, fixture_dir, {**rec.manifest, "rtol": 1e-2},
                                          log=quiet, device="cpu")
    fresh = r.profile.parent / "fresh"
    rc = main(["run", str(loaded.path), "--profile-root", str(fresh / "profile"), "--reports-root",
               str(fresh / "reports"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "bench-base/toy-cpu" in err and "branch -D bench-base/toy-cpu" in err and "rtol" in err, err
    assert git(r.repo, "rev-parse", "refs/heads/bench-base/toy-cpu") == other
    assert not (fresh / "reports").exists() or not list((fresh / "reports").rglob("report.json"))  # no verdict


def test_missing_frozen_path_is_an_error_naming_it(tmp_path_factory):
    r, loaded, revisions, rec = frozen(tmp_path_factory)
    exp = loaded.exp.model_copy(update={"frozen_paths": ["ref.py", "kernels/missing.py"]})
    broken = LoadedExperiment(exp=exp, path=loaded.path, root=loaded.root)
    with pytest.raises(fixtures.FreezeError, match="kernels/missing.py"):
        fixtures.freeze(broken, revisions, r.profile, device="cpu", recheck=True, log=quiet)


def test_wrong_baseline_is_terminal_no_go(tmp_path):
    r = OracleRepo(tmp_path, op_src=OP_WRONG)
    loaded = r.experiment()
    revisions = r.resolve(loaded)
    rec = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
    assert rec.status == "FAIL" and rec.terminal and rec.gate["status"] == "FAIL"
    assert rec.bench_base_sha is None
    assert any("out.0" in f and "outside atol + rtol" in f for f in rec.failures)
    assert git(r.repo, "branch", "--list", "bench-base/*") == ""
    state = json.loads((r.profile / "toy" / "state.json").read_text())
    assert state["state"] == "TERMINAL_NO_GO" and state["terminal"]["baseline_sha"] == r.baseline
    assert state["terminal"]["failures"]
    assert attempts.attempt_state(r.profile, loaded.exp)["state"] == "TERMINAL_NO_GO"
    with pytest.raises(attempts.AttemptError, match="TERMINAL_NO_GO"):
        attempts.reopen(r.profile, "toy", "try again")
    # terminal: a second freeze does not re-run or relax anything
    again = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
    assert again.terminal and again.created == rec.created
    assert attempts.cap_verdict(attempts.attempt_state(r.profile, loaded.exp), "GO")[0] == "NO-GO"


def test_two_runs_must_agree(tmp_path):
    """Reproducibility between the two baseline runs: bitwise passes, within tolerance passes, beyond fails."""
    import torch
    from safetensors.torch import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    x = torch.linspace(-1, 1, 10)
    save_file({"out.0": x, "grad.kwargs.x": x.clone()}, str(a / "c.safetensors"))
    save_file({"out.0": x + 1e-7, "grad.kwargs.x": x.clone()}, str(b / "c.safetensors"))
    rows, fails = fixtures._compare_dirs(a, b, 1e-5, 1e-6, "op output")
    assert not fails and {r["tensor"]: r["bitwise"] for r in rows} == {"out.0": False, "grad.kwargs.x": True}
    save_file({"out.0": x + 1e-3, "grad.kwargs.x": x.clone()}, str(b / "c.safetensors"))
    rows, fails = fixtures._compare_dirs(a, b, 1e-5, 1e-6, "op output")
    assert len(fails) == 1 and "c.safetensors:out.0 differs between two runs" in fails[0]
    (b / "d.safetensors").write_bytes((a / "c.safetensors").read_bytes())
    _, fails = fixtures._compare_dirs(a, b, 1e-5, 1e-6, "op output")
    assert any("only one of the two runs" in f for f in fails)


# an op whose float32 path (the only one "low-precision" inputs reach) is wrong by 3%, like a
# candidate kernel that only bf16 inputs dispatch to: the float64 cases cannot see it
OP_LOW_PATH_WRONG = """\
import torch


def op(x, w, cu_seqlens=None):
    y = (x @ w).sin()
    return y * 1.03 if x.dtype == torch.float32 else y
"""


def _low_precision_experiment(r, rel_l2: float, name: str):
    loaded = r.experiment(name=name)
    src = loaded.path.read_text().replace(
        "  dtype: float32\n  rtol:", f"  dtype: float64\n  low_precision: [{{dtype: float32, rel_l2: {rel_l2}}}]\n  rtol:")
    loaded.path.write_text(src)
    from harness.spec import load_experiment
    return load_experiment(loaded.path)


def test_low_precision_cases_exercise_the_low_precision_path(tmp_path):
    from oracle_repo import OracleRepo
    r = OracleRepo(tmp_path, op_src=OP_LOW_PATH_WRONG)
    loaded = _low_precision_experiment(r, 1e-4, "lp.yaml")
    revisions = r.resolve(loaded)
    rec = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
    # the float64 cases pass; each case's float32 variant fails on relative L2, named
    assert rec.status == "FAIL"
    assert {f.split("case ")[1].split(":")[0] for f in rec.failures} == {
        "dense.float32 fwd", "dense.float32 fwdbwd", "ragged.float32 fwd", "ragged.float32 fwdbwd"}, rec.failures
    assert all("relative L2 error 0.03" in f for f in rec.failures), rec.failures


def test_low_precision_manifest_and_contract(tmp_path):
    from oracle_repo import OracleRepo
    r = OracleRepo(tmp_path)
    loaded = _low_precision_experiment(r, 1e-5, "lp.yaml")
    revisions = r.resolve(loaded)
    rec = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
    assert rec.status == "PASS", rec.failures
    names = [c["name"] for c in rec.manifest["cases"]]
    assert names == ["dense", "ragged", "dense.float32", "ragged.float32"]
    low = [c for c in rec.manifest["cases"] if c.get("input_dtype")]
    assert {c["rel_l2"] for c in low} == {1e-5}
    assert rec.manifest["low_precision"] == [{"dtype": "float32", "rel_l2": 1e-5}]
    # the stored inputs of a variant are float32, its reference outputs float64
    files = {t: i for c in low for t, i in c["tensors"].items()}
    assert files["in.kwargs.x"]["dtype"] == "F32" and files["out.0"]["dtype"] == "F64", files
    tensors = [t for run in rec.runs for c in run["cases"] if "." in c["case"] for t in c["tensors"]]
    assert tensors and all(t["criterion"] == "rel_l2" and t["rel_l2_err"] < 1e-6 for t in tensors)
    # relaxing the bound after the freeze is a contract change, named
    relaxed = loaded.path.read_text().replace("rel_l2: 1e-05", "rel_l2: 0.001").replace("rel_l2: 1.0e-05", "rel_l2: 0.001")
    loaded.path.write_text(relaxed)
    from harness.spec import load_experiment
    changes = fixtures.contract_changes(load_experiment(loaded.path), rec.manifest)
    assert changes and changes[0].startswith("low_precision"), changes


def test_bf16_fixtures_are_cuda_only(tmp_path):
    from oracle_repo import OracleRepo
    r = OracleRepo(tmp_path)
    loaded = r.experiment(name="bf.yaml")
    loaded.path.write_text(loaded.path.read_text().replace(
        "  dtype: float32\n  rtol:", "  dtype: float32\n  low_precision: [{dtype: bfloat16, rel_l2: 0.02}]\n  rtol:"))
    from harness.spec import load_experiment
    loaded = load_experiment(loaded.path)
    assert [c["name"] for c in fixtures.cases_for(loaded, "cpu")] == ["dense", "ragged"]
    assert [c["name"] for c in fixtures.cases_for(loaded, "cuda")][2:] == ["dense.bfloat16", "ragged.bfloat16"]
    assert fixtures.skipped_low_precision(loaded, "cpu") == ["bfloat16"]
    assert fixtures.branch_name("x", "cpu") == "bench-base/x-cpu" and fixtures.branch_name("x", "cuda:0") == "bench-base/x"


OP_RAISES = """\
def op(x, w, cu_seqlens=None):
    raise RuntimeError("0 active drivers ([]). There should only be one.")
"""


def test_a_baseline_that_raises_is_a_setup_error_not_a_red_baseline(tmp_path):
    """Nothing measured is no verdict: the op raising (an autotuner wanting a GPU driver under the
    interpreter) names target.op and writes no terminal state; a measured mismatch is terminal."""
    from harness.spec import SetupError

    r = OracleRepo(tmp_path, op_src=OP_RAISES)
    loaded = r.experiment()
    with pytest.raises(SetupError) as e:
        fixtures.freeze(loaded, r.resolve(loaded), r.profile, device="cpu", recheck=True, log=quiet)
    assert f"{loaded.path}:4: target.op: freeze: baseline gate run 1/2: the op raised on case dense fwd: " \
           "RuntimeError: 0 active drivers" in str(e.value)
    assert attempts.read_state_file(r.profile, "toy") == {} and fixtures.load_freeze(r.profile, "toy") is None


def test_freeze_and_verify_commands_write_under_the_results_root(tmp_path, monkeypatch, capsys):
    r = OracleRepo(tmp_path)
    path = str(r.experiment().path)
    monkeypatch.setenv("HARNESS_RESULTS", str(tmp_path / "res"))
    assert main(["freeze", path, "--device", "cpu"]) == 0, capsys.readouterr()
    assert fixtures.load_freeze(tmp_path / "res" / "profile", "toy").status == "PASS"
    assert main(["verify", path, "--device", "cpu", "--side", "candidate"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "gate correctness: PASS" in out and f"record: {tmp_path / 'res' / 'profile' / 'toy' / 'freeze.json'}" in out


def test_a_cpu_freeze_and_verify_run_the_cpu_profiles_stand_in_cases(tmp_path):
    """cpu.fixture_shapes: a CPU freeze (bench-base/<name>-cpu) runs and freezes the stand-in of a case
    (the other case as declared), verify checks both sides against it at those dims, and the GPU
    oracle's contract keeps the declared shapes."""
    from harness import verify
    from harness.spec import load_experiment

    r = OracleRepo(tmp_path)
    path = r.experiment().path
    path.write_text(path.read_text() + "cpu:\n  shapes: [{name: s1, B: 1, T: 2, H: 1, K: 4, V: 3}]\n"
                                       "  fixture_shapes: [{name: ragged, seqlens: [2, 0, 1], H: 1, K: 4, V: 2}]\n")
    loaded = load_experiment(path)
    assert [c["shape"] for c in fixtures.cases_for(loaded, "cpu")] == [
        {"name": "dense", "B": 2, "T": 5, "H": 1, "K": 4, "V": 3},
        {"name": "ragged", "seqlens": [2, 0, 1], "H": 1, "K": 4, "V": 2}]
    assert fixtures.cases_for(loaded, "cuda")[1]["shape"]["seqlens"] == [3, 0, 4]
    lines: list[str] = []
    revisions = r.resolve(loaded)
    rec = fixtures.freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=lines.append)
    assert rec.status == "PASS" and rec.bench_base_branch == "bench-base/toy-cpu", rec.failures
    ragged = rec.manifest["cases"][1]
    assert ragged["shape"]["seqlens"] == [2, 0, 1] and ragged["tensors"]["in.kwargs.x"]["shape"] == [1, 3, 4]
    assert ragged["tensors"]["out.0"]["shape"] == [1, 3, 2]
    # both baseline-gate runs at once on a CPU, the dims each case ran at in the log
    assert any(line.startswith("freeze: baseline gate runs 1 and 2 at once on ") and
               "dense B2 T5 H1 K4 V3; ragged seqlens[2, 0, 1] H1 K4 V2" in line for line in lines), lines
    assert fixtures.contract_changes(loaded, rec.manifest, "cpu") == []
    [change] = fixtures.contract_changes(loaded, rec.manifest, "cuda")
    assert change.startswith("cases: frozen") and "[3, 0, 4]" in change
    data = verify.verify_run(loaded, revisions, rec, tmp_path / "run", cpu_mode=True, log=quiet)
    assert {k: g["status"] for k, g in data["gates"].items()} == {"correctness": "PASS", "frozen_paths": "PASS"}
    for side in ("baseline", "candidate"):
        checked = {(c["case"], c["mode"]) for c in data["sides"][side]["cases"] if c["status"] == "PASS"}
        assert checked == {(n, m) for n in ("dense", "ragged") for m in ("fwd", "fwdbwd")}, data["sides"][side]["cases"]
