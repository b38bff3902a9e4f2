"""One measured block: runs in a fresh process, times one side's op, appends records as it goes.

Started by harness/bench.py as `python -m harness.worker JOB.json` with this checkout on
PYTHONPATH. The harness (timing, inputs, records) is imported first, from this checkout; only then
is the side's worktree put at the front of sys.path and the op imported from it, so the op never
comes from the other side and the harness never from the worktree.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from harness.device import gpu_snapshot
from harness.kernel_profile import profile_calls
from harness.records import append_jsonl
from harness.spec import SpecError  # noqa: F401  (imported so the harness package is pinned before the worktree)
from harness.training import run_training_rows

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _load_inputs(file: str, fn: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_harness_block_inputs", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, fn)


def _load_op(worktree: str, op: str, package: dict | None = None):
    """The side's op: from its worktree (git side), or as installed at the declared version."""
    import importlib

    from harness.triton_autotune_cache import make_autotune_cache_serialisable

    make_autotune_cache_serialisable()

    module_name, fn = op.split(":")
    if package:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version(package["name"])
        except PackageNotFoundError as e:
            raise RuntimeError(f"package {package['name']!r} is not installed (the side declares "
                               f"{package['name']}=={package['version']})") from e
        if found != package["version"]:
            raise RuntimeError(f"package {package['name']} is {found}, the side declares {package['version']}")
        return getattr(importlib.import_module(module_name), fn)
    sys.path.insert(0, worktree)
    module = importlib.import_module(module_name)
    origin = Path(module.__file__).resolve()
    if not str(origin).startswith(str(Path(worktree).resolve())):
        raise RuntimeError(f"op module {module_name} was imported from {origin}, not from the side's worktree {worktree}")
    return getattr(module, fn)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    raise TypeError(f"op returned {type(out).__name__}; expected a tensor or a tuple of tensors")


class Call:
    """One (shape, mode) made callable: forward, or forward plus backward with a fixed cotangent."""

    def __init__(self, op, inputs: dict, mode: str, seed: int):
        self.op, self.mode = op, mode
        self.args, self.kwargs = inputs.get("args", ()), inputs.get("kwargs", {})
        self.grad_inputs = [self.kwargs[n] for n in inputs.get("grad_inputs", [])] if mode == "fwdbwd" else []
        self.cotangents = None
        self.seed = seed

    def __call__(self):
        if self.mode == "fwd":
            with torch.no_grad():
                return _tensors(self.op(*self.args, **self.kwargs))
        outs = [t for t in _tensors(self.op(*self.args, **self.kwargs)) if t.requires_grad]
        if self.cotangents is None:
            g = torch.Generator(device="cpu").manual_seed(self.seed + 1)
            self.cotangents = [torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.device, o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, self.grad_inputs, self.cotangents, allow_unused=True)
        return outs + [g for g in grads if g is not None]


def warmup_calls(declared: int) -> int:
    """Untimed calls before a row is timed or profiled: at least one on a GPU (compiling, autotuning
    and graph capture must never be timed), as declared on a CPU, where Triton's interpreter compiles
    and tunes nothing and a call costs seconds (0 there skips the warm-up; see check_finite)."""
    return max(1, declared) if torch.cuda.is_available() else declared


def check_finite(outs: list[torch.Tensor]) -> None:
    """FloatingPointError naming the op's outputs (and gradients) that hold NaN or inf: a row that
    computes garbage is never timed as if it were a result."""
    bad = [i for i, t in enumerate(outs) if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise FloatingPointError(f"non-finite values in output(s) {bad}")


class Timer:
    """CUDA events around each call with an L2 flush before it; perf_counter on CPU."""

    def __init__(self, method: str, l2_flush: bool):
        self.cuda = torch.cuda.is_available()
        self.method = method if self.cuda else "wall"
        self.flush_buf = None
        if self.cuda and l2_flush:
            l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 * 2**20
            self.flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        if self.flush_buf is not None:
            self.flush_buf.zero_()
        if self.cuda and self.method == "cuda_events":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3


def peak_bytes(fn) -> int | None:
    """Bytes allocated at the peak of one call above what was held before it (CUDA only)."""
    if not torch.cuda.is_available():
        return None  # a CPU 0 is no peak: report nothing
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run_block(job: dict) -> int:
    base = {"block": job["block"], "side": job["side"], "attempt": job["attempt"]}
    samples_path = Path(job["samples_path"])

    def emit(kind: str, **fields):
        append_jsonl(samples_path, {"type": kind, **base, **fields})

    emit("block_start", t=_now(), host=socket.gethostname(), pid=os.getpid(), gpu=gpu_snapshot())
    status, error = "ok", None
    try:
        make_inputs = _load_inputs(job["inputs_file"], job["inputs_fn"])
        op = _load_op(job["worktree"], job["op"], job.get("package"))
        if job.get("package"):
            import importlib

            module = importlib.import_module(job["op"].split(":")[0])
            emit("provenance", module_file=str(Path(module.__file__).resolve()), package=job["package"])
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            # one thread: blocks on a shared CPU are steadier, and the two sides get the same
            torch.set_num_threads(int(os.environ.get("HARNESS_CPU_THREADS", "1")))
        dtype = _DTYPES[job["dtype"]]
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
                _free_cuda()
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
                _free_cuda()
            finally:
                call = None

        if job.get("training"):  # after the operator rows, in this same process (harness/training.py)
            run_training_rows(job, emit, op, device)
    except Exception as e:
        status, error = "failed", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    emit("block_end", t=_now(), status=status, error=error, gpu=gpu_snapshot())
    return 0 if status == "ok" else 1


def _free_cuda():
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    return run_block(job)


if __name__ == "__main__":
    raise SystemExit(main())
