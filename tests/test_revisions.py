"""harness/revisions.py: a worktree folder that is no worktree of the target repository (its .git
gone, or carried from another machine) is recreated at the recorded SHA, not a crash."""
from __future__ import annotations

import shutil

import git
import pytest

from harness.revisions import ensure_worktrees, resolve
from harness.spec import load_experiment

GATE = "- {kind: speedup, name: e, row: small, mode: fwd, threshold: 1.2}\n"


def resolved(temp_repo):
    temp_repo.branch("cand", work=2)
    loaded = load_experiment(temp_repo.experiment("wt", "cand", GATE))
    return loaded, resolve(loaded, temp_repo.root / "profile")


def head(path) -> str:
    return git.Repo(path).head.commit.hexsha


@pytest.mark.parametrize("damage", ["no_git", "git_file_to_nowhere", "another_repository", "empty_folder"])
def test_a_broken_worktree_folder_is_recreated_on_resolve_and_on_resume(temp_repo, tmp_path, damage):
    loaded, revs = resolved(temp_repo)
    wt = temp_repo.root / "profile" / "wt" / "worktrees" / "candidate"
    if damage == "no_git":
        (wt / ".git").unlink()  # the checkout's files stay, its link to the repository is gone
    elif damage == "git_file_to_nowhere":  # carried from another machine
        (wt / ".git").write_text("gitdir: /elsewhere/on/another/machine/.git/worktrees/candidate\n")
    elif damage == "another_repository":
        shutil.rmtree(wt)
        git.Repo.init(wt)
    else:
        shutil.rmtree(wt)
        wt.mkdir()
        (wt / "stray.txt").write_text("x")
    ensure_worktrees(revs)  # the resume path
    assert head(wt) == revs.candidate.sha and (wt / "op.py").is_file() and not (wt / "stray.txt").exists()
    assert "WORK = 2" in (wt / "op.py").read_text()

    (wt / ".git").unlink()
    again = resolve(loaded, temp_repo.root / "profile")  # the fresh-run path
    assert head(wt) == again.candidate.sha == revs.candidate.sha
    assert head(temp_repo.root / "profile" / "wt" / "worktrees" / "baseline") == revs.baseline.sha


def test_a_worktree_moved_off_its_sha_is_put_back_on_resume(temp_repo):
    _, revs = resolved(temp_repo)
    wt = temp_repo.root / "profile" / "wt" / "worktrees" / "baseline"
    git.Repo(wt).git.checkout("--detach", revs.candidate.sha)
    ensure_worktrees(revs)
    assert head(wt) == revs.baseline.sha
