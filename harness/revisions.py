"""Resolve the two sides of an experiment to commits and give each its own git worktree.

The baseline must be named by a commit SHA (pinned to the full SHA here); the candidate may be a
branch, tag or SHA. Worktrees live under profile/<name>/worktrees/<side> and are reused across
runs; a worktree is always detached at the resolved SHA, so the candidate branch moving during a
run is detected by comparing the branch tip with the SHA recorded at resolution.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import git

from harness.spec import LoadedExperiment


class RevisionError(Exception):
    """A ref that does not resolve, a baseline that is not a commit, a candidate that moved."""


@dataclass(frozen=True)
class ResolvedSide:
    side: str
    ref: str  # as written in the experiment
    sha: str  # full commit SHA
    branch: str | None  # the branch name when ref names a branch
    worktree: str  # absolute path
    subject: str  # the commit's first line (shown in the report, escaped there)


@dataclass(frozen=True)
class Revisions:
    repo: str
    baseline: ResolvedSide
    candidate: ResolvedSide

    def to_json(self) -> dict:
        return {"repo": self.repo, "baseline": asdict(self.baseline), "candidate": asdict(self.candidate)}

    @classmethod
    def from_json(cls, d: dict) -> "Revisions":
        return cls(repo=d["repo"], baseline=ResolvedSide(**d["baseline"]), candidate=ResolvedSide(**d["candidate"]))


def open_repo(path: Path) -> git.Repo:
    try:
        return git.Repo(path)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError) as e:
        raise RevisionError(f"target.repo {path} is not a git repository") from e


def resolve_ref(repo: git.Repo, ref: str, field: str) -> tuple[str, str | None]:
    """Full SHA of a ref, and the branch name if it names a local or remote-tracking branch."""
    try:
        commit = repo.commit(ref)
    except (git.BadName, ValueError, git.GitCommandError) as e:
        raise RevisionError(f"{field} {ref!r} does not resolve to a commit in {repo.working_dir}") from e
    branch = None
    if ref in repo.heads:
        branch = ref
    elif f"origin/{ref}" in [r.name for r in repo.remotes[0].refs] if repo.remotes else False:
        branch = f"origin/{ref}"
    return commit.hexsha, branch


def _ensure_worktree(repo: git.Repo, path: Path, sha: str) -> None:
    """A detached worktree at `sha` (created once, moved when the SHA changes, never dirty)."""
    if path.exists() and (path / ".git").exists():
        wt = git.Repo(path)
        if wt.head.commit.hexsha != sha:
            wt.git.checkout("--detach", "--force", sha)
        if wt.is_dirty(untracked_files=False):
            wt.git.checkout("--force", sha)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    repo.git.worktree("prune")
    repo.git.worktree("add", "--force", "--detach", str(path), sha)


def resolve(loaded: LoadedExperiment, profile_root: Path) -> Revisions:
    exp = loaded.exp
    repo = open_repo(loaded.target_repo)
    base_sha, _ = resolve_ref(repo, exp.baseline.ref, "baseline.ref")
    if not base_sha.startswith(exp.baseline.ref):
        # a branch or tag name that happens to be hex: the baseline must be an exact commit
        raise RevisionError(f"baseline.ref {exp.baseline.ref!r} is not a commit SHA (it resolved to {base_sha})")
    cand_sha, cand_branch = resolve_ref(repo, exp.candidate.ref, "candidate.ref")
    sides = {}
    for side, ref, sha, branch in (("baseline", exp.baseline.ref, base_sha, None),
                                   ("candidate", exp.candidate.ref, cand_sha, cand_branch)):
        wt = (profile_root / exp.name / "worktrees" / side).resolve()
        _ensure_worktree(repo, wt, sha)
        sides[side] = ResolvedSide(side=side, ref=ref, sha=sha, branch=branch, worktree=str(wt),
                                   subject=repo.commit(sha).summary)
    return Revisions(repo=str(loaded.target_repo), baseline=sides["baseline"], candidate=sides["candidate"])


def check_unmoved(revisions: Revisions) -> None:
    """Stop rather than mix two candidates in one comparison."""
    repo = open_repo(Path(revisions.repo))
    cand = revisions.candidate
    now, _ = resolve_ref(repo, cand.ref, "candidate.ref")
    if now != cand.sha:
        raise RevisionError(
            f"candidate ref {cand.ref!r} moved from {cand.sha[:12]} to {now[:12]} during the run; "
            "start a new run for the new candidate (blocks of two candidates are never mixed)")


def save(revisions: Revisions, path: Path) -> None:
    path.write_text(json.dumps(revisions.to_json(), indent=2))
