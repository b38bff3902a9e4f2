"""`harness warm EXP`: compile every kernel the run will need into the experiment's Triton cache,
in parallel processes, before any timed or tuned work.

On a fresh GPU machine the first call of each (dtype, head dims, dense/varlen) combination compiles
every autotune config of every stage: about a minute per combination on the H200, one process at a
time, which is most of a session's device time. Compilation is CPU work, so it runs here in up to
`--jobs` processes at once: one per side and (row or fixture case, dtype), each calling the side's
op from its worktree in fwd and fwd+bwd once, and one per side and training row (one optimizer step). Autotune results are NOT cached by these processes
(TRITON_CACHE_AUTOTUNING unset): their benchmarks overlap on the GPU and would be noise. The
harness's own processes later find the binaries compiled and tune on a quiet GPU.
Kernel binaries are addressed by their source hash, so warming cannot change what a side runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import children
from harness.measure.sides import side_env, side_op, training_job_row, triton_cache_dir
from harness.results import HARNESS_ROOT
from harness.spec import LoadedExperiment


def warm_jobs(loaded: LoadedExperiment, sides: list, fixtures: bool = True) -> list[dict]:
    """(side, shape, dtype) combinations: every bench row in the experiment dtype, every fixture
    case in the fixtures' dtype and each low-precision dtype. `sides`: ResolvedSide records
    (one per distinct side: an A/A run warms its one revision once)."""
    exp = loaded.exp
    combos: list[tuple[dict, str]] = [(s.model_dump(exclude_none=True), exp.dtype) for s in exp.shapes]
    if exp.fixtures is not None and fixtures:
        for name in exp.fixtures.cases:
            shape = exp.shape(name).model_dump(exclude_none=True)
            combos.append((shape, exp.fixtures.dtype))
            combos += [(shape, lp.dtype) for lp in exp.fixtures.low_precision]
    # rows that differ only in batch and length share their kernels' specialisations (both are
    # runtime ints, divisible by 16 in every declared row): warm one of them; anything missed
    # simply compiles later, in the harness's own process
    seen, unique = set(), []
    for shape, dtype in combos:
        key = (dtype, json.dumps({k: v for k, v in shape.items() if k not in ("name", "B", "T", "seqlens")},
                                 sort_keys=True), "seqlens" in shape)
        if key not in seen:
            seen.add(key)
            unique.append((shape, dtype))
    combos = unique
    jobs = []
    for rs in sides:
        call = side_op(exp, rs.side)  # an installed package's side: its own op, as installed
        for shape, dtype in combos:
            jobs.append({"side": rs.side, "worktree": rs.worktree, **call,
                         "shape": shape, "dtype": dtype,
                         "inputs_file": str(loaded.inputs_file), "inputs_fn": exp.target.inputs.split(":")[1],
                         "seed": exp.seed})
        # training rows call the op through the model (their own head dims, varlen flag and
        # arguments): one untimed step each compiles what they need
        for t in exp.training:
            row = {**training_job_row(loaded, t), "warmup_steps": 1, "steps": 1}
            jobs.append({"side": rs.side, "worktree": rs.worktree, **call,
                         "shape": {"name": t.name}, "dtype": t.dtype, "training": [row]})
    return jobs


def run_warm(loaded: LoadedExperiment, sides: list, profile_root: Path, jobs: int = 8,
             log=print, timeout: float = 900, fixtures: bool = True) -> list[dict]:
    todo = warm_jobs(loaded, sides, fixtures=fixtures)
    out_dir = Path(profile_root) / loaded.exp.name / "warm"
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"warm: {len(todo)} processes ({jobs} at a time) into {triton_cache_dir(loaded, profile_root)}")
    t0 = time.time()

    def one(i_job):
        i, job = i_job
        env = side_env(loaded, job["side"], Path(profile_root), cpu_mode=False)
        env.pop("TRITON_CACHE_AUTOTUNING", None)  # see the module docstring
        path = out_dir / f"{i:02d}-{job['side']}-{job['shape']['name']}-{job['dtype']}.json"
        path.write_text(json.dumps(job))
        start = time.time()
        try:
            p = children.run([sys.executable, "-m", "harness.warm", str(path)], env=env, cwd=str(HARNESS_ROOT),
                             capture_output=True, text=True, timeout=timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-600:]
        except subprocess.TimeoutExpired:
            rc, tail = 124, f"timed out after {timeout:.0f} s"
        row = {"side": job["side"], "shape": job["shape"]["name"], "dtype": job["dtype"], "rc": rc,
               "seconds": round(time.time() - start, 1), "tail": tail if rc else ""}
        log(f"warm: {row['side']} {row['shape']} {row['dtype']}: {'ok' if rc == 0 else 'FAILED rc=' + str(rc)} "
            f"in {row['seconds']} s")
        return row

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(pool.map(one, enumerate(todo)))
    (out_dir / "warm.json").write_text(json.dumps({"seconds": round(time.time() - t0, 1), "rows": rows}, indent=1))
    log(f"warm: done in {time.time() - t0:.0f} s; {sum(r['rc'] != 0 for r in rows)} failed")
    return rows


def _one(job_file: str) -> int:
    """In the child: the side's op on one shape, fwd then fwd+bwd, once each."""
    import torch

    from harness.measure.call import DTYPES, Call, load_inputs, load_op

    job = json.loads(Path(job_file).read_text())
    op = load_op(job["worktree"], job["op"], job.get("package"))
    if job.get("training"):
        from harness.training import run_training_rows

        failures = []
        run_training_rows(job, lambda kind, **rec: failures.append(rec["error"]) if kind == "failure" else None,
                          op, "cuda")
        torch.cuda.synchronize()
        if failures:
            print("\n".join(failures), file=sys.stderr)
        return 1 if failures else 0
    make = load_inputs(job["inputs_file"], job["inputs_fn"])
    for mode in ("fwd", "fwdbwd"):
        inputs = make(dict(job["shape"]), mode, DTYPES[job["dtype"]], "cuda", int(job["seed"]))
        Call(op, inputs, mode, int(job["seed"]))()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(_one(sys.argv[1]))
