"""A throwaway foreign repository for the any-repository tests (an importable helper, not a conftest).

`tinyops`: a pairwise squared-distance op over dims M, N, D (no B, T, H, K, V), with its own
float64 reference in a different layout (y as [D, N]) and its own pytest file; the experiment,
its inputs factory and its reference adapter live in a separate folder, as an engineer's would.
The candidate branch computes the cross term `rounds` times (slower, still correct).
"""
from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

OP = """\
import torch
from torch.profiler import record_function

ROUNDS = {rounds}  # how many times the cross term is computed: the knob a candidate turns


def pairwise_sqdist(x, y):
    \"\"\"||x_i - y_j||^2 for x [M, D] and y [N, D] -> [M, N].\"\"\"
    with record_function("tinyops.norms"):
        xx = (x * x).sum(-1, keepdim=True)
        yy = (y * y).sum(-1)
    with record_function("tinyops.cross"):
        xy = x @ y.t()
        for _ in range(ROUNDS - 1):
            xy = 0.5 * (xy + x @ y.t())
    return xx - 2 * xy + yy
"""

REFERENCE = """\
import torch


def sqdist_columns(x, y_cols):
    \"\"\"The plain definition in float64, y given as columns [D, N].\"\"\"
    diff = x.double()[:, :, None] - y_cols.double()[None, :, :]
    return (diff * diff).sum(1)
"""

TESTS = """\
import pytest
import torch

from tinyops.pairwise import pairwise_sqdist
from tinyops.reference import sqdist_columns


@pytest.mark.parametrize("m,n,d", [(3, 4, 5), (16, 8, 32), (1, 1, 1)])
def test_matches_reference(m, n, d):
    g = torch.Generator().manual_seed(m * 100 + n)
    x, y = torch.randn(m, d, generator=g), torch.randn(n, d, generator=g)
    torch.testing.assert_close(pairwise_sqdist(x, y).double(), sqdist_columns(x, y.t()), rtol=1e-4, atol=1e-4)


def test_zero_distance_to_itself():
    x = torch.randn(5, 7)
    assert pairwise_sqdist(x, x).diagonal().abs().max() < 1e-4
"""

# the candidate's copy of the test file: a test it added fails, and the test it needs is gone;
# the gate runs the frozen copy regardless (and the frozen-paths gate names the edit)
TESTS_EDITED = """\
def test_added_by_the_candidate():
    assert False, "the candidate's own copy of the test file ran"
"""

INPUTS = """\
import torch


def shape_problem(shape):
    missing = [d for d in ("M", "N", "D") if d not in shape]
    return f"needs dims M, N, D (missing {missing})" if missing else None


def make_inputs(shape, mode, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    need = mode == "fwdbwd"
    x = torch.randn(shape["M"], shape["D"], generator=g, dtype=torch.float32).to(dtype).to(device)
    y = torch.randn(shape["N"], shape["D"], generator=g, dtype=torch.float32).to(dtype).to(device)
    return {"args": (), "kwargs": {"x": x.requires_grad_(need), "y": y.requires_grad_(need)},
            "grad_inputs": ["x", "y"] if need else []}
"""

ADAPTER = """\
def sqdist_rows(x, y):
    \"\"\"The repository's reference takes y as columns and answers in float64: call it as the op is called.\"\"\"
    from tinyops.reference import sqdist_columns

    return sqdist_columns(x, y.t()).to(x.dtype)
"""

EXPERIMENT = """\
name: {name}
description: pairwise squared distances of a foreign repository, dims M, N, D
target:
  repo: ../tinyops
  op: {op}
  inputs: inputs.py:make_inputs
baseline:
  ref: {baseline}
candidate:
  ref: {candidate}
modes: [fwd, fwdbwd]
dtype: float32
seed: 3
warmup: 1
# the fewest worker processes whose interval can still exclude 1.0 (3 pairs: 2 degrees of freedom)
measure: {{pairs: 3, max_pairs: 3, calls_per_burst: 2, min_rounds: 2, max_rounds: 2, control: false}}
shapes:
  - {{name: m160_n128_d192, M: 160, N: 128, D: 192}}
stages:
  cross:
    baseline: ["tinyops.cross"]
    candidate: ["tinyops.cross"]
gates:
  - {{kind: amdahl, name: pre-gate, stage: cross, row: m160_n128_d192, min_share: 0.01, min_bound: 1.001}}
  - {{kind: correctness, name: frozen-fixtures}}
  - {{kind: frozen_paths, name: frozen-paths}}
  - {{kind: pytest, name: own-tests, path: tests/test_pairwise.py, k: "{k}"}}
  - {{kind: speedup, name: endpoint, row: m160_n128_d192, mode: fwdbwd, threshold: 1.0}}
  - {{kind: peak_alloc, name: one-mn-buffer-less, rows: [m160_n128_d192], mode: fwdbwd, min_reduction_bytes: "4*M*N"}}
frozen_paths: [tinyops/reference.py]
fixture_shapes:
  - {{name: small, M: 7, N: 5, D: 3}}
  - {{name: wide, M: 2, N: 33, D: 9}}
fixtures:
  reference: {reference}
  cases: [small, wide]
  dtype: float32
  rtol: 1.0e-5
  atol: 1.0e-5
profile:
  rows: [m160_n128_d192]
  iters: 2
max_attempts: 3
"""


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                         cwd=repo, check=True, capture_output=True, text=True)
    return out.stdout.strip()


class ForeignRepo:
    """tmp/tinyops (the target repository) and tmp/bench (experiment, inputs factory, adapter)."""

    def __init__(self, tmp: Path):
        self.tmp = Path(tmp)
        self.repo = self.tmp / "tinyops"
        self.bench = self.tmp / "bench"
        self.repo.mkdir(parents=True)
        self.bench.mkdir()
        git(self.repo, "init", "-q", "-b", "main")
        self.write({"tinyops/__init__.py": "", "tinyops/pairwise.py": OP.format(rounds=1),
                    "tinyops/reference.py": REFERENCE, "tests/test_pairwise.py": TESTS})
        self.baseline = self.commit("baseline: pairwise squared distances")
        (self.bench / "inputs.py").write_text(INPUTS)
        (self.bench / "adapter.py").write_text(ADAPTER)

    def write(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = self.repo / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def commit(self, message: str) -> str:
        git(self.repo, "add", "-A")
        git(self.repo, "commit", "-q", "-m", message)
        return git(self.repo, "rev-parse", "HEAD")

    def branch(self, name: str, files: dict[str, str]) -> str:
        git(self.repo, "checkout", "-q", "-b", name, self.baseline)
        self.write(files)
        sha = self.commit(f"candidate {name}")
        git(self.repo, "checkout", "-q", "main")
        return sha

    def slow_candidate(self, rounds: int = 6) -> str:
        return self.branch("slow", {"tinyops/pairwise.py": OP.format(rounds=rounds)})

    def experiment(self, name: str = "tiny", candidate: str = "slow", op: str = "tinyops.pairwise:pairwise_sqdist",
                   reference: str = "adapter.py:sqdist_rows", k: str = "matches_reference and not 1-1-1",
                   baseline: str | None = None) -> Path:
        path = self.bench / f"{name}.yaml"
        path.write_text(textwrap.dedent(EXPERIMENT.format(name=name, op=op, baseline=baseline or self.baseline,
                                                          candidate=candidate, reference=reference, k=k)))
        return path
