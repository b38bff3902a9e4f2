"""A side worker: one long-lived process per side and worker pair, warmed once, timing bursts on command.

Started by the driver as `python -m harness.measure.worker JOB.json` with this checkout on PYTHONPATH
and the side's environment. As in every measured process of the harness, the harness (inputs,
timing, records) is imported first from this checkout; only then is the side's worktree put at the
front of sys.path and the op imported from it, so the op never comes from the other side and the
harness never from the worktree. The worker writes nothing to the run's records: it answers each
command on its channel, and the driver, the run's only writer, records the answer.

Commands (one JSON object each; every reply has "ok", and "error"/"trace" when not ok):
    prepare      {shape, mode, graph}  build the row's inputs, warm it (compile, autotune; on a CPU only
                                       as many calls as declared), capture it as a CUDA graph when asked
                                       and possible -> {graph, graph_reason, warm_s, memory, configs}
    burst        {shape, mode, basis, calls}  time `calls` calls -> {ms, enqueue_us, retimed, late, gpu}
    release      {shape, mode, what}   free the row's graph ("graph") or all its state ("all")
    extras       {shape, mode, peak, stage_iters}  peak allocation of one eager call and `stage_iters`
                                       profiled calls -> {peak_bytes, calls: [[name, ms, stage], ...]}
    train_prepare {row}                build a training row and run its warm-up steps -> {steps: [[ms, loss]], memory,
                                       configs}
    train_burst  {name, steps}         `steps` timed optimizer steps -> {ms, losses, gpu}
    train_end    {name}                -> the row's summary (first/final loss, peak bytes, params)
    exit
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from harness.measure.call import (DTYPES, Call, check_finite, free_cuda, load_inputs, load_op, peak_bytes,
                                   warmup_calls)
from harness.measure.detail.autotune import NewChoices
from harness.measure.detail.channel import Channel, ChannelClosed
from harness.measure.detail.telemetry import Telemetry
from harness.measure.detail.timing import L2Flush, capture, time_burst
from harness.measure.model import WorkerJob
from harness.device import gpu_snapshot
from harness.kernel_profile import profile_calls


class RowState:
    def __init__(self, call: Call, checked: bool):
        self.call = call
        self.graph = None
        self.checked = checked  # whether a call's outputs passed check_finite (the first burst's, without warm-up)


def _die_with_parent() -> None:
    """Ask Linux to end this process when the driver ends, however it ends (a kill -9 included)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the closed channel still ends the loop
        pass


def _start_memory_watch() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _memory() -> dict | None:
    """What the driver needs to decide how many workers can hold a row at once (driver.py:
    pairs_that_fit): this process's peak reserved bytes since _start_memory_watch, what it holds now,
    and the device's free and total bytes (every process's use counted). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"peak_reserved": int(torch.cuda.max_memory_reserved()), "reserved": int(torch.cuda.memory_reserved()),
            "free": int(free), "total": int(total)}


class SideWorker:
    def __init__(self, job: WorkerJob):
        self.job = job
        self.make_inputs = load_inputs(job.inputs_file, job.inputs_fn)
        self.op = load_op(job.worktree, job.op, job.package)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            # one thread: the workers of a CPU run take turns on a shared machine, and all get the same
            torch.set_num_threads(int(os.environ.get("HARNESS_CPU_THREADS", "1")))
        self.dtype = DTYPES[job.dtype]
        self.flush = L2Flush(job.l2_flush)
        self.telemetry = Telemetry()
        self.rows: dict[tuple[str, str], RowState] = {}
        self.training: dict = {}
        self.new_configs = NewChoices()  # the autotune choices a prepare reports: those it made

    def hello(self) -> dict:
        provenance = None
        if self.job.package:
            import importlib

            module = importlib.import_module(self.job.op.split(":")[0])
            provenance = {"module_file": str(Path(module.__file__).resolve()), "package": self.job.package}
        return {"pid": os.getpid(), "host": socket.gethostname(), "gpu": gpu_snapshot(), "provenance": provenance}

    # --- operator rows ---------------------------------------------------------------------------
    def prepare(self, shape: dict, mode: str, graph: bool) -> dict:
        key = (shape["name"], mode)
        # a worker holds one row at a time: whatever an earlier row left (a row this pair could not
        # finish preparing is never released by name) goes before this one takes memory
        self.rows.clear()
        free_cuda()
        _start_memory_watch()
        t0 = time.perf_counter()
        inputs = self.make_inputs(shape, mode, self.dtype, self.device, self.job.seed)
        call = Call(self.op, inputs, mode, self.job.seed)
        outs = None
        warm = warmup_calls(self.job.warmup)
        for _ in range(warm):
            outs = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if warm:
            check_finite(outs)
        outs = None
        state = self.rows[key] = RowState(call, checked=warm > 0)
        reason = "not asked (measure.graph: false)" if not graph else None
        if graph:
            state.graph, reason = capture(call)
            free_cuda()  # the eager warm-up's cached blocks go back before the next worker warms
        return {"graph": state.graph is not None, "graph_reason": reason, "warm_s": time.perf_counter() - t0,
                "memory": _memory(), "configs": self.new_configs()}

    def burst(self, shape: str, mode: str, basis: str, calls: int) -> dict:
        state = self.rows[(shape, mode)]
        fn = state.graph if basis == "graph" else state.call
        if fn is None:
            raise RuntimeError(f"row {shape}/{mode} has no graph on this worker")
        hold = basis == "graph"  # device time only; eager keeps the host's launch time in (module doc of timing)
        if state.checked:
            times = time_burst(fn, calls, self.flush, hold)
        else:
            # no warm-up call ran (a CPU profile's warmup: 0): the first timed call's outputs are kept
            # for the finite check after the burst; failing it makes the burst an error, never data
            kept: list = []
            times = time_burst(lambda: fn() if kept else kept.append(fn()), calls, self.flush, hold)
            check_finite(kept[0])
            state.checked = True
        return {"ms": times.ms, "enqueue_us": times.enqueue_us, "retimed": times.retimed, "late": times.late,
                "gpu": self.telemetry.read()}

    def release(self, shape: str, mode: str, what: str) -> dict:
        state = self.rows.get((shape, mode))
        if state is not None:
            if what == "graph":
                state.graph = None
            else:
                del self.rows[(shape, mode)]
            state = None
            free_cuda()
        return {}

    def extras(self, shape: str, mode: str, peak: bool, stage_iters: int) -> dict:
        call = self.rows[(shape, mode)].call
        out: dict = {"peak_bytes": peak_bytes(call) if peak else None, "calls": []}
        if stage_iters > 0:
            calls = profile_calls(call, stage_iters, self.job.stage_patterns, before=self.flush)
            out["calls"] = [[[name, ms, stage] for name, ms, stage in kernels] for kernels in calls]
        return out

    # --- training rows ---------------------------------------------------------------------------
    def train_prepare(self, row: dict) -> dict:
        from harness.training import TrainingRun

        self.training.pop(row["name"], None)
        free_cuda()
        _start_memory_watch()
        run = TrainingRun(row, self.op, self.device)
        steps = [list(run.step(warmup=True)) for _ in range(int(row["warmup_steps"]))]
        memory = _memory()  # before reset_peak: the warm-up steps' peak is the row's footprint
        run.reset_peak()
        self.training[row["name"]] = run
        return {"steps": steps, "memory": memory, "configs": self.new_configs()}

    def train_burst(self, name: str, steps: int) -> dict:
        run = self.training[name]
        out = [run.step() for _ in range(steps)]
        return {"ms": [ms for ms, _ in out], "losses": [loss for _, loss in out], "gpu": self.telemetry.read()}

    def train_end(self, name: str) -> dict:
        run = self.training.pop(name)
        summary = run.summary()
        run = None
        free_cuda()
        return summary

    def handle(self, msg: dict) -> dict:
        cmd = msg["cmd"]
        if cmd == "prepare":
            return self.prepare(msg["shape"], msg["mode"], bool(msg.get("graph")))
        if cmd == "burst":
            return self.burst(msg["shape"], msg["mode"], msg["basis"], int(msg["calls"]))
        if cmd == "release":
            return self.release(msg["shape"], msg["mode"], msg.get("what", "all"))
        if cmd == "extras":
            return self.extras(msg["shape"], msg["mode"], bool(msg.get("peak")), int(msg.get("stage_iters", 0)))
        if cmd == "train_prepare":
            return self.train_prepare(msg["row"])
        if cmd == "train_burst":
            return self.train_burst(msg["name"], int(msg["steps"]))
        if cmd == "train_end":
            return self.train_end(msg["name"])
        raise ValueError(f"unknown command {cmd!r}")


def serve(job: WorkerJob) -> int:
    _die_with_parent()
    channel = Channel(*job.channel)
    try:
        worker = SideWorker(job)
        channel.send({"ok": True, **worker.hello()})
    except Exception as e:  # noqa: BLE001 - the driver records why this worker never started
        traceback.print_exc()
        channel.send({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=8)})
        return 1
    while True:
        try:
            msg = channel.recv()
        except ChannelClosed:
            return 0  # the driver is gone
        if msg.get("cmd") == "exit":
            channel.send({"ok": True, "gpu": gpu_snapshot()})
            return 0
        try:
            reply = {"ok": True, **worker.handle(msg)}
        except Exception as e:  # noqa: BLE001 - a row's failure is the driver's to record; the worker goes on
            traceback.print_exc()
            free_cuda()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=8)}
        try:
            channel.send(reply)
        except ChannelClosed:
            return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return serve(WorkerJob.from_json(json.loads(Path(argv[0]).read_text())))


if __name__ == "__main__":
    raise SystemExit(main())
