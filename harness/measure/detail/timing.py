"""Timing one burst of calls, eagerly or as CUDA-graph replays, with the L2 flushed before each call.

Both methods time every call with a pair of CUDA events around it and wait for its end before the
next (perf_counter around a synchronised call on a CPU): each call starts from an idle device with
a cold L2, as the first engine did. Eager includes the host's launch time wherever the device waits
for it (that is real for users, and noisy: on the H200 a launch-bound row's eager medians moved up to
38% between processes). Graph replay is one launch, and it is preceded by a hold: a kernel that
spins on the device for HOLD_CYCLES while the host enqueues the flush, the start event and the
replay, so the device never waits for the host between the start event and the graph's first
kernel and the graph basis is device time only (nvbench's blocking kernel does the same; without
it a slow host enqueue in one process reads as that process's kernels being slower). Every burst
also reports how long the host took to enqueue its slowest call. A hold can still be too short: the
host is descheduled for a millisecond now and then (on the H200, one replay of a 0.21 ms graph read
2.8 ms after a 3.3 ms enqueue). So each replay is checked: an event before the hold says when the
device reached the start event, and a replay the host finished enqueueing later than that may have
been waited for inside the timing; such a call is timed again, up to RETIMES times, and counted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch


class L2Flush:
    """Writes twice the L2's size before each timed call, so no call finds the last one's data."""

    def __init__(self, enabled: bool):
        self.buf = None
        if enabled and torch.cuda.is_available():
            l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 * 2**20
            self.buf = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


# ~0.2 ms at the H200's 1980 MHz boost, ~0.3 ms power-capped at 1300 MHz. The host's whole enqueue
# (hold, flush, events, replay) measured median 233 us, p99 768 us there (docs/perf/measurement.md):
# longer than the hold now and then, which the check of each replay catches (module docstring)
HOLD_CYCLES = 400_000
# a late replay is timed again at most this often; still late, the burst says so and its round is
# left out (driver.py), as a throttled one is
RETIMES = 3


@dataclass
class BurstTimes:
    ms: list[float]  # each call's time, in the order called
    enqueue_us: float | None  # the host's slowest enqueue of one call; None on a CPU (nothing is enqueued)
    retimed: int = 0  # calls timed again because the host enqueued their replay after the hold ran out
    late: int = 0  # calls still late after RETIMES more tries (their times are kept, flagged)


def _held_call(fn: Callable[[], object], flush: L2Flush) -> tuple[float, float, bool]:
    """One replay behind the hold: (ms, host enqueue us, late). Late: the host returned from enqueueing
    the replay after the device, having run the hold and the flush, had reached the start event (the
    `held` event is reached as soon as it is enqueued: the device is idle, the last call was waited for)."""
    held, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter()
    held.record()
    torch.cuda._sleep(HOLD_CYCLES)
    flush()
    start.record()
    fn()
    replay_enqueued_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    enqueue_us = (time.perf_counter() - t0) * 1e6
    end.synchronize()
    return start.elapsed_time(end), enqueue_us, replay_enqueued_ms >= held.elapsed_time(start)


def retimed_burst(held_call: Callable[[], tuple[float, float, bool]], calls: int) -> BurstTimes:
    """`calls` calls of held_call (-> ms, enqueue us, late), each late one timed again up to RETIMES times."""
    times = BurstTimes([], 0.0)
    for _ in range(calls):
        for attempt in range(RETIMES + 1):
            ms, enqueue_us, late = held_call()
            times.enqueue_us = max(times.enqueue_us, enqueue_us)
            if not late:
                break
            if attempt < RETIMES:
                times.retimed += 1
            else:
                times.late += 1
        times.ms.append(ms)
    return times


def time_burst(fn: Callable[[], object], calls: int, flush: L2Flush, hold: bool = False) -> BurstTimes:
    """Each of `calls` calls of fn timed with the L2 flushed before it; with `hold` (graph replays) the
    device spins for HOLD_CYCLES first and a late replay is timed again (see the module's docstring)."""
    if not torch.cuda.is_available():
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return BurstTimes(out, None)
    if hold:
        return retimed_burst(lambda: _held_call(fn, flush), calls)
    enqueue = 0.0
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        t0 = time.perf_counter()
        flush()
        start.record()
        fn()
        end.record()
        enqueue = max(enqueue, (time.perf_counter() - t0) * 1e6)
        end.synchronize()
    return BurstTimes([start.elapsed_time(end) for start, end in events], enqueue)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def host_sync_problem(call: Callable[[], object]) -> str | None:
    """Why the call cannot be captured because it waits for the device on the host (e.g. reading
    cu_seqlens back with .tolist()), found by running it once with torch's sync debug mode set to
    raise; None when it ran without one. A sync inside a capture would invalidate it."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError as e:
        return f"the call synchronises with the host ({_first_line(e)})"
    finally:
        # off before anything of ours waits for the device: the mode counts our own syncs too
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return None


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    den = float(torch.linalg.vector_norm(b))
    return float(torch.linalg.vector_norm(a - b)) / (den if den > 0 else 1.0)


class GraphCall:
    """A call captured once as a CUDA graph; calling it replays the graph (the inputs are the call's
    own tensors, so every replay recomputes the same outputs from them)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: list[torch.Tensor]):
        self.graph, self.outputs = graph, outputs

    def __call__(self) -> None:
        self.graph.replay()


REPLAY_REL_L2 = 1e-3  # replay vs eager outputs: same kernels on the same inputs (atomics may reorder sums)


def capture(call: Callable[[], list[torch.Tensor]], side_stream_warmups: int = 2) -> tuple[GraphCall | None, str | None]:
    """(graph, None), or (None, why the call cannot be captured). The call must be warm (compiled and
    autotuned: nothing may be benchmarked inside a capture). The replay's outputs are checked against
    an eager call's: a graph that bakes in host-side state would time something else."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    why = host_sync_problem(call)
    if why:
        return None, why
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            for _ in range(side_stream_warmups):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = call()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any capture failure means eager timing, with its reason
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None, f"capture failed ({_first_line(e)})"
    reference = call()
    torch.cuda.synchronize()
    worst = max((_rel_l2(o, r) for o, r in zip(outputs, reference) if o.is_floating_point()), default=0.0)
    if len(outputs) != len(reference) or not worst <= REPLAY_REL_L2:
        return None, f"the graph's replay differs from an eager call (relative L2 {worst:.3g} > {REPLAY_REL_L2})"
    return GraphCall(graph, outputs), None
