"""The block worker of the first engine (`measure.engine: blocks`): one measured block in a fresh
process, timing one side's op and appending records as it goes.

Started by harness/measure/blocks.py as `python -m harness.measure.blocks_worker JOB.json` with this
checkout on PYTHONPATH. The harness (timing, inputs, records) is imported first, from this checkout;
only then is the side's worktree put at the front of sys.path and the op imported from it
(harness/measure/call.py), so the op never comes from the other side and the harness never from the
worktree.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from harness.device import gpu_snapshot
from harness.kernel_profile import profile_calls
from harness.measure.call import DTYPES, Call, Timer, check_finite, free_cuda, load_inputs, load_op, peak_bytes
from harness.records import append_jsonl
from harness.training import run_training_rows


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def run_block(job: dict) -> int:
    base = {"block": job["block"], "side": job["side"], "attempt": job["attempt"]}
    samples_path = Path(job["samples_path"])

    def emit(kind: str, **fields):
        append_jsonl(samples_path, {"type": kind, **base, **fields})

    emit("block_start", t=_now(), host=socket.gethostname(), pid=os.getpid(), gpu=gpu_snapshot())
    status, error = "ok", None
    try:
        make_inputs = load_inputs(job["inputs_file"], job["inputs_fn"])
        op = load_op(job["worktree"], job["op"], job.get("package"))
        if job.get("package"):
            import importlib

            module = importlib.import_module(job["op"].split(":")[0])
            emit("provenance", module_file=str(Path(module.__file__).resolve()), package=job["package"])
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            # one thread: blocks on a shared CPU are steadier, and the two sides get the same
            torch.set_num_threads(int(os.environ.get("HARNESS_CPU_THREADS", "1")))
        dtype = DTYPES[job["dtype"]]
        timer = Timer(job["timing"], job["l2_flush"])
        rows = [(s, m) for s in job["shapes"] for m in job["modes"]]
        broken: dict[tuple[str, str], str] = {}

        def build(shape: dict, mode: str) -> Call:
            inputs = make_inputs(shape, mode, dtype, device, job["seed"])
            return Call(op, inputs, mode, job["seed"])

        # Warm every (shape, mode) before the first timed sample: compile and autotune happen here.
        for shape, mode in rows:
            try:
                call = build(shape, mode)
                for _ in range(max(1, job["warmup"])):
                    outs = call()
                timer.sync()
                check_finite(outs)
            except Exception as e:  # recorded, and the block goes on with the other rows
                broken[(shape["name"], mode)] = f"{type(e).__name__}: {e}"
                emit("failure", shape=shape["name"], mode=mode, error=broken[(shape["name"], mode)],
                     trace=traceback.format_exc(limit=8))
                free_cuda()
            finally:
                call = outs = None

        for shape, mode in rows:
            key = (shape["name"], mode)
            if key in broken:
                continue
            try:
                call = build(shape, mode)
                if torch.cuda.is_available():
                    call()  # re-warm after regenerating inputs (allocator, caches)
                for i in range(job["samples"]):
                    emit("sample", shape=key[0], mode=mode, i=i, ms=timer.time_ms(call))
                peak = peak_bytes(call)
                if peak is not None:
                    emit("peak", shape=key[0], mode=mode, bytes=int(peak))
                if job["stage_iters"] > 0:  # stage times, the kernel table and summed device time
                    calls = profile_calls(call, job["stage_iters"], job["stage_patterns"])
                    totals: dict[str, list] = {}  # kernel name -> [total ms, launches] over the calls
                    for i, kernels in enumerate(calls):
                        for stage in job["stage_patterns"]:
                            ms = sum(k_ms for _, k_ms, k_stage in kernels if k_stage == stage)
                            emit("stage", shape=key[0], mode=mode, i=i, stage=stage, ms=ms)
                        emit("device", shape=key[0], mode=mode, i=i, ms=sum(k_ms for _, k_ms, _ in kernels))
                        for name, k_ms, _ in kernels:
                            t = totals.setdefault(name, [0.0, 0])
                            t[0] += k_ms
                            t[1] += 1
                    emit("kernels", shape=key[0], mode=mode, iters=len(calls), kernels=totals)
            except Exception as e:
                emit("failure", shape=key[0], mode=mode, error=f"{type(e).__name__}: {e}",
                     trace=traceback.format_exc(limit=8))
                free_cuda()
            finally:
                call = None

        if job.get("training"):  # after the operator rows, in this same process (harness/training.py)
            run_training_rows(job, emit, op, device)
    except Exception as e:
        status, error = "failed", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    emit("block_end", t=_now(), status=status, error=error, gpu=gpu_snapshot())
    return 0 if status == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    return run_block(job)


if __name__ == "__main__":
    raise SystemExit(main())
