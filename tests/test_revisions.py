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


def _ensure_at_once(args) -> str:
    """One of several processes making the same worktree at the same moment (a barrier of start times)."""
    import time

    from harness.revisions import _ensure_worktree, open_repo

    repo_path, wt, sha, start_at = args
    time.sleep(max(0.0, start_at - time.time()))
    try:
        _ensure_worktree(open_repo(repo_path), wt, sha)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test counts what failed and how
        return f"{type(e).__name__}: {e}"


def test_runs_of_one_experiment_at_once_share_its_worktrees(temp_repo, tmp_path):
    """A Slurm job and a local run of one experiment started together both found the worktree folder
    missing, and the second `git worktree add` failed on the first's folder (exit 4 in CI); a lock
    per folder still let one process's `git worktree prune` race another's add of the other side (2
    failures in 9 runs of this test). Six processes making the two worktrees at the same moment all
    succeed, at the right SHAs (20 of 20 runs with the lock per repository)."""
    import multiprocessing as mp
    import time

    temp_repo.branch("cand", work=2)
    repo = git.Repo(temp_repo.root)
    shas = {"baseline": repo.commit("main").hexsha, "candidate": repo.commit("cand").hexsha}
    wts = {side: tmp_path / "profile" / "exp" / "worktrees" / side for side in shas}
    start_at = time.time() + 2.0  # after every process has imported git
    jobs = [(temp_repo.root, wts[side], shas[side], start_at) for side in shas for _ in range(3)]
    with mp.get_context("spawn").Pool(len(jobs)) as pool:
        results = pool.map(_ensure_at_once, jobs)
    assert results == ["ok"] * len(jobs), results
    assert {side: head(wt) for side, wt in wts.items()} == shas
