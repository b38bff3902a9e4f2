"""Shared fixtures: real git repositories in temporary folders holding a tiny CPU op."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import git
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

OP_TEMPLATE = '''\
import torch

WORK = {work}  # matmul+tanh rounds per call: the knob a candidate turns


def op(x, w):
    y = x
    for _ in range(WORK):
        y = torch.tanh(y @ w)
    return y
'''

INPUTS = '''\
import torch


def make_inputs(shape, mode, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    rows, d = shape["B"] * shape["T"], shape["K"]
    need = mode == "fwdbwd"
    x = torch.randn(rows, d, generator=g, dtype=dtype).to(device).requires_grad_(need)
    w = (torch.randn(d, d, generator=g, dtype=dtype) / d ** 0.5).to(device).requires_grad_(need)
    return {"args": (), "kwargs": {"x": x, "w": w}, "grad_inputs": ["x", "w"] if need else []}


def shape_problem(shape):
    if shape.get("K", 0) > 2048:
        return f"K={shape['K']} exceeds 2048"
    return None
'''


class TempRepo:
    """A git repository with `op.py` at a baseline commit and candidate branches on top."""

    def __init__(self, root: Path):
        self.root = root
        self.repo = git.Repo.init(root, initial_branch="main")
        with self.repo.config_writer() as cw:
            cw.set_value("user", "name", "test")
            cw.set_value("user", "email", "test@example.invalid")
        (root / ".gitignore").write_text("profile/\nreports/\nexperiments/\n")
        self.baseline_sha = self.commit_op(work=4, message="baseline op")
        (root / "experiments").mkdir()
        (root / "experiments" / "inputs.py").write_text(INPUTS)

    def commit_op(self, work: int, message: str, extra: dict[str, str] | None = None) -> str:
        (self.root / "op.py").write_text(OP_TEMPLATE.format(work=work))
        paths = ["op.py", ".gitignore"]
        for rel, text in (extra or {}).items():
            (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / rel).write_text(text)
            paths.append(rel)
        self.repo.index.add(paths)
        return self.repo.index.commit(message).hexsha

    def branch(self, name: str, work: int, message: str | None = None, extra: dict[str, str] | None = None) -> str:
        """A candidate branch off the baseline commit with a different amount of work."""
        head = self.repo.head.ref
        self.repo.git.checkout("-b", name, self.baseline_sha)
        sha = self.commit_op(work, message or f"candidate: {work} rounds", extra)
        head.checkout()
        return sha

    def experiment(self, name: str, candidate: str, gates: str, extra: str = "", blocks: int = 3,
                   samples: int = 5, shapes: str | None = None, engine: str = "lockstep", rounds: int = 4,
                   control: bool = False) -> Path:
        """An experiment on this repository's op. The lockstep engine gets `blocks` worker pairs and a
        fixed `rounds` rounds of `samples` calls (min = max rounds, whole cycles of side orders: 2 per
        cycle, 6 with the A/A control; a CPU test's cost stays known); engine "blocks" gets `blocks`
        fresh-process blocks a side of `samples` samples."""
        shapes = shapes or "  - {name: small, B: 4, T: 256, H: 1, K: 256, V: 256}\n"
        pairs = max(blocks, 2)
        measure = (f"measure: {{engine: {engine}, pairs: {pairs}, max_pairs: {pairs}, min_rounds: {rounds}, "
                   f"max_rounds: {rounds}, secondary_rounds: {rounds}, calls_per_burst: {samples}, "
                   f"row_budget_s: 300, control: {str(control).lower()}}}\n")
        text = textwrap.dedent(f"""\
            name: {name}
            description: tiny CPU op for tests
            target:
              op: op:op
              inputs: inputs.py:make_inputs
            baseline:
              ref: {self.baseline_sha}
            candidate:
              ref: {candidate}
            modes: [fwd]
            dtype: float32
            blocks: {blocks}
            samples_per_block: {samples}
            warmup: 1
            """) + measure + "shapes:\n" + shapes + "gates:\n" + textwrap.indent(textwrap.dedent(gates), "  ") + textwrap.dedent(extra)
        path = self.root / "experiments" / f"{name}.yaml"
        path.write_text(text)
        return path


@pytest.fixture
def temp_repo(tmp_path) -> TempRepo:
    return TempRepo(tmp_path / "repo")


# Files tests keep for a person to look at (browser screenshots): under profile/ (ignored by git),
# or HARNESS_TEST_ARTIFACTS; the run's summary prints where they went.
ARTIFACTS_KEY = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def artifacts(request) -> Path:
    root = Path(os.environ.get("HARNESS_TEST_ARTIFACTS") or Path(__file__).resolve().parents[1] / "profile" /
                "test-artifacts")
    root.mkdir(parents=True, exist_ok=True)
    request.config.stash[ARTIFACTS_KEY] = root
    return root


def pytest_terminal_summary(terminalreporter, config):
    root = config.stash.get(ARTIFACTS_KEY, None)
    if root is not None:
        terminalreporter.write_line(f"test artifacts (browser screenshots): {root}")
