"""The profile subprocess: stage attribution of one side (the untouched baseline) in a fresh process.

Started by harness/profile.py as `python -m harness.profile_worker JOB.json` with this checkout on
PYTHONPATH and the side's env (harness.measure.sides.side_env). Same import discipline as the block worker,
whose pieces (harness/measure/call.py) it reuses: the harness (timing, inputs) is imported first,
from this checkout; only then is the side's worktree put at the front of sys.path and the op
imported from it.

Per (shape, mode) it measures
  - the endpoint: `iters` calls after warm-up, CUDA events on GPU (with the experiment's L2 flush),
    perf_counter on CPU (harness.measure.call.Timer);
  - the device time of every kernel in `iters` further calls under torch.profiler, each kernel
    assigned to at most one stage (see `attribute`);
and once per process the device-to-device copy bandwidth (`copy_bandwidth`).
It writes one JSON result to job["out_path"]; harness/profile.py turns it into profile.json.

What a "kernel" is, and which names a stage pattern is matched against:
  GPU  every device event torch.profiler reports for the CUDA device (kernels, memcpy, memset),
       except the GPU projections of record_function ranges (`is_user_annotation`), which would
       count their kernels twice. Time = the event's device time range. A kernel's names are its
       own name, then the names of the record_function ranges whose GPU projection contains it,
       innermost first.
  CPU  every (synchronous) CPU op or record_function range the profiler records. Time = its SELF
       time, so nested ranges and ops never count twice and the per-call total is the time the
       profiled ops cover. Its names are its own name, then its enclosing ops/ranges, innermost
       first. (Triton kernels under TRITON_INTERPRET=1 are invisible to the profiler on CPU.)
  The stage is decided by the innermost name that matches any stage pattern (re.search, as
  harness.kernel_profile.assign_stages); when that one name matches patterns of two stages, that is an
  error naming both. A kernel none of whose names match is unassigned: it is listed, never dropped.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from harness.device import device_info, versions
from harness.kernel_profile import OverlapError, attribute, profile_calls  # noqa: F401 (re-exported for tests)
from harness.measure.call import DTYPES, Call, Timer, load_inputs, load_op, warmup_calls


def summarise(calls: list[list[tuple[str, float, str | None]]], stages: list[str]) -> dict:
    """Per-call totals and a per-kernel table (mean ms and launches per call)."""
    n = len(calls)
    table: dict[tuple[str, str | None], list[float]] = {}
    per_call_total, per_call_stage, per_call_unassigned = [], {s: [] for s in stages}, []
    for call in calls:
        per_call_total.append(sum(ms for _, ms, _ in call))
        for s in stages:
            per_call_stage[s].append(sum(ms for _, ms, st in call if st == s))
        per_call_unassigned.append(sum(ms for _, ms, st in call if st is None))
        for name, ms, st in call:
            t = table.setdefault((name, st), [0.0, 0])
            t[0] += ms
            t[1] += 1
    kernels = [{"name": name, "stage": st, "ms": tot / n, "launches": cnt / n}
               for (name, st), (tot, cnt) in table.items()]
    kernels.sort(key=lambda k: -k["ms"])
    return {"device_total_samples_ms": per_call_total, "stage_samples_ms": per_call_stage,
            "unassigned_samples_ms": per_call_unassigned, "kernels": kernels}


def copy_bandwidth(nbytes: int, reps: int = 5) -> dict:
    """Bytes moved (read + written) per second by a device-to-device copy of an `nbytes` buffer:
    CUDA events on GPU, perf_counter around a torch CPU memcpy otherwise. Median of `reps`."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return {"bytes_per_s": 2 * nbytes / sec, "buffer_bytes": nbytes, "reps": reps, "median_s": sec,
            "counts": "read+write (2 x buffer bytes per copy)",
            "method": "torch copy_ timed with CUDA events" if cuda else "torch CPU copy_ timed with perf_counter"}


def run_profile(job: dict) -> dict:
    result: dict = {"rows": [], "errors": [], "device": None, "versions": None, "copy_bandwidth": None}
    try:
        result["device"], result["versions"] = device_info(), versions()
        make_inputs = load_inputs(job["inputs_file"], job["inputs_fn"])
        op = load_op(job["worktree"], job["op"])
        result["op_file"] = sys.modules[job["op"].split(":")[0]].__file__
        cuda = torch.cuda.is_available()
        device = "cuda" if cuda else "cpu"
        if not cuda:
            torch.set_num_threads(int(os.environ.get("HARNESS_CPU_THREADS", "1")))
        dtype = DTYPES[job["dtype"]]
        timer = Timer(job["timing"], job["l2_flush"])
        flush = (lambda: timer.flush_buf.zero_()) if timer.flush_buf is not None else None
        patterns = job["stage_patterns"]
        result["copy_bandwidth"] = copy_bandwidth(job["copy_bytes"])
        result["timing"] = {"endpoint": timer.method, "l2_flush": timer.flush_buf is not None,
                            "device": "torch.profiler CUDA device events (no user-annotation ranges)" if cuda
                            else "torch.profiler CPU events, self time"}
        for shape, mode in job["rows"]:
            row: dict = {"shape": shape["name"], "mode": mode, "shape_dims": shape}
            try:
                call = Call(op, make_inputs(shape, mode, dtype, device, job["seed"]), mode, job["seed"])
                for _ in range(warmup_calls(job["warmup"])):
                    call()
                timer.sync()
                row["endpoint_samples_ms"] = [timer.time_ms(call) for _ in range(job["iters"])]
                row.update(summarise(profile_calls(call, job["iters"], patterns, before=flush), list(patterns)))
            except OverlapError as e:
                row["error"] = str(e)
                result["errors"].append({"kind": "overlap", "row": f"{shape['name']}/{mode}", "kernel": e.name,
                                         "stages": e.stages, "message": str(e)})
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                result["errors"].append({"kind": "op_failed", "row": f"{shape['name']}/{mode}",
                                         "message": row["error"], "trace": traceback.format_exc(limit=8)})
            finally:
                call = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            result["rows"].append(row)
    except Exception as e:
        result["errors"].append({"kind": "worker_failed", "message": f"{type(e).__name__}: {e}",
                                 "trace": traceback.format_exc(limit=8)})
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    result = run_profile(job)
    out = Path(job["out_path"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(out)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
