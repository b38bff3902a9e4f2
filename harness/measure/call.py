"""Calling a side's op and timing it: the pieces every measured process of the harness shares (the
lockstep side worker, the block worker, the profile, ncu, warm and agreement workers).

    DTYPES        the experiment's dtype names as torch dtypes
    load_inputs   the experiment's input factory, from its file
    load_op       the side's op: from its worktree (put at the front of sys.path), or as installed
    Call          one (shape, mode) made callable: forward, or forward plus backward
    warmup_calls  how many untimed calls come before a row is timed or profiled
    check_finite  a row whose outputs hold NaN or inf is never timed
    Timer         CUDA events (L2 flushed first) or perf_counter around one call
    peak_bytes    the peak allocation of one call

Import discipline: a worker imports the harness (this module, timing, records) first, from this
checkout; only then does load_op put the side's worktree at the front of sys.path and import the op
from it, so the op never comes from the other side and the harness never from the worktree.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from harness.spec import SpecError  # noqa: F401  (imported so the harness package is pinned before the worktree)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_inputs(file: str, fn: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_harness_block_inputs", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, fn)


def load_op(worktree: str, op: str, package: dict | None = None):
    """The side's op: from its worktree (git side), or as installed at the declared version."""
    import importlib

    from harness.interpreter_tf32 import emulate_tf32_dots
    from harness.triton_autotune_cache import make_autotune_cache_serialisable

    make_autotune_cache_serialisable()
    emulate_tf32_dots()

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


def free_cuda() -> None:
    """Wait for the device, then give the allocator's cached blocks back: what a worker does between
    rows, so the next row (or the next worker's warm-up) finds the memory free."""
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a failed call's error is already the caller's to report
            pass
        torch.cuda.empty_cache()
