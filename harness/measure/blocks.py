"""The first measurement engine (`measure.engine: blocks`), its parent side: interleaved blocks, the
plan (ABBA... or seeded random) and the loop that runs each block in a fresh worker process
(`python -m harness.measure.blocks_worker`), resuming from the last complete block after a crash.
The default engine is the lockstep one (driver.py, worker.py); both take their settings from
`BenchSettings` and a side's op and environment from sides.py.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable

from harness import children
from harness.measure.sides import BenchSettings, side_env, side_op, training_job_row
from harness.progress import Progress, as_progress
from harness.records import Block, append_jsonl, completed_blocks, declared_side, load_blocks
from harness.revisions import Revisions, check_unmoved
from harness.spec import SIDES, LoadedExperiment


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
