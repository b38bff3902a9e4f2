"""Interleaved blocks: the plan (ABBA... or seeded random) and the loop that runs each block in a
fresh worker process, resuming from the last complete block after a crash.
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

from harness.records import append_jsonl, completed_blocks
from harness.revisions import Revisions, check_unmoved
from harness.spec import SIDES, LoadedExperiment, Shape, TrainingRow

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
    training: tuple[TrainingRow, ...] = ()  # the cpu profile's rows of the same names on a CPU run

    @classmethod
    def for_machine(cls, loaded: LoadedExperiment, cpu_mode: bool) -> "BenchSettings":
        exp = loaded.exp
        training = tuple(exp.training)
        if cpu_mode:
            small = {t.name: t for t in ((exp.cpu.training if exp.cpu is not None else None) or [])}
            # the interpreter runs fp32 only
            training = tuple(small.get(t.name, t).model_copy(update={"dtype": "float32"}) for t in training)
        if cpu_mode and exp.cpu is not None:
            c = exp.cpu
            return cls(list(c.shapes), c.dtype, c.blocks, c.samples_per_block, c.warmup, "wall", False, True, training)
        dtype = "float32" if cpu_mode else exp.dtype
        return cls(list(exp.shapes), dtype, exp.blocks, exp.samples_per_block, exp.warmup,
                   "wall" if cpu_mode else exp.timing, exp.l2_flush and not cpu_mode, cpu_mode, training)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["shapes"] = [s.model_dump(exclude_none=True) for s in self.shapes]
        d["training"] = [t.model_dump() for t in self.training]
        return d


def training_job_row(loaded: LoadedExperiment, row: TrainingRow) -> dict:
    """A training row as the worker takes it: the model file resolved against the experiment file."""
    file, fn = row.model.split(":")
    return {**row.model_dump(), "model_file": str(loaded.model_file(row)), "model_fn": fn}


def side_env(loaded: LoadedExperiment, side: str, profile_root: Path, cpu_mode: bool) -> dict[str, str]:
    """The block's environment: the side's declared env and its own persistent Triton cache."""
    env = dict(os.environ)
    # Autotune timings persist in the side's cache: every fresh block process would otherwise
    # benchmark every config again (seconds per kernel and shape on the H200). A side's env wins.
    env["TRITON_CACHE_AUTOTUNING"] = "1"
    env.update(getattr(loaded.exp, side).env)
    env["TRITON_CACHE_DIR"] = str((profile_root / loaded.exp.name / "triton-cache" / side).resolve())
    env["PYTHONPATH"] = os.pathsep.join([str(HARNESS_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if cpu_mode:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_blocks(loaded: LoadedExperiment, revisions: Revisions, run_dir: Path, settings: BenchSettings,
               profile_root: Path, plan: list[str], log: Callable[[str], None] = print) -> None:
    """Run every block of `plan` that has no complete record yet, in order."""
    exp = loaded.exp
    samples_path = run_dir / "samples.jsonl"
    done = {b.index for b in completed_blocks(samples_path)}
    _, inputs_fn = exp.target.inputs.split(":")
    for index, side in enumerate(plan):
        if index in done:
            continue
        check_unmoved(revisions)
        attempt = uuid.uuid4().hex[:12]
        job = {
            "samples_path": str(samples_path.resolve()), "block": index, "side": side, "attempt": attempt,
            "worktree": getattr(revisions, side).worktree, "op": getattr(exp, side).op or exp.target.op,
            "package": getattr(exp, side).package.model_dump() if getattr(exp, side).is_package else None,
            "inputs_file": str(loaded.inputs_file), "inputs_fn": inputs_fn,
            "shapes": [s.model_dump(exclude_none=True) for s in settings.shapes], "modes": list(exp.modes),
            "dtype": settings.dtype, "seed": exp.seed, "samples": settings.samples_per_block,
            "warmup": settings.warmup, "timing": settings.timing, "l2_flush": settings.l2_flush,
            "stage_patterns": {name: getattr(p, side) for name, p in exp.stages.items()},
            "stage_iters": exp.stage_iters,
            "training": [training_job_row(loaded, t) for t in settings.training],
        }
        job_path = run_dir / "jobs" / f"block-{index:03d}-{side}.json"
        job_path.parent.mkdir(parents=True, exist_ok=True)
        job_path.write_text(json.dumps(job, indent=1))
        log(f"block {index + 1}/{len(plan)} {side} ({getattr(revisions, side).sha[:10] or getattr(revisions, side).ref})")
        log_path = run_dir / "logs" / f"block-{index:03d}-{side}-{attempt}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as out:
            proc = subprocess.run([sys.executable, "-m", "harness.worker", str(job_path)], cwd=run_dir,
                                  env=side_env(loaded, side, profile_root, settings.cpu_mode),
                                  stdout=out, stderr=subprocess.STDOUT)
        if index not in {b.index for b in completed_blocks(samples_path)}:
            # the worker died without closing its block (segfault, CUDA abort, OOM kill)
            tail = log_path.read_text()[-2000:]
            append_jsonl(samples_path, {"type": "block_end", "block": index, "side": side, "attempt": attempt,
                                        "status": "failed", "error": f"worker exited {proc.returncode}: {tail}",
                                        "t": None, "gpu": None})
    check_unmoved(revisions)
