"""Which kernels one call launched, how long each ran, and which stage each belongs to.

Shared by the block worker (stage times per block) and the profile worker (the Amdahl pre-gate),
so both count kernels the same way:
  GPU  every device event torch.profiler reports for the CUDA device (kernels, memcpy, memset),
       except the GPU projections of record_function ranges (`is_user_annotation`), which would
       count their kernels twice. A kernel's names are its own name, then the names of the ranges
       whose GPU projection contains it, innermost first.
  CPU  every synchronous CPU op or record_function range, timed by its SELF time so nested ranges
       never count twice. (Triton kernels under TRITON_INTERPRET=1 are invisible on CPU.)
The stage is decided by the innermost name that matches any stage pattern (re.search); when that
one name matches two stages, that is an error naming both. Unmatched kernels are unassigned.
"""
from __future__ import annotations

import re


def stage_matches(name: str, patterns: list[str]) -> bool:
    """Whether one stage's patterns match a kernel or range name: the one matching rule (re.search)
    that the profile, the block worker, the load-time overlap check and the ncu stage sums share."""
    return any(re.search(p, name) for p in patterns)


def assign_stages(kernels: dict[str, float], patterns: dict[str, list[str]]) -> dict[str, float]:
    """Sum kernel times into stages by regex (a kernel counts in every stage it matches)."""
    return {stage: sum(ms for name, ms in kernels.items() if stage_matches(name, pats))
            for stage, pats in patterns.items()}


class OverlapError(Exception):
    """One kernel (or range) name matches the patterns of two stages."""

    def __init__(self, name: str, stages: list[str]):
        self.name, self.stages = name, stages
        super().__init__(f"kernel {name!r} matches stages {' and '.join(repr(s) for s in stages)}")


def matching_stages(name: str, patterns: dict[str, list[str]]) -> list[str]:
    """Stages whose patterns match `name`, with the same matching rule as the block worker."""
    return [stage for stage, pats in patterns.items() if stage_matches(name, pats)]


def attribute(names: list[str], patterns: dict[str, list[str]]) -> str | None:
    """The stage of a kernel whose names (own name first, then enclosing ranges, innermost first)
    are `names`: the first name that matches any stage decides; two stages on that name is an error."""
    for name in names:
        hits = matching_stages(name, patterns)
        if len(hits) > 1:
            raise OverlapError(name, hits)
        if hits:
            return hits[0]
    return None


def kernel_events(events, cuda: bool) -> list[tuple[str, float, list[str]]]:
    """(name, ms, names innermost first) of each kernel of one profiled call."""
    import torch  # here, not at import: harness.spec reads this module's matching rule without torch

    DT = torch.autograd.DeviceType
    out = []
    if cuda:
        dev = [e for e in events if e.device_type == DT.CUDA]
        ranges = [e for e in dev if e.is_user_annotation]
        for e in dev:
            if e.is_user_annotation:
                continue
            tr = e.time_range
            enclosing = [r for r in ranges if r.time_range.start <= tr.start and tr.end <= r.time_range.end
                         and r.device_index == e.device_index]
            enclosing.sort(key=lambda r: r.time_range.end - r.time_range.start)  # innermost first
            out.append((e.name, tr.elapsed_us() / 1e3, [e.name, *(r.name for r in enclosing)]))
        return out
    for e in events:
        if e.device_type != DT.CPU or e.is_async:
            continue
        names, p = [e.name], e.cpu_parent
        while p is not None:
            names.append(p.name)
            p = p.cpu_parent
        out.append((e.name, e.self_cpu_time_total / 1e3, names))
    return out


def profile_calls(fn, iters: int, patterns: dict[str, list[str]], before=None) -> list[list[tuple[str, float, str | None]]]:
    """For each of `iters` profiled calls: [(kernel name, ms, stage or None)] (raises OverlapError)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    calls = []
    for _ in range(iters):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        calls.append([(name, ms, attribute(names, patterns)) for name, ms, names in kernel_events(prof.events(), cuda)])
    return calls


