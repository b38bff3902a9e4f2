"""The process Nsight Compute profiles: one side's op, warmed, then ONE measured iteration.

Started by harness/ncu.py as `ncu ... python -m harness.ncu_target JOB.json` with this checkout on
PYTHONPATH. Like every measured process, the harness (inputs, the `Call` builder of
harness/measure/call.py) is imported first from this checkout; only then is the side's worktree put
at the front of sys.path and the op imported from it.

Only the measured iteration runs inside the NVTX push/pop range `harness.measure` (MEASURE_RANGE),
which ncu selects with `--nvtx --nvtx-include harness.measure/`: warm-up calls (compile, autotune)
are never profiled. NVTX push/pop ranges are per thread and autograd runs CUDA backward on its own
worker thread, so a fwdbwd iteration runs under `torch.autograd.set_multithreading_enabled(False)`:
the backward kernels are then launched on this thread, inside the range (../shared/notes/h200.md).
The op's own stage ranges (`pkda.fwd.*`, `pkda.bwd.*`) nest inside it.

JOB.json: {worktree, op, inputs_file, inputs_fn, shape {...}, mode, dtype, seed, warmup, result_path}.
Writes result_path: {status, error, device, versions, gpu_before, gpu_after, warmup, t}.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from harness.device import gpu_snapshot, versions
from harness.measure.call import DTYPES, Call, load_inputs, load_op  # harness first, then the op

MEASURE_RANGE = "harness.measure"
MIN_WARMUP = 3  # compile + autotune settle within a few calls; warm-up is never profiled


def _single_thread_autograd(mode: str):
    if mode == "fwdbwd":
        return torch.autograd.set_multithreading_enabled(False)
    return contextlib.nullcontext()


def measure_once(call, mode: str, warmup: int) -> None:
    """Warm `call` `warmup` times, then run it once inside the NVTX range MEASURE_RANGE."""
    cuda = torch.cuda.is_available()
    with _single_thread_autograd(mode):
        for _ in range(max(MIN_WARMUP, warmup)):
            call()
        if cuda:
            torch.cuda.synchronize()
        if cuda:
            torch.cuda.nvtx.range_push(MEASURE_RANGE)
        try:
            call()
            if cuda:
                torch.cuda.synchronize()
        finally:
            if cuda:
                torch.cuda.nvtx.range_pop()


def run(job: dict) -> int:
    result: dict = {"status": "ok", "error": None, "warmup": max(MIN_WARMUP, int(job.get("warmup", 0))),
                    "shape": job["shape"], "mode": job["mode"], "versions": versions(), "gpu_before": gpu_snapshot()}
    t0 = time.perf_counter()
    try:
        make_inputs = load_inputs(job["inputs_file"], job["inputs_fn"])
        op = load_op(job["worktree"], job["op"], job.get("package"))  # a package side: as installed
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            result["device"] = {"name": torch.cuda.get_device_name(0),
                                "capability": list(torch.cuda.get_device_capability(0))}
        inputs = make_inputs(job["shape"], job["mode"], DTYPES[job["dtype"]], device, int(job["seed"]))
        call = Call(op, inputs, job["mode"], int(job["seed"]))
        measure_once(call, job["mode"], int(job.get("warmup", 0)))
    except Exception as e:
        result["status"], result["error"] = "failed", f"{type(e).__name__}: {e}"
        result["trace"] = traceback.format_exc(limit=8)
        traceback.print_exc()
    result["gpu_after"] = gpu_snapshot()
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    if job.get("result_path"):
        Path(job["result_path"]).write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["status"] == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    raise SystemExit(main())
