"""Every experiment committed under experiments/ validates, and its pinned commits resolve in its
target repository (this one, or a clone under targets/ when it has been made)."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.spec import load_experiment

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "experiments").glob("*.yaml"))


def test_there_are_experiments():
    assert {p.stem for p in FILES} >= {"pkda-dAqk", "pkda-aa", "pkda-vs-fla"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_experiment_validates_and_its_commits_exist(path):
    import git

    loaded = load_experiment(path)
    exp = loaded.exp
    assert exp.name == path.stem
    if loaded.target_repo != ROOT and not (loaded.target_repo / ".git").exists():
        # another repository's clone, made by a tool (fla's: bash tools/fla_target.sh)
        pytest.skip(f"target repository {loaded.target_repo} is not cloned here")
    repo = git.Repo(loaded.target_repo)
    for side in (exp.baseline, exp.candidate):
        if side.ref is not None:
            # pinned SHAs must be reachable from this checkout's history (a fresh clone of main)
            assert repo.commit(side.ref).hexsha.startswith(side.ref) or side.ref == "HEAD"


# --- the CPU smoke of the main job -------------------------------------------------------------------

def chunk_heads(shape) -> int:
    """64-token chunks times heads of one PKDA call at `shape` (a varlen shape's chunks summed over its
    sequences): the number of programs the interpreter runs one by one, what a call's cost grows with."""
    from harness.gates import shape_dims

    dims = shape_dims(shape)
    return dims["B"] * dims["NT"] * dims["H"]


def test_the_cpu_smoke_of_the_main_job_stays_small():
    """`make run EXP=pkda-dAqk` without a GPU runs every phase under Triton's interpreter, where one
    call costs seconds (README, "Without a GPU": minutes on the 2-core CI machine). The op calls its
    cpu profile makes, phase by phase, as the harness derives them, are bounded here, and so is each
    call's size; so is what every phase still exercises."""
    from harness import fixtures, profile
    from harness.measure.sides import BenchSettings
    from harness.spec import Shape

    loaded = load_experiment(ROOT / "experiments" / "pkda-dAqk.yaml")
    exp = loaded.exp
    settings = BenchSettings.for_machine(loaded, cpu_mode=True)
    m = settings.measure
    cases = [Shape(**c["shape"]) for c in fixtures.cases_for(loaded, "cpu")]
    job = profile.build_job(loaded, "unused", Path("unused.json"), cpu_mode=True)
    profiled = [Shape(**s) for s, _ in job["rows"]]
    workers = m.max_pairs * (2 + m.control)
    calls = {  # at most, and a training step is one call per layer
        "freeze and verify": 4 * len(cases) * len(exp.modes),  # two freeze runs and two verified sides
        "profile": len(job["rows"]) * (job["warmup"] + 2 * job["iters"]),  # timed calls, then profiled ones
        "measurement": len(settings.shapes) * len(exp.modes) * workers
        * (settings.warmup + m.max_rounds * m.calls_per_burst),
        "training": sum(workers * (t.warmup_steps + m.max_rounds * t.steps) * t.layers for t in settings.training),
    }
    assert calls == {"freeze and verify": 16, "profile": 4, "measurement": 16, "training": 12}, calls
    assert (settings.warmup, job["warmup"], job["iters"], m.max_pairs, m.max_rounds, m.calls_per_burst) == (0, 0, 1, 2, 2, 1)
    sizes = {s.name: chunk_heads(s) for s in [*cases, *settings.shapes, *profiled]}
    assert max(sizes.values()) <= 2, sizes
    assert all(t.B * -(-t.T // 64) * t.heads <= 1 for t in settings.training)
    # still every phase's point: the oracle's cases have K != V both ways and an empty sequence ...
    assert {(s.dims["K"], s.dims["V"]) for s in cases} == {(64, 128), (128, 64)}
    assert any(s.seqlens and 0 in s.seqlens for s in cases) and any(s.seqlens is None and s.dims["T"] > 64 for s in cases)
    # ... the profile runs the Amdahl gate's row, which is measured in every mode, and so is a training row
    gated = {g.row for g in exp.gates if g.kind == "amdahl"}
    assert {s.name for s in profiled} == gated and {s.name for s in settings.shapes} == gated
    assert len(exp.modes) == 2
    assert [t.name for t in settings.training] == ["train_dense_B1_T2048"]
    # the GPU oracle keeps its declared cases
    assert [Shape(**c["shape"]) for c in fixtures.cases_for(loaded, "cuda") if "input_dtype" not in c] == \
        [exp.shape(n) for n in exp.fixtures.cases]
