"""Named stage ranges: one NVTX range (for Nsight tools on the GPU) and one profiler range (so
torch.profiler sees the stage on CPU too, where Triton kernels under the interpreter are
invisible) per stage, opened on the thread that launches the stage's kernels."""
from __future__ import annotations

import contextlib

import torch

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a declared dependency; without it (a bare GPU image) only the profiler range
    _nvtx = None


@contextlib.contextmanager
def stage_range(name: str):
    """`with stage_range("pkda.bwd.dAv"): ...` -- near-free when no profiler or tool listens."""
    with contextlib.ExitStack() as stack:
        if _nvtx is not None:
            stack.enter_context(_nvtx.annotate(name))
        stack.enter_context(torch.profiler.record_function(name))
        yield
