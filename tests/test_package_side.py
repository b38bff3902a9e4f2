"""A side can be an installed package (e.g. the public op at a pinned version) instead of a git
revision: its op is imported as installed, its version checked at every block start."""
from __future__ import annotations

import json
import textwrap

import pytest
from conftest import OP_TEMPLATE
from test_e2e import run_exp


def fake_install(site, version: str, work: int) -> None:
    """A minimal installed distribution: the package and its dist-info metadata."""
    (site / "fakeop").mkdir(parents=True)
    (site / "fakeop" / "__init__.py").write_text(OP_TEMPLATE.format(work=work))
    info = site / f"fakeop-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakeop\nVersion: {version}\n")


def experiment(repo, site, declared: str, name: str):
    text = textwrap.dedent(f"""\
        name: {name}
        target:
          op: op:op
          inputs: inputs.py:make_inputs
        baseline:
          package: {{name: fakeop, version: "{declared}"}}
          op: fakeop:op
          env: {{PYTHONPATH: "{site}"}}
        candidate:
          ref: fast
        modes: [fwd]
        dtype: float32
        blocks: 3
        samples_per_block: 6
        warmup: 1
        # a 4x effect: three pairs and a few rounds resolve it; no A/A control (not the point here)
        measure: {{pairs: 3, max_pairs: 3, min_rounds: 6, max_rounds: 12, row_budget_s: 20, control: false}}
        shapes:
          - {{name: small, B: 4, T: 256, H: 1, K: 256, V: 256}}
        gates:
          - {{kind: speedup, name: endpoint, row: small, mode: fwd, threshold: 1.25}}
        """)
    path = repo.root / "experiments" / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.timing  # a verdict from CPU timings (the marker in pyproject.toml)
def test_installed_package_baseline_against_git_candidate(temp_repo, tmp_path):
    site = tmp_path / "site"
    fake_install(site, "1.2.3", work=8)
    temp_repo.branch("fast", work=2)
    res = run_exp(temp_repo, experiment(temp_repo, site, "1.2.3", "pkg-side"))
    assert res.returncode == 0, res.stdout + res.stderr
    [report] = (temp_repo.root / "reports" / "pkg-side").glob("*/report.json")
    data = json.loads(report.read_text())
    base = data["provenance"]["baseline"]
    assert base["kind"] == "package" and base["ref"] == "fakeop==1.2.3" and base["worktree"] == ""
    assert data["verdict"] == "GO"


def test_package_version_mismatch_is_a_setup_error_naming_both_versions(temp_repo, tmp_path):
    """The installed package is not the declared version: no worker of that side can start, so the run
    stops with exit 2 naming the field and both versions; nothing is a verdict, nothing an attempt."""
    site = tmp_path / "site"
    fake_install(site, "1.2.3", work=4)
    temp_repo.branch("fast", work=2)
    res = run_exp(temp_repo, experiment(temp_repo, site, "9.9.9", "pkg-mismatch"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "baseline.package" in res.stderr and "fakeop is 1.2.3, the side declares 9.9.9" in res.stderr, res.stderr
    assert not list((temp_repo.root / "reports" / "pkg-mismatch").glob("*/report.json"))
    assert not (temp_repo.root / "profile" / "pkg-mismatch" / "attempts.jsonl").exists()


def test_package_side_cannot_be_frozen(tmp_path):
    from harness.spec import SpecError, load_experiment

    (tmp_path / "inputs.py").write_text("def make_inputs(shape, mode, dtype, device, seed):\n    return {}\n")
    (tmp_path / "e.yaml").write_text(textwrap.dedent("""\
        name: e
        target: {op: a:b, inputs: inputs.py:make_inputs}
        baseline: {package: {name: fla-core, version: 0.6.0}, op: "fla.ops.precond_kda:chunk_precond_kda"}
        candidate: {ref: main}
        modes: [fwd]
        shapes: [{name: s, B: 1, T: 64, H: 1, K: 64, V: 64}]
        gates: [{kind: correctness, name: c}]
        fixture_shapes: [{name: s, B: 1, T: 64, H: 1, K: 64, V: 64}]
        fixtures: {reference: a:b, cases: [s], rtol: 0.001, atol: 0.0001}
        """))
    with pytest.raises(SpecError, match="fixtures: needs a git baseline"):
        load_experiment(tmp_path / "e.yaml")
    (tmp_path / "e.yaml").write_text((tmp_path / "e.yaml").read_text().replace(
        "baseline: {package: {name: fla-core, version: 0.6.0},", "baseline: {ref: 0123abc, package: {name: x, version: '1'},"))
    with pytest.raises(SpecError, match="exactly one of `ref`"):
        load_experiment(tmp_path / "e.yaml")
