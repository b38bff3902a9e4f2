"""The experiment file: schema, loading, and errors that name the file, the YAML path and the line.

An experiment is the one place where shapes, thresholds, stage names and refs are declared;
every later phase reads them from the `Experiment` record built here.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.errors import BadInput

# Names reach file paths, git branch names and sbatch scripts: keep them to a safe alphabet.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
Mode = Literal["fwd", "fwdbwd"]
Side = Literal["baseline", "candidate"]
SIDES: tuple[Side, Side] = ("baseline", "candidate")


class SpecError(BadInput):
    """A bad experiment file; `str()` names the file, the YAML path and the line."""

    def __init__(self, path: Path | str, problems: list[tuple[str, int | None, str]]):
        self.path = str(path)
        self.problems = problems
        lines = []
        for loc, line, msg in problems:
            where = f"{self.path}:{line}" if line else self.path
            lines.append(f"{where}: {loc or '<top>'}: {msg}")
        super().__init__("\n".join(lines))


class SetupError(SpecError):
    """A well-formed experiment whose setup does not work: a repository, ref, op, reference, inputs
    factory or test file that cannot be found, imported or called. Exit 2 like any bad input; never
    an attempt, never a terminal NO-GO (only a measured red baseline is one). Build with
    `setup_error`, which finds the field's line."""


# --- bounds: what one run can do -------------------------------------------------------------
# Every number of an experiment is one of these types. Integers are strict (8.0, true and "8" are
# refused, never read as 8 or 1) and capped at what a run can do: a larger value is a typo, not a
# plan; floats are finite. A field adds its own lower bound where it assigns its default:
# `warmup: Count = Field(default=3, ge=0)`. (An upper bound given there is overridden by the type's:
# give a field a tighter one with its own Annotated type.)
MAX_COUNT = 100_000  # samples, warm-up calls, iterations, steps, attempts, passes (per block or per run)
MAX_BLOCKS = 1_000  # blocks a side
MAX_DIM = 2**31 - 1  # a tensor dimension or length (B, T, H, K, V, seqlens, hidden, vocab): an int32 index
MAX_SEED = 2**32 - 1  # what numpy's and torch's generators both take
Count = Annotated[int, Field(strict=True, le=MAX_COUNT)]
BlockCount = Annotated[int, Field(strict=True, le=MAX_BLOCKS)]
Dim = Annotated[int, Field(strict=True, le=MAX_DIM)]
Seed = Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # thresholds, margins, tolerances


class Strict(BaseModel):
    # strict: no value is coerced (a string is no number, a number no string, 1 no bool)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_OP_FORM = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"
_FILE_FN_FORM = r"[\w./-]+\.py:[A-Za-z_]\w*"  # "relative/path.py:function", relative to the experiment file


class Target(Strict):
    # the repository under test: a path relative to the experiment file's folder, or absolute;
    # left out, the git repository that holds the experiment file
    repo: str | None = None
    op: str  # "module:function", imported from each side's worktree
    inputs: str  # "path/to/file.py:function", relative to the experiment file, run from this checkout

    @field_validator("op")
    @classmethod
    def _op_form(cls, v: str) -> str:
        if not re.fullmatch(_OP_FORM, v):
            raise ValueError("expected 'package.module:function'")
        return v

    @field_validator("inputs")
    @classmethod
    def _inputs_form(cls, v: str) -> str:
        if not re.fullmatch(_FILE_FN_FORM, v):
            raise ValueError("expected 'relative/path.py:function'")
        return v

    @field_validator("repo")
    @classmethod
    def _repo_path(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or "\0" in v):
            raise ValueError("expected a folder: relative to the experiment file, or absolute")
        return v


class Package(Strict):
    """An installed distribution as one side (e.g. the public op from fla-core at a version)."""

    name: str  # distribution name, as `pip show` spells it
    version: str  # exact version; checked at every block start

    @field_validator("name", "version")
    @classmethod
    def _safe(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}", v):
            raise ValueError(f"{v!r}: letters, digits and '._+-' only")
        return v


class Revision(Strict):
    """One side: a git revision of the target repository (`ref`), or an installed package
    (`package`, with the side's own `op` import path); `env` adds environment variables, so an
    env-only candidate is the same ref with different variables."""

    ref: str | None = None
    package: Package | None = None
    op: str | None = None  # this side's 'module:function' when it differs from target.op
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("ref")
    @classmethod
    def _ref_safe(cls, v: str | None) -> str | None:
        # git check-ref-format rules, plus no shell metacharacters: refs reach sbatch scripts.
        if v is not None and (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}", v) or ".." in v
                              or v.endswith((".lock", "/", "."))):
            raise ValueError(f"{v!r} is not a valid git ref (letters, digits, '._/-' only)")
        return v

    @field_validator("op")
    @classmethod
    def _op_form(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(_OP_FORM, v):
            raise ValueError("expected 'package.module:function'")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
                raise ValueError(f"environment variable name {key!r} must match [A-Z_][A-Z0-9_]*")
            if "\0" in value:
                raise ValueError(f"the value of {key} holds a NUL byte, which no environment variable can hold")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> "Revision":
        if (self.ref is None) == (self.package is None):
            raise ValueError("give exactly one of `ref` (a git revision) or `package` (an installed distribution)")
        return self

    @property
    def is_package(self) -> bool:
        return self.package is not None


class BaselineRevision(Revision):
    @field_validator("ref")
    @classmethod
    def _sha(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{7,40}", v):
            raise ValueError(f"baseline.ref must be a commit SHA (7-40 hex digits), got {v!r}")
        return v


# Names computed from a shape's dims (harness.gates.shape_dims) for byte expressions: never declared.
DERIVED_DIMS = ("tokens", "NK", "NT")
_DIM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


class Shape(BaseModel):
    """One row's dimensions: any positive integers by name (B, T, H, K, V for PKDA; M, N, ... for
    another op), and optionally `seqlens` (a ragged batch, packed into B=1). The op's inputs factory
    gets them all as a dict and says in its `shape_problem` which it needs."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    seqlens: list[Dim] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not SAFE_NAME.match(v):
            raise ValueError(f"shape name {v!r} must match {SAFE_NAME.pattern}")
        return v

    @field_validator("seqlens")
    @classmethod
    def _seqlens(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(n < 0 for n in v) or sum(v) == 0):
            raise ValueError("seqlens must be a non-empty list of non-negative lengths with a positive sum")
        return v

    @model_validator(mode="after")
    def _dims(self) -> "Shape":
        for key, value in (self.model_extra or {}).items():
            if not _DIM_NAME.fullmatch(key):
                raise ValueError(f"dimension name {key!r} must be an identifier (letters, digits, '_')")
            if key in DERIVED_DIMS:
                raise ValueError(f"{key!r} is computed from the other dims ({', '.join(DERIVED_DIMS)} are), "
                                 "not declared")
            if type(value) is not int or value <= 0:
                raise ValueError(f"dimension {key} must be a positive integer, got {value!r}")
            if value > MAX_DIM:
                raise ValueError(f"dimension {key} is {value}: more than a run can take (at most {MAX_DIM})")
        if self.seqlens is not None and ("B" in self.dims or "T" in self.dims):
            raise ValueError("give either B and T (dense) or seqlens (varlen), not both")
        if self.seqlens is None and not self.dims:
            raise ValueError("a shape needs at least one integer dimension (e.g. B, T, H, K, V or M, N) or seqlens")
        return self

    @property
    def dims(self) -> dict[str, int]:
        """The declared integer dimensions, by name, in the order written."""
        return dict(self.model_extra or {})

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def tokens(self) -> int | None:
        """Tokens of the row: the sum of seqlens, or B*T; None when the shape has neither."""
        if self.seqlens is not None:
            return sum(self.seqlens)
        dims = self.dims
        return dims["B"] * dims["T"] if "B" in dims and "T" in dims else None


class StagePatterns(Strict):
    """Kernel-name regexes (or CPU op / record_function names) that make up one stage, per side."""

    baseline: list[str]
    candidate: list[str]

    @field_validator("baseline", "candidate")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("a stage needs at least one kernel-name pattern")
        for p in v:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"pattern {p!r} is not a regular expression: {e}") from e
        return v


class _EveryName(dict):
    """A dims mapping that has every name (as 1) and keeps the names asked for: checks an
    expression's form before the rows it will be evaluated on are known."""

    def __contains__(self, key) -> bool:
        return True

    def __missing__(self, key):
        self[key] = 1
        return 1


def bytes_expr_names(v: str) -> set[str]:
    """The dimension names a byte-count expression uses; ValueError when it is not plain arithmetic
    for the gates' safe evaluator (no code is ever run)."""
    from harness.gates import ExprError, eval_bytes_expr  # lazy: gates imports this module

    names = _EveryName()
    try:
        eval_bytes_expr(v, names)
    except ExprError as e:
        raise ValueError(f"expected an arithmetic expression over the rows' dimension names: {e}") from e
    return set(names)


def check_bytes_expr(v: str) -> str:
    """The field validator of a byte-count expression: its form (its names are checked against the
    rows it names by cross_reference_problems)."""
    bytes_expr_names(v)
    return v


class _Gate(Strict):
    name: str
    description: str = ""


# What a whole-call timing gate reads (harness/measure/ measures each):
#   "graph"  CUDA-graph replay of the call, timed with CUDA events: device time without host launch
#            noise (rows whose call cannot be captured, e.g. a host sync on cu_seqlens, have none);
#   "eager"  the call as users run it, CUDA events around it (perf_counter on a CPU): host launch
#            time included ("wall" is read as "eager", the name older files use);
#   "device" the summed time of every kernel and copy of the call, from the `stage_iters` profiled
#            calls per worker;
#   "auto"   the row's primary basis: graph where the call could be captured on every worker, else eager.
Basis = Literal["auto", "graph", "eager", "device"]
TIMED_BASES = ("graph", "eager")  # the bases measured in lockstep rounds


def _basis_name(v):
    return "eager" if v == "wall" else v


class SpeedupGate(_Gate):
    """Endpoint (or one stage's) speedup of one row: PASS when the CI's lower bound >= threshold."""

    kind: Literal["speedup"]
    row: str
    mode: Mode = "fwdbwd"
    stage: str | None = None  # a key of `stages`; None = the whole call
    threshold: Finite = Field(gt=0)
    basis: Annotated[Basis, BeforeValidator(_basis_name)] = "auto"


class GeomeanGate(_Gate):
    kind: Literal["geomean"]
    rows: list[str] = Field(min_length=1)
    mode: Mode = "fwdbwd"
    threshold: Finite = Field(gt=0)
    basis: Annotated[Basis, BeforeValidator(_basis_name)] = "auto"


class NonRegressionGate(_Gate):
    """Every listed row must not be slower than (1 + margin) x baseline outside noise."""

    kind: Literal["non_regression"]
    rows: list[str] | Literal["all"] = "all"
    modes: list[Mode] = Field(default_factory=lambda: ["fwd", "fwdbwd"])
    margin: Finite = Field(gt=0, lt=1)
    basis: Annotated[Basis, BeforeValidator(_basis_name)] = "auto"


class PeakAllocGate(_Gate):
    """Candidate peak allocation lower than baseline's by at least `min_reduction_bytes` (an
    arithmetic expression over the rows' dimension names, e.g. '4*tokens*H*64' or '4*M*N')."""

    kind: Literal["peak_alloc"]
    rows: list[str] = Field(min_length=1)
    mode: Mode = "fwdbwd"
    min_reduction_bytes: str

    @field_validator("min_reduction_bytes")
    @classmethod
    def _expr(cls, v: str) -> str:
        return check_bytes_expr(v)


class CorrectnessGate(_Gate):
    kind: Literal["correctness"]


class FrozenPathsGate(_Gate):
    kind: Literal["frozen_paths"]


class AmdahlGate(_Gate):
    kind: Literal["amdahl"]
    stage: str
    row: str
    min_share: Finite = Field(gt=0, lt=1)
    min_bound: Finite = Field(gt=1)
    denominator: Literal["device", "wall"] = "wall"


class NcuExpectation(Strict):
    stage: str
    metric: str
    relation: Literal["lower_by_at_least", "higher_by_at_most", "candidate_at_most", "candidate_ratio_at_least"]
    value: Finite


class NcuGate(_Gate):
    kind: Literal["ncu"]
    row: str
    expect: list[NcuExpectation] = Field(min_length=1)


class AgreementGate(_Gate):
    """Both sides' outputs and gradients on the same inputs agree elementwise within
    atol + rtol*|baseline| (e.g. this repository's op against the public one)."""

    kind: Literal["agreement"]
    rows: list[str] = Field(min_length=1)
    modes: list[Mode] = Field(default_factory=lambda: ["fwd", "fwdbwd"])
    rtol: Finite = Field(gt=0)
    atol: Finite = Field(ge=0)


class PytestGate(_Gate):
    """The target repository's own test file, run with pytest on each side's code. The file (and
    the conftest.py files above it) are the ones frozen at BENCH_BASE (the baseline's when the
    experiment freezes no fixtures), whatever the side's commit holds: PASS when every selected
    test passes or is skipped by the frozen file on both sides."""

    kind: Literal["pytest"]
    path: str  # a test file, relative to the target repository's top
    k: str | None = None  # pytest's -k expression (None: the whole file)
    cpu_k: str | None = None  # the -k expression on a CPU run (None: `k`): the interpreter is slow
    # false: a CPU run does not run the file (its gate is INCONCLUSIVE there), for a repository
    # whose tests need a GPU (fla's conftest and device choice do)
    run_on_cpu: bool = True
    timeout_s: int = Field(default=3600, gt=0)  # per side

    @model_validator(mode="after")
    def _cpu_selection(self) -> "PytestGate":
        if self.cpu_k is not None and not self.run_on_cpu:
            raise ValueError("cpu_k selects the tests of a CPU run, and run_on_cpu: false runs none: drop one")
        return self

    @field_validator("path")
    @classmethod
    def _relative_file(cls, v: str) -> str:
        parts = v.split("/")
        if (not re.fullmatch(r"[\w./-]+\.py", v) or v.startswith("/") or ".." in parts or "." in parts
                or "" in parts):
            raise ValueError(f"{v!r}: expected a .py file relative to the target repository's top (no '..')")
        return v


class TrainingGate(_Gate):
    """Rows of `training`: each neutral within `neutral_margin` (time ratio upper bound <= 1 + m),
    at least one with speedup lower bound >= `min_best_speedup`, and every row's first-step losses
    agreeing across sides within the row's `first_loss_rtol` (same seed, same data)."""

    kind: Literal["training"]
    rows: list[str] = Field(min_length=1)
    neutral_margin: Finite = Field(gt=0, lt=1)
    min_best_speedup: Finite = Field(gt=0)


class TrainingRow(Strict):
    """One training comparison: the model file (from the harness's checkout, like `target.inputs`)
    built around each side's op, trained from the same seed on the same data. `varlen` packs the
    B rows into one stream split into documents every `context_len` tokens."""

    name: str
    model: str  # "relative/path.py:build_fn", relative to the experiment file; build_fn(cfg, attn_fn)
    hidden: Dim = Field(gt=0)
    heads: Dim = Field(gt=0)
    head_dim: Dim = Field(gt=0)
    vocab: Dim = Field(gt=1)
    layers: Dim = Field(default=2, gt=0)
    B: Dim = Field(gt=0)
    T: Dim = Field(gt=0)
    varlen: bool = False
    context_len: Dim | None = Field(default=None, gt=0)
    dtype: Literal["float32", "bfloat16"] = "bfloat16"  # the attention inputs' dtype (float32 on CPU)
    optimizer: Literal["adamw"] = "adamw"
    lr: Finite = Field(default=1e-3, gt=0)
    weight_decay: Finite = Field(default=0.0, ge=0)
    warmup_steps: Count = Field(default=3, ge=1)  # untimed; the first of them gives the first-step loss
    steps: Count = Field(default=10, gt=0)  # timed optimizer steps per block
    seed: Seed = 0
    first_loss_rtol: Finite = Field(default=1e-3, ge=0)  # cross-side agreement of the first-step loss

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not SAFE_NAME.match(v):
            raise ValueError(f"training row name {v!r} must match {SAFE_NAME.pattern}")
        return v

    @field_validator("model")
    @classmethod
    def _model_form(cls, v: str) -> str:
        if not re.fullmatch(_FILE_FN_FORM, v):
            raise ValueError("expected 'relative/path.py:function'")
        return v

    @model_validator(mode="after")
    def _varlen(self) -> "TrainingRow":
        if self.varlen and self.context_len is None:
            raise ValueError("a varlen training row needs context_len (document length in tokens)")
        if not self.varlen and self.context_len is not None:
            raise ValueError("context_len applies to varlen rows only (set varlen: true)")
        return self

    @property
    def tokens(self) -> int:
        return self.B * self.T


Gate = Annotated[
    Union[
        SpeedupGate, GeomeanGate, NonRegressionGate, PeakAllocGate, CorrectnessGate,
        FrozenPathsGate, AmdahlGate, NcuGate, TrainingGate, AgreementGate, PytestGate,
    ],
    Field(discriminator="kind"),
]


class FixtureCase(Strict):
    shape: str  # a name from `shapes` or `fixture_shapes`
    initial_state: bool = True


_PRECISION_RANK = {"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2}


class LowPrecision(Strict):
    """Each case again with its inputs made in `dtype` (lower than the fixtures' dtype): the reference
    runs on those same rounded inputs upcast, and every output and gradient must be within `rel_l2`
    relative L2 error (||op - ref|| / ||ref||, per tensor). This is what exercises a kernel path that
    only low-precision inputs dispatch to (an elementwise atol/rtol bound does not fit bf16 rounding).
    float16/bfloat16 variants run only on CUDA: Triton's CPU interpreter computes them wrongly."""

    dtype: Literal["float16", "bfloat16", "float32"]
    rel_l2: Finite = Field(gt=0, le=1)


class Fixtures(Strict):
    # what computes the oracle: "module:function" of the target repository (its module file is a
    # frozen path), or "adapter.py:function", a file beside the experiment wrapping the repository's
    # reference (e.g. normalising inputs the way the op does); its hash is frozen in the manifest
    reference: str
    cases: list[str] = Field(min_length=1)  # names of shapes in `fixture_shapes`
    dtype: Literal["float32", "float64"] = "float32"
    rtol: Finite = Field(gt=0)
    atol: Finite = Field(ge=0)
    low_precision: list[LowPrecision] = Field(default_factory=list)

    @field_validator("reference")
    @classmethod
    def _reference_form(cls, v: str) -> str:
        if not (re.fullmatch(_OP_FORM, v) or re.fullmatch(_FILE_FN_FORM, v)):
            raise ValueError("expected 'package.module:function' (in the target repository) or "
                             "'relative/adapter.py:function' (beside the experiment file)")
        return v

    @property
    def reference_is_adapter(self) -> bool:
        return self.reference.split(":")[0].endswith(".py")

    @model_validator(mode="after")
    def _lower(self) -> "Fixtures":
        seen = set()
        for i, lp in enumerate(self.low_precision):
            if _PRECISION_RANK[lp.dtype] >= _PRECISION_RANK[self.dtype]:
                raise ValueError(f"low_precision[{i}].dtype {lp.dtype} is not lower than fixtures.dtype {self.dtype}")
            if lp.dtype in seen:
                raise ValueError(f"low_precision[{i}].dtype {lp.dtype} is declared twice")
            seen.add(lp.dtype)
        return self


class Removable(Strict):
    """Traffic the candidate removes, for the profile's time floor: bytes written then read."""

    name: str
    bytes: str  # expression over the profiled rows' dimension names (and tokens, NK, NT)
    passes: Count = Field(default=2, gt=0)  # 2 = written once, read once

    @field_validator("bytes")
    @classmethod
    def _expr(cls, v: str) -> str:
        return check_bytes_expr(v)


class ProfileSpec(Strict):
    rows: list[str] = Field(min_length=1)
    iters: Count = Field(default=10, gt=0)
    removable: list[Removable] = Field(default_factory=list)


class NcuSpec(Strict):
    rows: list[str] = Field(min_length=1)
    stages: list[str] = Field(min_length=1)


class SlurmSpec(Strict):
    template: str = "comparison"
    partition: str | None = None
    account: str | None = None
    constraint: str | None = None
    gpus: Annotated[int, Field(strict=True, ge=0, le=64)] = 1
    time: str = "01:00:00"
    exclusive: bool = False


class MeasureSpec(Strict):
    """How a comparison is measured (harness/measure/). `engine: lockstep` (the default): per side a
    long-lived worker process, warmed once, driven by the parent in rounds (one burst of
    `calls_per_burst` timed calls per side, the side order alternating), by `pairs` worker pairs
    (fresh processes) at first; per row and basis, rounds go on until the interval's half-width is at
    most `target_half_width` (a fraction: 0.005 = +-0.5%) or the row has used `row_budget_s` seconds,
    adding pairs (up to `max_pairs`) when per-process offsets, not round-to-round noise, keep it wide;
    when fewer pairs than that can hold a row at once (device memory, or `pairs_at_once`), the row's
    pairs run in waves.
    `control`: a third worker per pair runs the baseline again, the A/A control whose interval is the
    run's noise floor. `engine: blocks`: the first engine (a fresh process per block, `blocks`,
    `samples_per_block`, `order`), kept as an option."""

    engine: Literal["lockstep", "blocks"] = "lockstep"
    pairs: Count = Field(default=3, ge=2, le=64)
    max_pairs: Count = Field(default=8, ge=2, le=64)
    # one call a side per round: the sides run ~5 ms apart, and a power-capped clock moving over tens of ms
    # then touches both alike (H200: a round's noise 0.2-1.1% at 1 call, 2.1-3.7% at 5: docs/perf/measurement.md)
    calls_per_burst: Count = Field(default=1, ge=1, le=10_000)
    min_rounds: Count = Field(default=10, ge=1, le=100_000)
    max_rounds: Count = Field(default=60, ge=1, le=100_000)  # per pair, row and basis
    target_half_width: Finite = Field(default=0.005, gt=0, lt=1)
    row_budget_s: Finite = Field(default=120.0, gt=0, le=86_400)  # per row and gated basis
    control: bool = True
    graph: bool = True  # try CUDA-graph capture of every row (eager only when false)
    eager: bool = True  # measure eager timing too where the primary basis is graph
    secondary_rounds: Count = Field(default=10, ge=1, le=100_000)  # rounds of a basis no gate reads
    # the most pairs that hold a row at once (rounds pass from pair to pair among them); more pairs of
    # the row run in later waves, up to max_pairs. Unset: as many as device memory holds
    pairs_at_once: Count | None = Field(default=None, ge=1, le=64)

    @model_validator(mode="after")
    def _ordered(self) -> "MeasureSpec":
        if self.max_pairs < self.pairs:
            raise ValueError(f"max_pairs ({self.max_pairs}) must be >= pairs ({self.pairs})")
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"max_rounds ({self.max_rounds}) must be >= min_rounds ({self.min_rounds})")
        return self


class CpuProfile(Strict):
    """What the same command runs on a machine without a GPU: a small fp32 smoke test."""

    shapes: list[Shape] = Field(min_length=1)
    # the fixture cases of a CPU freeze at tiny dims, under names from `fixture_shapes` (under the
    # interpreter a GPU-sized case costs seconds per call, and freeze and verify make eight calls a
    # case); a case without one runs at its declared shape. Only the CPU oracle (bench-base/<name>-cpu)
    # is frozen at these dims: the GPU's never meets them
    fixture_shapes: list[Shape] = Field(default_factory=list)
    dtype: Literal["float32"] = "float32"
    samples_per_block: Count = Field(default=3, gt=0)
    # untimed calls before a row is measured or profiled: 0 by default, since the interpreter compiles
    # and tunes nothing (the first timed call's outputs still get the finite check)
    warmup: Count = Field(default=0, ge=0)
    blocks: BlockCount = Field(default=3, ge=3)
    training: list[TrainingRow] | None = None  # small rows under names from `training`: a CPU run trains only these
    stage_iters: Count = Field(default=0, ge=0)  # Triton kernels are invisible to the CPU profiler
    profile_iters: Count = Field(default=1, gt=0)  # timed and profiled calls per profile row (stages invisible too)
    # the lockstep engine on a CPU (no GPU verdict either way): two pairs, one cycle of side orders
    # (two rounds; the A/A control would make a cycle six), one call a burst
    measure: MeasureSpec = Field(default_factory=lambda: MeasureSpec(
        pairs=2, max_pairs=2, calls_per_burst=1, min_rounds=2, max_rounds=2, secondary_rounds=1, control=False))
    # folders (relative to the experiment file) put on PYTHONPATH of every process a CPU run starts
    # for a side, after the harness checkout: a `sitecustomize.py` there runs at interpreter start
    # (e.g. a shim that lets a repository's Triton autotuner run under the interpreter)
    python_path: list[str] = Field(default_factory=list)
    # fp32 `tl.dot`s that would run as TF32 on a GPU drop the same mantissa bits under the interpreter
    # (harness/interpreter_tf32.py), so a CPU freeze does not pass tolerances the GPU cannot meet
    emulate_tf32: bool = True


class Experiment(Strict):
    name: str
    description: str = ""
    target: Target
    baseline: BaselineRevision
    candidate: Revision
    modes: list[Mode] = Field(min_length=1)
    shapes: list[Shape] = Field(min_length=1)
    dtype: Literal["float32", "float16", "bfloat16"] = "bfloat16"
    seed: Seed = 0
    blocks: BlockCount = Field(default=5, ge=3)
    samples_per_block: Count = Field(default=20, gt=0)
    warmup: Count = Field(default=3, ge=0)
    timing: Literal["cuda_events", "wall"] = "cuda_events"
    l2_flush: bool = True
    order: Literal["abba", "random"] = "abba"
    stages: dict[str, StagePatterns] = Field(default_factory=dict)
    stage_iters: Count = Field(default=5, ge=0)  # profiled calls per block for stage times (GPU)
    gates: list[Gate] = Field(min_length=1)
    training: list[TrainingRow] = Field(default_factory=list)
    frozen_paths: list[str] = Field(default_factory=list)
    max_attempts: Count = Field(default=3, gt=0)
    fixture_shapes: list[Shape] = Field(default_factory=list)
    fixtures: Fixtures | None = None
    profile: ProfileSpec | None = None
    ncu: NcuSpec | None = None
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    measure: MeasureSpec = Field(default_factory=MeasureSpec)
    cpu: CpuProfile | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not SAFE_NAME.match(v):
            raise ValueError(f"experiment name {v!r} must match {SAFE_NAME.pattern} (it names folders and branches)")
        return v

    @field_validator("modes")
    @classmethod
    def _unique_modes(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("modes must not repeat")
        return v

    @model_validator(mode="after")
    def _references(self) -> "Experiment":
        problems = cross_reference_problems(self)
        if problems:
            # "@<yaml path>: message" lets load_experiment point at the line (see _located)
            raise ValueError("; ".join(f"@{loc}: {msg}" for loc, msg in problems))
        return self

    def shape(self, name: str) -> Shape:
        for s in [*self.shapes, *self.fixture_shapes]:
            if s.name == name:
                return s
        raise KeyError(f"experiment {self.name!r} has no shape named {name!r}")


class LoadedExperiment(BaseModel):
    """An experiment with the place it came from (relative paths resolve against it)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    exp: Experiment
    path: Path  # the YAML file
    root: Path  # the repository that holds the YAML (the harness's checkout for our experiments)

    def beside(self, relative: str) -> Path:
        """A path written in the experiment file: relative to the file's folder, or absolute."""
        return (self.path.parent / relative).resolve()

    @property
    def target_repo(self) -> Path:
        repo = self.exp.target.repo
        return self.root if repo is None else self.beside(repo)

    @property
    def inputs_file(self) -> Path:
        return self.beside(self.exp.target.inputs.split(":")[0])

    @property
    def reference_adapter(self) -> Path | None:
        """The adapter file of `fixtures.reference` (None when it names a module of the repository)."""
        fx = self.exp.fixtures
        return self.beside(fx.reference.split(":")[0]) if fx is not None and fx.reference_is_adapter else None

    @property
    def cpu_python_path(self) -> list[Path]:
        return [self.beside(p) for p in (self.exp.cpu.python_path if self.exp.cpu is not None else [])]

    def model_file(self, row: "TrainingRow") -> Path:
        return self.beside(row.model.split(":")[0])


def cross_reference_problems(exp: "Experiment") -> list[tuple[str, str]]:
    """Names that must point at something declared elsewhere in the file: (yaml path, problem)."""
    out: list[tuple[str, str]] = []
    names = [s.name for s in exp.shapes]
    if len(set(names)) != len(names):
        out.append(("shapes", f"shape names must be unique, got {names}"))
    known = set(names)
    for i, gate in enumerate(exp.gates):
        at = f"gates[{i}]"
        if isinstance(gate, (SpeedupGate, AmdahlGate, NcuGate)) and gate.row not in known:
            out.append((f"{at}.row", f"gate {gate.name!r} names row {gate.row!r}, not one of shapes {sorted(known)}"))
        rows = getattr(gate, "rows", None)
        if isinstance(rows, list) and not isinstance(gate, TrainingGate):
            missing = [r for r in rows if r not in known]
            if missing:
                out.append((f"{at}.rows", f"gate {gate.name!r} names rows {missing}, not in shapes {sorted(known)}"))
        stage = getattr(gate, "stage", None)
        if stage is not None and stage not in exp.stages:
            out.append((f"{at}.stage", f"gate {gate.name!r} names stage {stage!r}, not one of stages {sorted(exp.stages)}"))
        if getattr(gate, "basis", "wall") == "device":
            if stage is not None:
                out.append((f"{at}.basis", f"gate {gate.name!r}: a stage's time is device time already; "
                            "basis: device applies to whole-call gates (drop basis or stage)"))
            if exp.stage_iters == 0:
                out.append((f"{at}.basis", f"gate {gate.name!r} gates on device time, which is measured by "
                            "the profiled calls of each block: stage_iters must be >= 1, got 0"))
        mode = getattr(gate, "mode", None)
        if mode is not None and mode not in exp.modes:
            out.append((f"{at}.mode", f"gate {gate.name!r} uses mode {mode!r}, not one of modes {exp.modes}"))
        if isinstance(gate, CorrectnessGate) and exp.fixtures is None:
            out.append((at, f"gate {gate.name!r} (correctness) needs a `fixtures` section"))
        if isinstance(gate, AmdahlGate) and exp.profile is None:
            out.append((at, f"gate {gate.name!r} (amdahl) needs a `profile` section"))
        if isinstance(gate, PytestGate) and (exp.baseline.is_package or exp.candidate.is_package):
            out.append((at, f"gate {gate.name!r} (pytest) runs the repository's test file in each side's "
                            "worktree: both sides must be git revisions (`ref`)"))
    train_names = [t.name for t in exp.training]
    if len(set(train_names)) != len(train_names):
        out.append(("training", f"training row names must be unique, got {train_names}"))
    for i, gate in enumerate(exp.gates):
        if isinstance(gate, TrainingGate):
            missing = [r for r in gate.rows if r not in train_names]
            if missing:
                out.append((f"gates[{i}].rows", f"gate {gate.name!r} names training rows {missing}, "
                            f"not in training {sorted(train_names)}"))
    if exp.cpu is not None and exp.cpu.training:
        missing = [t.name for t in exp.cpu.training if t.name not in train_names]
        if missing:
            out.append(("cpu.training", f"names {missing}, not in training {sorted(train_names)} "
                        "(a CPU row stands in for the training row of the same name)"))
    if exp.cpu is not None and exp.cpu.fixture_shapes:
        names = [s.name for s in exp.cpu.fixture_shapes]
        declared = {s.name for s in exp.fixture_shapes}
        missing = [n for n in names if n not in declared]
        if missing or len(set(names)) != len(names):
            out.append(("cpu.fixture_shapes", f"names {names} must be unique names from fixture_shapes "
                        f"{sorted(declared)} (a CPU case stands in for the fixture case of the same name)"))
    if exp.baseline.is_package:
        for section in ("fixtures", "profile"):
            if getattr(exp, section) is not None:
                out.append((section, "needs a git baseline (`baseline.ref`): an installed package has no "
                                     "worktree to freeze or profile"))
    gate_names = [g.name for g in exp.gates]
    if len(set(gate_names)) != len(gate_names):
        out.append(("gates", f"gate names must be unique, got {gate_names}"))
    fixture_names = {s.name for s in exp.fixture_shapes}
    if exp.fixtures is not None:
        missing = [c for c in exp.fixtures.cases if c not in fixture_names]
        if missing:
            out.append(("fixtures.cases", f"names {missing}, not in fixture_shapes {sorted(fixture_names)}"))
    for section in ("profile", "ncu"):
        block = getattr(exp, section)
        if block is not None:
            missing = [r for r in block.rows if r not in known]
            if missing:
                out.append((f"{section}.rows", f"names {missing}, not in shapes {sorted(known)}"))
    if exp.ncu is not None:
        missing = [s for s in exp.ncu.stages if s not in exp.stages]
        if missing:
            out.append(("ncu.stages", f"names {missing}, not in stages {sorted(exp.stages)}"))
    out += _bytes_expr_problems(exp)
    out += _stage_overlap_problems(exp)
    return out


def _stage_overlap_problems(exp: "Experiment") -> list[tuple[str, str]]:
    """Stages that certainly share kernels: a plain-name pattern (no regex syntax) that the
    profile's own rule (kernel_profile.matching_stages) puts in two stages of the same side. The
    profile stops at such a kernel (OverlapError) only after a run's verify has spent device time;
    here the file stops at load. Regexes that could overlap only on names not written in the file
    are left to the profile."""
    from harness.kernel_profile import matching_stages

    out: list[tuple[str, str]] = []
    for side in ("baseline", "candidate"):
        patterns = {name: getattr(stage, side) for name, stage in exp.stages.items()}
        plain = dict.fromkeys(p for pats in patterns.values() for p in pats if re.escape(p) == p)
        for name in plain:
            hits = matching_stages(name, patterns)
            if len(hits) > 1:
                out.append((f"stages.{hits[-1]}.{side}",
                            f"stages {' and '.join(map(repr, hits))} both match kernels named {name!r}: a "
                            "kernel counts in one stage only; list it in one of them (a stage may "
                            "list several kernels, and the report's kernel table has each one)"))
    return out


def _bytes_expr_problems(exp: "Experiment") -> list[tuple[str, str]]:
    """Every name of a byte expression is a dimension (or a derived name) of each row it is
    evaluated on: the gate's rows, the profile's rows, and their CPU stand-ins of the same name."""
    from harness.gates import shape_dims  # lazy: gates imports this module

    groups = [exp.shapes] + ([exp.cpu.shapes] if exp.cpu is not None else [])
    checks = [(f"gates[{i}].min_reduction_bytes", g.min_reduction_bytes, g.rows)
              for i, g in enumerate(exp.gates) if isinstance(g, PeakAllocGate)]
    if exp.profile is not None:
        checks += [(f"profile.removable[{i}].bytes", r.bytes, exp.profile.rows)
                   for i, r in enumerate(exp.profile.removable)]
    out = []
    for loc, expr, rows in checks:
        names = bytes_expr_names(expr)
        for shape in (s for group in groups for s in group if s.name in rows):
            missing = sorted(names - set(shape_dims(shape)))
            if missing:
                out.append((loc, f"{expr!r} uses {missing}, not a dimension of row {shape.name!r} "
                                 f"(it has {', '.join(shape_dims(shape))})"))
                break
    return out


def _parse_path(text: str) -> tuple:
    parts: list = []
    for name, index in re.findall(r"([A-Za-z_][\w]*)|\[(\d+)\]", text):
        parts.append(name if name else int(index))
    return tuple(parts)


def _located(msg: str) -> list[tuple[tuple, str]] | None:
    """Split a cross-reference message ("@path: problem; @path: problem") into located problems."""
    if not msg.startswith("@"):
        return None
    out = []
    for piece in msg.split("; @"):
        path, _, problem = piece.lstrip("@").partition(": ")
        out.append((_parse_path(path), problem))
    return out


# --- loading with line numbers ---------------------------------------------------------------

def _line_index(node: yaml.Node, prefix: tuple = ()) -> dict[tuple, int]:
    """Map every YAML path (tuple of keys / indices) to its 1-based line."""
    index = {prefix: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            index[prefix + (key,)] = key_node.start_mark.line + 1
            index.update({k: v for k, v in _line_index(value_node, prefix + (key,)).items() if k != prefix + (key,)})
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            index.update(_line_index(item, prefix + (i,)))
    return index


def _line_for(loc: tuple, index: dict[tuple, int]) -> int | None:
    # pydantic adds discriminator tags (e.g. 'speedup') into loc; drop parts the YAML lacks.
    path: tuple = ()
    best = index.get(())
    for part in loc:
        if path + (part,) in index:
            path = path + (part,)
            best = index[path]
    return best


def _fmt_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)
# PyYAML reads YAML 1.1, where `1e-5` (an exponent without a dot) is a string; YAML 1.2 and every
# reader of these files take it for the number it looks like. Numbers are strict in the schema, so
# read it as a float (a quoted '1e-5' stays a string and is refused where a number belongs).
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _repo_root(path: Path) -> Path:
    for parent in [path.parent, *path.parent.parents]:
        if (parent / ".git").exists():
            return parent
    return path.parent


def setup_error(loaded: "LoadedExperiment", *problems: tuple[str, str]) -> SetupError:
    """A SetupError from (field, problem) pairs, each field a YAML path such as 'target.op' or
    'gates[3].path', named with its line."""
    try:
        node = yaml.compose(loaded.path.read_text(), Loader=yaml.SafeLoader)
        index = _line_index(node) if node is not None else {}
    except (OSError, yaml.YAMLError):
        index = {}
    return SetupError(loaded.path, [(field, _line_for(_parse_path(field), index), message)
                                    for field, message in problems])


# --- reading the YAML safely ------------------------------------------------------------------
MAX_YAML_BYTES = 1 << 20  # an experiment file is a few KB
MAX_YAML_DEPTH = 32  # nested mappings and lists
MAX_YAML_VALUES = 100_000  # values once aliases are expanded (a YAML alias bomb grows exponentially)


def _yaml_text(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise SpecError(path, [("", None, f"{size} bytes: an experiment file is at most {MAX_YAML_BYTES} bytes")])
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise SpecError(path, [("", line, f"not UTF-8 text (byte {e.start}): an experiment file is UTF-8 YAML")]) from None


def _check_yaml_shape(text: str, path: Path) -> None:
    """One pass over the parser's events, before anything is built from them (PyYAML's parser keeps
    an explicit stack; its composer and constructor recurse, and expand aliases): refuse nesting
    deeper than MAX_YAML_DEPTH, more than MAX_YAML_VALUES values with aliases expanded, and mapping
    keys that are lists or mappings."""
    def fail(event, msg: str):
        raise SpecError(path, [("", event.start_mark.line + 1, msg)])

    open_: list[list] = []  # per open collection: [anchor, expanded size, is a mapping, children so far]
    anchors: dict[str, tuple[int, bool]] = {}  # anchor -> (expanded size, is a collection)
    values = 0

    def child(event, size: int, collection: bool) -> None:
        """A value of `size` expanded values enters the innermost open collection."""
        if open_:
            parent = open_[-1]
            if parent[2] and parent[3] % 2 == 0 and collection:
                fail(event, "a mapping key must be a plain value, not a list or a mapping")
            parent[1] += size
            parent[3] += 1

    def count(event, n: int) -> None:
        nonlocal values
        values += n
        if values > MAX_YAML_VALUES:
            fail(event, f"more than {MAX_YAML_VALUES} values once aliases are expanded (an alias bomb?)")

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_) >= MAX_YAML_DEPTH:
                    fail(event, f"nested deeper than {MAX_YAML_DEPTH} levels")
                if open_ and open_[-1][2] and open_[-1][3] % 2 == 0:
                    fail(event, "a mapping key must be a plain value, not a list or a mapping")
                open_.append([event.anchor, 1, isinstance(event, yaml.MappingStartEvent), 0])
                count(event, 1)
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, size, _, _ = open_.pop()
                if anchor:
                    anchors[anchor] = (size, True)
                child(event, size, collection=False)  # its key position was checked at its start
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor:
                    anchors[event.anchor] = (1, False)
                child(event, 1, collection=False)
                count(event, 1)
            elif isinstance(event, yaml.AliasEvent):
                size, collection = anchors.get(event.anchor, (1, False))  # unknown: the composer says so
                child(event, size, collection)
                count(event, size)
    except yaml.YAMLError:
        return  # not valid YAML: load_experiment reports it with its line


def load_experiment(path: str | Path) -> LoadedExperiment:
    """Parse and validate an experiment file; raise SpecError naming file, field and line."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(path, [("", None, "no such experiment file")])
    text = _yaml_text(path)
    _check_yaml_shape(text, path)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise SpecError(path, [("", mark.line + 1 if mark else None, f"not valid YAML: {e}")]) from e
    if not isinstance(data, dict):
        raise SpecError(path, [("", 1, "expected a mapping of experiment fields at the top level")])
    index = _line_index(node) if node is not None else {}
    try:
        exp = Experiment.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            located = _located(msg) if not loc else None
            if located:
                problems += [(_fmt_loc(l), _line_for(l, index), m) for l, m in located]
                continue
            problems.append((_fmt_loc(loc), _line_for(loc, index), msg))
        raise SpecError(path, problems) from None
    loaded = LoadedExperiment(exp=exp, path=path.resolve(), root=_repo_root(path.resolve()))
    _check_files_inside(loaded, index)  # before any of them is imported
    _check_against_inputs(loaded, index)
    _check_model_files(loaded, index)
    _check_files_beside(loaded, index)
    return loaded


def load_inputs_module(loaded: LoadedExperiment):
    """Import the inputs factory file under a private module name (never as part of the op's package)."""
    file = loaded.inputs_file
    if not file.is_file():
        raise SpecError(loaded.path, [("target.inputs", None, f"inputs file {file} does not exist")])
    spec = importlib.util.spec_from_file_location(f"_harness_inputs_{loaded.exp.name.replace('-', '_').replace('.', '_')}", file)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def inputs_factory(loaded: LoadedExperiment):
    module = load_inputs_module(loaded)
    fn_name = loaded.exp.target.inputs.split(":")[1]
    if not hasattr(module, fn_name):
        raise SpecError(loaded.path, [("target.inputs", None, f"{loaded.inputs_file} has no function {fn_name!r}")])
    return module, getattr(module, fn_name)


def _check_against_inputs(loaded: LoadedExperiment, index: dict[tuple, int]) -> None:
    """Ask the op's inputs module whether it can take each declared shape (its `shape_problem`)."""
    module, _ = inputs_factory(loaded)
    check = getattr(module, "shape_problem", None)
    if check is None:
        return
    problems = []
    groups = [("shapes", loaded.exp.shapes), ("fixture_shapes", loaded.exp.fixture_shapes)]
    if loaded.exp.cpu is not None:
        groups += [("cpu.shapes", loaded.exp.cpu.shapes), ("cpu.fixture_shapes", loaded.exp.cpu.fixture_shapes)]
    for field, shapes in groups:
        for i, shape in enumerate(shapes):
            try:
                why = check(shape.model_dump(exclude_none=True))
            except Exception as e:  # noqa: BLE001 - the factory's own bug, named where it bites
                why = f"{loaded.inputs_file}: shape_problem raised {type(e).__name__}: {e}"
            if why:
                loc = tuple(field.split(".")) + (i,)
                problems.append((f"{field}[{i}] ({shape.name})", _line_for(loc, index), f"the op cannot take this shape: {why}"))
    if problems:
        raise SpecError(loaded.path, problems)


def outside_problem(loaded: LoadedExperiment, raw: str, resolved: Path) -> str | None:
    """Why a file the experiment names by path (`raw`, resolved to `resolved`) may not be used: a
    relative path must stay inside the experiment's folder or the target repository (symlinks
    followed); a file elsewhere must be named by an explicit absolute path. None when it may."""
    if Path(raw).is_absolute():
        return None
    bases = [loaded.path.parent.resolve(), loaded.target_repo]
    if any(resolved.is_relative_to(b) for b in bases):
        return None
    return (f"{raw} resolves to {resolved}, outside the experiment's folder {bases[0]} and the target repository "
            f"{bases[1]}; name a file elsewhere by its absolute path")


def _check_files_inside(loaded: LoadedExperiment, index: dict[tuple, int]) -> None:
    """Every file or folder the harness imports code from by a path the experiment gives (the inputs
    factory, the reference adapter, training model files, the CPU profile's python_path): see
    `outside_problem`."""
    exp = loaded.exp
    named = [(("target", "inputs"), exp.target.inputs, loaded.inputs_file)]
    if loaded.reference_adapter is not None:
        named.append((("fixtures", "reference"), exp.fixtures.reference, loaded.reference_adapter))
    for group, rows in (("training", exp.training), ("cpu.training", (exp.cpu.training if exp.cpu else None) or [])):
        named += [((*group.split("."), i, "model"), row.model, loaded.model_file(row)) for i, row in enumerate(rows)]
    if exp.cpu is not None:
        named += [(("cpu", "python_path", i), folder, loaded.beside(folder)) for i, folder in enumerate(exp.cpu.python_path)]
    problems = []
    for loc, value, resolved in named:
        why = outside_problem(loaded, value.split(":")[0], resolved)
        if why:
            problems.append((_fmt_loc(loc), _line_for(loc, index), why))
    if problems:
        raise SpecError(loaded.path, problems)


def _check_model_files(loaded: LoadedExperiment, index: dict[tuple, int]) -> None:
    """Every training row's model file exists (it is loaded by path in each block)."""
    problems = []
    groups = [("training", loaded.exp.training)]
    if loaded.exp.cpu is not None and loaded.exp.cpu.training:
        groups.append(("cpu.training", loaded.exp.cpu.training))
    for field, rows in groups:
        for i, row in enumerate(rows):
            file = loaded.model_file(row)
            if not file.is_file():
                loc = tuple(field.split(".")) + (i, "model")
                problems.append((f"{field}[{i}].model", _line_for(loc, index), f"model file {file} does not exist"))
    if problems:
        raise SpecError(loaded.path, problems)


def _check_files_beside(loaded: LoadedExperiment, index: dict[tuple, int]) -> None:
    """The reference adapter file and the CPU profile's python_path folders exist."""
    problems = []
    adapter = loaded.reference_adapter
    if adapter is not None and not adapter.is_file():
        problems.append(("fixtures.reference", _line_for(("fixtures", "reference"), index),
                         f"reference adapter file {adapter} does not exist"))
    for i, folder in enumerate(loaded.cpu_python_path):
        if not folder.is_dir():
            problems.append((f"cpu.python_path[{i}]", _line_for(("cpu", "python_path", i), index),
                             f"folder {folder} does not exist"))
    if problems:
        raise SpecError(loaded.path, problems)
