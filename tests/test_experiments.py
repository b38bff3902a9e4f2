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
