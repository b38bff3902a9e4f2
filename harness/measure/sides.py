"""How a side's process is set up, for both engines and every worker of the harness: what a run
measures (`BenchSettings`, from the experiment or its `cpu:` profile), what a worker imports for a
side (`side_op`), the side's environment with the shared Triton cache (`side_env`,
`triton_cache_dir`) and a training row as a worker takes it (`training_job_row`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from harness import interpreter_tf32
from harness.results import HARNESS_ROOT
from harness.spec import LoadedExperiment, MeasureSpec, Shape, TrainingRow


@dataclass(frozen=True)
class BenchSettings:
    """What a block measures; on a CPU machine it comes from the experiment's `cpu:` profile."""

    shapes: list[Shape]
    dtype: str
    blocks_per_side: int
    samples_per_block: int
    warmup: int
    timing: str
    l2_flush: bool
    cpu_mode: bool
    stage_iters: int  # profiled calls per row and block for stage times
    training: tuple[TrainingRow, ...] = ()  # the cpu profile's rows of the same names on a CPU run
    aa: bool = False  # A/A: both plan sides run the baseline's declaration (ref, op, env)
    measure: MeasureSpec = MeasureSpec()  # the experiment's `measure:` (the cpu profile's on a CPU run)

    @classmethod
    def for_machine(cls, loaded: LoadedExperiment, cpu_mode: bool) -> "BenchSettings":
        exp = loaded.exp
        training = tuple(exp.training)
        if cpu_mode:
            # a cpu profile that declares training rows trains those (small, under the names of the
            # rows they stand in for) and no other; the interpreter runs fp32 only
            small = exp.cpu.training if exp.cpu is not None and exp.cpu.training is not None else training
            training = tuple(t.model_copy(update={"dtype": "float32"}) for t in small)
        if cpu_mode and exp.cpu is not None:
            c = exp.cpu
            return cls(list(c.shapes), c.dtype, c.blocks, c.samples_per_block, c.warmup, "wall", False, True,
                       stage_iters=c.stage_iters, training=training,
                       measure=c.measure.model_copy(update={"engine": exp.measure.engine}))
        dtype = "float32" if cpu_mode else exp.dtype
        return cls(list(exp.shapes), dtype, exp.blocks, exp.samples_per_block, exp.warmup,
                   "wall" if cpu_mode else exp.timing, exp.l2_flush and not cpu_mode, cpu_mode,
                   stage_iters=exp.stage_iters, training=training, measure=exp.measure)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["shapes"] = [s.model_dump(exclude_none=True) for s in self.shapes]
        d["training"] = [t.model_dump() for t in self.training]
        d["measure"] = self.measure.model_dump()
        return d


def training_job_row(loaded: LoadedExperiment, row: TrainingRow) -> dict:
    """A training row as the worker takes it: the model file resolved against the experiment file."""
    file, fn = row.model.split(":")
    return {**row.model_dump(), "model_file": str(loaded.model_file(row)), "model_fn": fn}


def triton_cache_dir(loaded: LoadedExperiment, profile_root: Path) -> Path:
    """One Triton cache for every experiment under a results root: Triton addresses compiled kernels
    and autotune results by the kernel's source hash, so experiments that share a side (pkda-aa and
    pkda-dAqk share their baseline) compile and tune it once, and none ever gets another's code."""
    return (Path(profile_root) / "triton-cache").resolve()


def side_op(exp, side: str) -> dict:
    """What a worker imports for `side` (its declaration): {"op": "module:function", "package":
    {"name", "version"} for an installed package, else None (the op comes from the worktree)}."""
    declared = getattr(exp, side)
    return {"op": declared.op or exp.target.op,
            "package": declared.package.model_dump() if declared.is_package else None}


def emulates_tf32(loaded: LoadedExperiment) -> bool:
    """Whether a CPU run of the experiment emulates TF32 dots (harness/interpreter_tf32.py)."""
    return loaded.exp.cpu is None or loaded.exp.cpu.emulate_tf32


def side_env(loaded: LoadedExperiment, side: str, profile_root: Path, cpu_mode: bool) -> dict[str, str]:
    """The block's environment: the side's declared env and the experiment's persistent Triton cache."""
    env = dict(os.environ)
    # Autotune timings persist in the cache: every fresh block process would otherwise benchmark
    # every config again (seconds per kernel and shape on the H200). A side's env wins.
    env["TRITON_CACHE_AUTOTUNING"] = "1"
    env.update(getattr(loaded.exp, side).env)
    # One cache for both sides: Triton addresses compiled kernels and autotune results by the
    # kernel's source hash, so a side never gets the other's code; a kernel both sides share
    # compiles once and runs with the same tuned config on both (its stage cannot differ by a
    # coin-flip between near-equal configs), and the first compile on a fresh GPU machine
    # (about a minute per dtype and head-dim pair there) is paid once, not twice.
    env["TRITON_CACHE_DIR"] = str(triton_cache_dir(loaded, profile_root))
    # a CPU run's `cpu.python_path` folders come right after the harness: a sitecustomize.py there
    # runs at interpreter start in every process of the side (e.g. an interpreter shim)
    extra = [str(p) for p in loaded.cpu_python_path] if cpu_mode else []
    env["PYTHONPATH"] = os.pathsep.join([str(HARNESS_ROOT), *extra, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop(interpreter_tf32.ENV, None)  # the experiment decides, never an inherited variable
    if cpu_mode:
        env["TRITON_INTERPRET"] = "1"
        if emulates_tf32(loaded):
            env[interpreter_tf32.ENV] = "1"
    return env
