"""Resolve the two sides of an experiment to commits and give each its own git worktree.

The baseline must be named by a commit SHA (pinned to the full SHA here); the candidate may be a
branch, tag or SHA. Worktrees live under profile/<name>/worktrees/<side> and are reused across
runs; a worktree is always detached at the resolved SHA, so the candidate branch moving during a
run is detected by comparing the branch tip with the SHA recorded at resolution.
"""
from __future__ import annotations

import fcntl
import json
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import git

from harness.errors import BadInput
from harness.spec import LoadedExperiment


class RevisionError(BadInput):
    """A ref that does not resolve, a baseline that is not a commit, a candidate that moved."""


@dataclass(frozen=True)
class ResolvedSide:
    side: str
    ref: str  # as written in the experiment ("name==version" for an installed package)
    sha: str  # full commit SHA ("" for an installed package)
    branch: str | None  # the branch name when ref names a branch
    worktree: str  # absolute path ("" for an installed package: the op is imported as installed)
    subject: str  # the commit's first line (shown in the report, escaped there)
    kind: str = "git"  # git | package
    package: str | None = None  # distribution name of a package side
    version: str | None = None  # the exact version a package side must have at block start
    env: dict[str, str] = field(default_factory=dict)  # the side's declared environment (an env-only
    # candidate differs from its baseline in nothing else: the report must show it)


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


def _usable_worktree(repo: git.Repo, path: Path) -> git.Repo | None:
    """`path` as a worktree of `repo`, or None when it is not one: no .git, a .git pointing at a
    repository that is not there (a folder carried from another machine), or another repository's."""
    if not (path / ".git").exists():
        return None
    try:
        wt = git.Repo(path)
        def common_dir(r: git.Repo) -> Path:
            return Path(r.working_dir, r.git.rev_parse("--git-common-dir")).resolve()

        if common_dir(wt) != common_dir(repo):
            return None
        wt.head.commit  # noqa: B018  (raises when HEAD is unreadable)
        return wt
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, git.GitCommandError, ValueError):
        return None


@contextmanager
def _worktree_lock(repo: git.Repo) -> Iterator[None]:
    """Holds a kernel file lock in the repository's git folder while a worktree of it is checked and
    made. Two runs at once (a Slurm job and a local run of one experiment, or an array of experiments
    on one repository) share worktrees and the repository's worktree records: both finding a folder
    missing made the second `git worktree add` fail on the first's folder (a CI run, 2026-12-04), and
    one run's `git worktree prune` can drop the record of a worktree another is adding. Waits for the
    other holder; the kernel drops the lock of a holder that dies."""
    with open(Path(repo.common_dir) / "harness-worktrees.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_worktree(repo: git.Repo, path: Path, sha: str) -> None:
    """A detached worktree at `sha` (created once, moved when the SHA changes, never dirty). A folder
    in its place that is no worktree of `repo` is the harness's own leftover: removed and recreated.
    One process at a time per repository (_worktree_lock)."""
    with _worktree_lock(repo):
        _ensure_worktree_locked(repo, path, sha)


def _ensure_worktree_locked(repo: git.Repo, path: Path, sha: str) -> None:
    wt = _usable_worktree(repo, path) if path.exists() else None
    if wt is not None:
        if wt.head.commit.hexsha != sha:
            wt.git.checkout("--detach", "--force", sha)
        if wt.is_dirty(untracked_files=False):
            wt.git.checkout("--force", sha)
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    repo.git.worktree("prune")
    repo.git.worktree("add", "--force", "--detach", str(path), sha)


def _package_side(side: str, rev) -> ResolvedSide:
    pkg = rev.package
    return ResolvedSide(side=side, ref=f"{pkg.name}=={pkg.version}", sha="", branch=None, worktree="",
                        subject=f"installed package {pkg.name}=={pkg.version}", kind="package",
                        package=pkg.name, version=pkg.version, env=dict(rev.env))


def resolve(loaded: LoadedExperiment, profile_root: Path) -> Revisions:
    exp = loaded.exp
    needs_git = not (exp.baseline.is_package and exp.candidate.is_package)
    repo = open_repo(loaded.target_repo) if needs_git else None
    sides = {}
    for side in ("baseline", "candidate"):
        declared = getattr(exp, side)
        if declared.is_package:
            sides[side] = _package_side(side, declared)
            continue
        sha, branch = resolve_ref(repo, declared.ref, f"{side}.ref")
        if side == "baseline" and not sha.startswith(declared.ref):
            # a branch or tag name that happens to be hex: the baseline must be an exact commit
            raise RevisionError(f"baseline.ref {declared.ref!r} is not a commit SHA (it resolved to {sha})")
        wt = (profile_root / exp.name / "worktrees" / side).resolve()
        _ensure_worktree(repo, wt, sha)
        sides[side] = ResolvedSide(side=side, ref=declared.ref, sha=sha, branch=branch if side == "candidate" else None,
                                   worktree=str(wt), subject=repo.commit(sha).summary, env=dict(declared.env))
    return Revisions(repo=str(loaded.target_repo), baseline=sides["baseline"], candidate=sides["candidate"])


def ensure_worktrees(revisions: Revisions) -> None:
    """Recreate the recorded worktrees at their recorded SHAs (a resume on a fresh clone or machine)."""
    repo = None
    for side in (revisions.baseline, revisions.candidate):
        if side.kind == "git":
            repo = repo or open_repo(Path(revisions.repo))
            _ensure_worktree(repo, Path(side.worktree), side.sha)


def check_unmoved(revisions: Revisions) -> None:
    """Stop rather than mix two candidates in one comparison."""
    cand = revisions.candidate
    if cand.kind == "package":
        return  # checked against its version at every block start instead
    repo = open_repo(Path(revisions.repo))
    now, _ = resolve_ref(repo, cand.ref, "candidate.ref")
    if now != cand.sha:
        raise RevisionError(
            f"candidate ref {cand.ref!r} moved from {cand.sha[:12]} to {now[:12]} during the run; "
            "start a new run for the new candidate (blocks of two candidates are never mixed)")


def save(revisions: Revisions, path: Path) -> None:
    path.write_text(json.dumps(revisions.to_json(), indent=2))
