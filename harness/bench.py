"""The first measurement engine (`measure.engine: blocks`): interleaved blocks, the plan (ABBA... or
seeded random) and the loop that runs each block in a fresh worker process, resuming from the last
complete block after a crash. The default engine is harness/measure/ (lockstep side workers); both
take their settings from `BenchSettings`, and the pieces both need (a side's op and environment)
live here.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness import children
from harness.progress import Progress, as_progress
from harness.records import Block, append_jsonl, completed_blocks, declared_side, load_blocks
from harness.revisions import Revisions, check_unmoved
from harness.spec import SIDES, LoadedExperiment, MeasureSpec, Shape, TrainingRow

HARNESS_ROOT = Path(__file__).resolve().parent.parent


def block_plan(blocks_per_side: int, order: str, seed: int) -> list[str]:
    """Side of each block. 'abba': A B B A A B B A ...; 'random': each consecutive pair in a
    seeded random order, so every prefix stays balanced."""
    if order == "abba":
        return [SIDES[(i + 1) // 2 % 2] for i in range(2 * blocks_per_side)]
    rng = random.Random(seed)
    plan: list[str] = []
    for _ in range(blocks_per_side):
        pair = list(SIDES)
        rng.shuffle(pair)
        plan += pair
    return plan


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
    if cpu_mode:
        env["TRITON_INTERPRET"] = "1"
    return env


class SamplesTail:
    """Samples of one attempt as its worker appends them: reads samples.jsonl on from where the file
    ended when the tail was made, whole lines only (a torn line is skipped, as records.read_jsonl does)."""

    def __init__(self, path: Path, attempt: str):
        self.path, self.attempt = path, attempt
        self.offset = path.stat().st_size if path.exists() else 0
        self.counts: dict[tuple[str, str], int] = {}

    def poll(self) -> dict[tuple[str, str], int]:
        """(shape, mode) -> samples so far, for the rows that got new samples since the last poll."""
        if not self.path.exists():
            return {}
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return {}
        self.offset += end + 1
        changed = {}
        for line in data[:end + 1].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("type") == "sample" and rec.get("attempt") == self.attempt:
                key = (rec.get("shape"), rec.get("mode"))
                self.counts[key] = changed[key] = self.counts.get(key, 0) + 1
        return changed


def _run_worker(argv: list[str], run_dir: Path, env: dict, log_path: Path, tail: SamplesTail, progress: Progress,
                samples: int, poll_s: float = 0.25) -> int:
    """The worker process, its output to `log_path`; its samples reported as they land. Started through
    harness/children.py: on any way out (a stop signal, an error here) its process group is killed."""
    with log_path.open("w") as out:
        proc = children.start(argv, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    proc.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    pass
                for (shape, mode), n in tail.poll().items():
                    progress.row_progress(shape, mode, n, samples)
                if proc.returncode is not None:
                    return proc.returncode
        finally:  # never leave a worker (or anything it started) measuring behind us
            children.kill_group(proc)


def run_blocks(loaded: LoadedExperiment, revisions: Revisions, run_dir: Path, settings: BenchSettings,
               profile_root: Path, plan: list[str], log: Progress | Callable[[str], None] = print) -> None:
    """Run every block of `plan` that has no complete record yet, in order. `log`: a Progress (a plain
    callable gets quiet progress lines)."""
    exp = loaded.exp
    progress = as_progress(log)
    samples_path = run_dir / "samples.jsonl"
    finished = completed_blocks(samples_path)
    done = {b.index for b in finished}
    progress.bench_plan(len(plan), finished)
    rows = [(s.name, m, settings.samples_per_block) for s in settings.shapes for m in exp.modes]
    _, inputs_fn = exp.target.inputs.split(":")
    for index, side in enumerate(plan):
        if index in done:
            continue
        check_unmoved(revisions)
        declared = declared_side(side, settings.aa)  # whose op and env this block runs
        attempt = uuid.uuid4().hex[:12]
        job = {
            "samples_path": str(samples_path.resolve()), "block": index, "side": side, "attempt": attempt,
            "worktree": getattr(revisions, side).worktree, **side_op(exp, declared),
            "inputs_file": str(loaded.inputs_file), "inputs_fn": inputs_fn,
            "shapes": [s.model_dump(exclude_none=True) for s in settings.shapes], "modes": list(exp.modes),
            "dtype": settings.dtype, "seed": exp.seed, "samples": settings.samples_per_block,
            "warmup": settings.warmup, "timing": settings.timing, "l2_flush": settings.l2_flush,
            "stage_patterns": {name: getattr(p, side) for name, p in exp.stages.items()},
            "stage_iters": settings.stage_iters,
            "training": [training_job_row(loaded, t) for t in settings.training],
        }
        job_path = run_dir / "jobs" / f"block-{index:03d}-{side}.json"
        job_path.parent.mkdir(parents=True, exist_ok=True)
        job_path.write_text(json.dumps(job, indent=1))
        log_path = run_dir / "logs" / f"block-{index:03d}-{side}-{attempt}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        tail = SamplesTail(samples_path, attempt)
        rs = getattr(revisions, side)
        progress.block_started(index, len(plan), side, (rs.sha or "")[:10] or rs.ref, rows)
        rc = _run_worker([sys.executable, "-m", "harness.measure.blocks_worker", str(job_path)], run_dir,
                         side_env(loaded, declared, profile_root, settings.cpu_mode), log_path, tail, progress,
                         settings.samples_per_block)
        if index not in {b.index for b in completed_blocks(samples_path)}:
            # the worker died without closing its block (segfault, CUDA abort, OOM kill)
            log_tail = log_path.read_text()[-2000:]
            append_jsonl(samples_path, {"type": "block_end", "block": index, "side": side, "attempt": attempt,
                                        "status": "failed", "error": f"worker exited {rc}: {log_tail}",
                                        "t": None, "gpu": None})
        block = next((b for b in load_blocks(samples_path) if b.attempt == attempt), None)
        progress.block_finished(block or Block(index=index, side=side, attempt=attempt, status="failed"))
    check_unmoved(revisions)
