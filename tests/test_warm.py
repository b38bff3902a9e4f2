"""harness warm's job list: one process per side and distinct kernel specialisation, and one per
side and training row (the model calls the op with its own head dims and varlen flag)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from harness.spec import load_experiment
from harness.warm import warm_jobs

ROOT = Path(__file__).resolve().parents[1]


def _sides():
    return [SimpleNamespace(side=s, worktree=f"/wt/{s}", kind="git", package=None, version=None)
            for s in ("baseline", "candidate")]


def test_pkda_daqk_warms_distinct_specialisations_and_training_rows():
    loaded = load_experiment(ROOT / "experiments" / "pkda-dAqk.yaml")
    jobs = warm_jobs(loaded, _sides())
    op_jobs = [j for j in jobs if "training" not in j]
    train_jobs = [j for j in jobs if "training" in j]
    per_side = {(j["shape"]["name"], j["dtype"]) for j in op_jobs if j["side"] == "baseline"}
    # bf16 rows differing only in B/T share kernels: the D128 rows of H16 collapse to one
    assert ("B2_T16384_H16_D128", "bfloat16") in per_side and ("B4_T2048_H16_D128", "bfloat16") not in per_side
    assert ("varlen_uneven_K128_V64", "bfloat16") in per_side
    # fixtures in fp32 and in each low-precision dtype
    assert ("dense_K64_V128", "float32") in per_side and ("dense_K64_V128", "bfloat16") in per_side
    assert len(op_jobs) == 2 * len(per_side)
    names = sorted((j["side"], j["shape"]["name"]) for j in train_jobs)
    assert names == sorted((s, t.name) for s in ("baseline", "candidate") for t in loaded.exp.training)
    for j in train_jobs:
        (row,) = j["training"]
        assert row["warmup_steps"] == 1 and row["steps"] == 1
        assert Path(row["model_file"]).is_file() and row["model_fn"] == "build_model"


def test_no_fixtures_leaves_out_fixture_cases():
    loaded = load_experiment(ROOT / "experiments" / "pkda-dAqk.yaml")
    names = {j["shape"]["name"] for j in warm_jobs(loaded, _sides(), fixtures=False)}
    assert not names & {"dense_K64_V128", "varlen_K128_V64"}


def test_an_installed_package_side_warms_its_own_op():
    """pkda-vs-fla: the fla-core side must compile (and tune) fla's kernels, not the target op."""
    loaded = load_experiment(ROOT / "experiments" / "pkda-vs-fla-2rows.yaml")
    jobs = warm_jobs(loaded, _sides())
    base = {j["op"] for j in jobs if j["side"] == "baseline"}
    cand = {j["op"] for j in jobs if j["side"] == "candidate"}
    assert base == {"fla.ops.precond_kda:chunk_precond_kda"} and cand == {"kernels.pkda:chunk_precond_kda"}
    assert all(j["package"] == {"name": "fla-core", "version": "0.6.0"} for j in jobs if j["side"] == "baseline")
    assert all(j["package"] is None for j in jobs if j["side"] == "candidate")
