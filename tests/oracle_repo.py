"""A throwaway target repository for the frozen-oracle tests (importable helper, not a conftest).

The repo holds a tiny op `op.py:op(x, w, cu_seqlens=None) = sin(x @ w)` in the input dtype, its
float64 reference `ref.py:ref`, and a test file `tests/test_op.py` (a frozen path). The
experiment file and the inputs factory live outside the repo, as the harness's own do.
"""
from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from harness.revisions import resolve
from harness.spec import load_experiment

OP = """\
def op(x, w, cu_seqlens=None):
    return (x @ w).sin()
"""

OP_WRONG = """\
def op(x, w, cu_seqlens=None):
    return (x @ w).cos()
"""

# allocates its output with torch.empty and never writes element 0
OP_UNWRITTEN = """\
import torch


def op(x, w, cu_seqlens=None):
    y = (x @ w).sin()
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    out.view(-1)[1:] = y.reshape(-1)[1:]
    return out
"""

REF = """\
def ref(x, w, cu_seqlens=None):
    return (x.double() @ w.double()).sin().to(x.dtype)
"""

TEST = """\
def test_op():
    assert True
"""

INPUTS = """\
import torch


def make_inputs(shape, mode, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    if "seqlens" in shape:
        B, T = 1, sum(shape["seqlens"])
    else:
        B, T = shape["B"], shape["T"]
    x = torch.randn(B, T, shape["K"], generator=gen).to(dtype).to(device)
    w = torch.randn(shape["K"], shape["V"], generator=gen).to(dtype).to(device)
    kwargs = {"w": w.requires_grad_(mode == "fwdbwd")}
    if "seqlens" in shape:
        cu = torch.zeros(len(shape["seqlens"]) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(shape["seqlens"]).cumsum(0)
        kwargs["cu_seqlens"] = cu.to(device)
    kwargs["x"] = x.requires_grad_(mode == "fwdbwd")
    return {"args": (), "kwargs": kwargs, "grad_inputs": ["x", "w"] if mode == "fwdbwd" else []}
"""

EXPERIMENT = """\
name: toy
target:
  repo: ../repo
  op: "op:op"
  inputs: "inputs.py:make_inputs"
baseline:
  ref: "{baseline}"
candidate:
  ref: "{candidate}"
modes: [fwd, fwdbwd]
dtype: float32
seed: 7
shapes:
  - {{name: s1, B: 2, T: 5, H: 1, K: 4, V: 3}}
gates:
  - {{name: correct, kind: correctness}}
  - {{name: frozen, kind: frozen_paths}}
frozen_paths: [ref.py, tests]
max_attempts: 3
fixture_shapes:
  - {{name: dense, B: 2, T: 5, H: 1, K: 4, V: 3}}
  - {{name: ragged, seqlens: [3, 0, 4], H: 1, K: 4, V: 3}}
fixtures:
  reference: "ref:ref"
  cases: [dense, ragged]
  dtype: float32
  rtol: {rtol}
  atol: 1.0e-6
"""


def sh(cwd: Path, *args: str) -> str:
    out = subprocess.run(list(args), cwd=cwd, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def git(repo: Path, *args: str) -> str:
    return sh(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args)


class OracleRepo:
    """tmp/repo (the target), tmp/spec (experiment + inputs), tmp/profile (profile root)."""

    def __init__(self, tmp: Path, op_src: str = OP):
        self.tmp = Path(tmp)
        self.repo = self.tmp / "repo"
        self.spec = self.tmp / "spec"
        self.profile = self.tmp / "profile"
        self.repo.mkdir(parents=True)
        self.spec.mkdir()
        git(self.repo, "init", "-q", "-b", "main")
        self.write({"op.py": op_src, "ref.py": REF, "tests/test_op.py": TEST})
        self.baseline = self.commit("baseline")
        (self.spec / "inputs.py").write_text(INPUTS)

    def write(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            p = self.repo / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(text.encode()) if isinstance(text, str) else p.write_bytes(text)

    def commit(self, msg: str) -> str:
        git(self.repo, "add", "-A")
        git(self.repo, "commit", "-q", "-m", msg)
        return git(self.repo, "rev-parse", "HEAD")

    def branch(self, name: str, start: str, files: dict[str, str | bytes]) -> str:
        """A candidate branch from `start` with `files` written (and committed); main stays checked out."""
        git(self.repo, "checkout", "-q", "-b", name, start)
        self.write(files)
        sha = self.commit(f"candidate {name}")
        git(self.repo, "checkout", "-q", "main")
        return sha

    def experiment(self, candidate: str = "main", rtol: float = 1e-5, name: str = "exp.yaml"):
        path = self.spec / name
        path.write_text(EXPERIMENT.format(baseline=self.baseline, candidate=candidate, rtol=rtol))
        return load_experiment(path)

    def resolve(self, loaded):
        return resolve(loaded, self.profile)


def quiet(_msg: str) -> None:
    pass


def textblock(s: str) -> str:
    return textwrap.dedent(s)


_FROZEN: dict[str, tuple] = {}


def frozen(tmp_path_factory):
    """One correct repo frozen once per test session: (repo, loaded, revisions, freeze record).

    Tests add branches to it but never move main or bench-base/toy-cpu."""
    if "ok" not in _FROZEN:
        from harness.fixtures import freeze

        r = OracleRepo(tmp_path_factory.mktemp("oracle-ok"))
        loaded = r.experiment()
        revisions = r.resolve(loaded)
        record = freeze(loaded, revisions, r.profile, device="cpu", recheck=True, log=quiet)
        _FROZEN["ok"] = (r, loaded, revisions, record)
    return _FROZEN["ok"]
