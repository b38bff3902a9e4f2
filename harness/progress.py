"""Progress of `harness run`: what the pipeline reports while it works, and two ways to show it.

The pipeline (harness/run.py, harness/measure/blocks.py) reports events to a `Progress`:
    phase(name)                                   a phase begins: resolve, verify, profile, bench, ncu, report
    message(text)                                 a free-form line (a Progress is also a `log` callable)
    bench_plan(total, done)                       the bench phase: its block count and the blocks already
                                                  complete (a resumed run), whose samples seed the medians
    block_started(index, total, side, sha, rows)  a worker process starts block `index` (0-based)
    row_progress(shape, mode, done, total)        samples of one (shape, mode) so far in the running block,
                                                  read by tailing samples.jsonl (blocks.SamplesTail)
    block_finished(block)                         the block's record (harness.records.Block)
    close()                                       the run is over (always called, also on an error)

`RichProgress` is a live display for an interactive terminal: phase, block i/N with its side, per
(shape, mode) bars within the block, elapsed time, an estimate of the time left (the mean duration of
the blocks finished by this process times the blocks still to run) and a compact table of medians so
far. `QuietProgress` writes plain, deterministic lines (no ANSI escapes, no carriage returns) for CI
and Slurm logs; `make_progress` picks it when stdout is not a terminal, for `harness run --quiet`, or
when HARNESS_QUIET=1.
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time
from typing import Callable, TextIO

from harness.records import Block

SIDES = ("baseline", "candidate")
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b.?")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # every C0 control but \t and \n, and DEL


def plain(text: str) -> str:
    """`text` without ANSI escape sequences or control characters (\\r included); \\n and \\t stay."""
    return _CONTROL.sub("", _ANSI.sub("", str(text)))


def first_line(error: str | None, limit: int = 200) -> str:
    lines = (error or "").strip().splitlines()
    return lines[0][:limit] if lines else "no error recorded"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        m, s = divmod(int(round(seconds)), 60)
        return f"{m}m{s:02d}s"
    h, rest = divmod(int(round(seconds)), 3600)
    return f"{h}h{rest // 60:02d}m"


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.0f}" if ms >= 1e4 else f"{ms:.4g}"


def quiet_requested(flag: bool = False, env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    return flag or env.get("HARNESS_QUIET", "").strip().lower() in ("1", "true", "yes", "on")


def make_progress(quiet: bool = False, stream: TextIO | None = None) -> "Progress":
    """Quiet lines when asked (`quiet`, HARNESS_QUIET=1) or when `stream` is not a terminal; else live."""
    stream = stream or sys.stdout
    isatty = getattr(stream, "isatty", lambda: False)
    if quiet_requested(quiet) or not isatty():
        return QuietProgress(stream=stream)
    return RichProgress(stream=stream)


def as_progress(log: "Progress | Callable[[str], None] | None") -> "Progress":
    """A Progress for run_experiment: itself, or quiet lines through a plain `log` callable."""
    if isinstance(log, Progress):
        return log
    return QuietProgress(write=log or print)


class Progress:
    """The interface, with the bookkeeping both displays share: elapsed time, block durations and
    the ETA, and the samples of finished blocks per (shape, mode) per side for the medians."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.t0 = clock()
        self.current_phase: str | None = None
        self.total_blocks = 0
        self.pending = 0  # blocks this process still has to run, the running one included
        self.durations: list[float] = []  # seconds of each block finished by this process
        self.block: dict | None = None  # the running block: index, total, side, sha, t0, rows
        self.samples: dict[tuple[str, str], dict[str, list[float]]] = {}  # (shape, mode) -> side -> ms
        self.measure: dict | None = None  # the lockstep engine's rows: plan, the row in rounds, rows finished
        self.lock = threading.RLock()

    # --- events -------------------------------------------------------------------------------------
    def __call__(self, text: str) -> None:  # a Progress stands in for a `log` callable
        self.message(text)

    def phase(self, name: str) -> None:
        with self.lock:
            self.current_phase = name

    def message(self, text: str) -> None:
        pass

    def bench_plan(self, total: int, done: list[Block] = ()) -> None:
        with self.lock:
            self.total_blocks = total
            self.pending = total - len(done)
            for b in done:
                self._add_samples(b)

    def block_started(self, index: int, total: int, side: str, sha: str,
                      rows: list[tuple[str, str, int]] = ()) -> None:
        """`rows`: (shape, mode, samples expected) of the block, in the order the worker takes them."""
        with self.lock:
            self.total_blocks = total
            self.block = {"index": index, "total": total, "side": side, "sha": sha, "t0": self.clock(),
                          "rows": {(s, m): [0, n] for s, m, n in rows}}

    def row_progress(self, shape: str, mode: str, done: int, total: int) -> None:
        with self.lock:
            if self.block is not None:
                self.block["rows"][(shape, mode)] = [done, total]

    def block_finished(self, block: Block) -> float | None:
        """Record the block; returns its duration in seconds (None when no block_started preceded it)."""
        with self.lock:
            seconds = None
            if self.block is not None and self.block["index"] == block.index:
                seconds = self.clock() - self.block["t0"]
                self.durations.append(seconds)
                self.pending = max(0, self.pending - 1)
            self.block = None
            self._add_samples(block)
            return seconds

    # the lockstep engine (harness/measure/driver.py): rows measured in rounds by worker pairs
    def measure_plan(self, rows: list[str], pairs: int, workers_per_pair: int) -> None:
        with self.lock:
            self.measure = {"rows": list(rows), "pairs": pairs, "per_pair": workers_per_pair, "current": None,
                            "finished": []}

    def row_started(self, row: str, basis: str, pairs: int) -> None:
        with self.lock:
            if self.measure is not None:
                self.measure["current"] = {"row": row, "basis": basis, "pairs": pairs, "done": 0, "target": 0,
                                           "t0": self.clock()}

    def rounds_progress(self, row: str, basis: str, done: int, target: int, pairs: int) -> None:
        with self.lock:
            cur = (self.measure or {}).get("current")
            if cur is not None:
                cur.update(done=done, target=target, pairs=pairs)

    def row_finished(self, row: str, basis: str, reason: str, detail: str, point, lo, hi) -> None:
        with self.lock:
            if self.measure is not None:
                self.measure["current"] = None
                self.measure["finished"].append((row, basis, reason, point, lo, hi))

    def close(self) -> None:
        pass

    # --- derived ------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def eta(self) -> float | None:
        """Seconds left in the bench phase: the mean duration of the blocks this process finished
        times the blocks still pending, less the time the running block has already taken.
        None until a block has finished."""
        with self.lock:
            if not self.durations:
                return None
            mean = sum(self.durations) / len(self.durations)
            left = mean * self.pending
            if self.block is not None:
                left -= min(mean, self.clock() - self.block["t0"])
            return max(0.0, left)

    def _add_samples(self, block: Block) -> None:
        if block.status != "ok":
            return
        for (shape, mode), ms in block.samples.items():
            self.samples.setdefault((shape, mode), {}).setdefault(block.side, []).extend(ms)
        for row, ms in block.train_ms.items():
            self.samples.setdefault((row, "train"), {}).setdefault(block.side, []).extend(ms)

    def median_rows(self) -> list[tuple[str, str, float | None, float | None, float | None]]:
        """(shape, mode, baseline median ms, candidate median ms, baseline/candidate) per row so far:
        the median of the pooled samples of every finished block of that side."""
        out = []
        with self.lock:
            for (shape, mode), by_side in self.samples.items():
                b, c = (statistics.median(by_side[s]) if by_side.get(s) else None for s in SIDES)
                out.append((shape, mode, b, c, b / c if b and c else None))
        return out


class QuietProgress(Progress):
    """Plain lines, one per event worth a log line; nothing is ever redrawn."""

    def __init__(self, stream: TextIO | None = None, write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(clock)
        self.stream = stream
        self._write = write
        self._closed = False

    def emit(self, text: str) -> None:
        text = plain(text)
        if self._write is not None:
            self._write(text)
        else:
            stream = self.stream or sys.stdout
            stream.write(text + "\n")
            stream.flush()

    def phase(self, name: str) -> None:
        super().phase(name)
        self.emit(f"[phase] {name} (at {fmt_duration(self.elapsed())})")

    def message(self, text: str) -> None:
        self.emit(text)

    def bench_plan(self, total: int, done: list[Block] = ()) -> None:
        super().bench_plan(total, done)
        self.emit(f"[bench] {total} blocks, {len(done)} already complete, {self.pending} to run")

    def _tag(self, index: int, total: int) -> str:
        return f"[block {index + 1}/{total}]"

    def block_started(self, index, total, side, sha, rows=()) -> None:
        super().block_started(index, total, side, sha, rows)
        self.emit(f"{self._tag(index, total)} {side} {sha}: started")

    def row_progress(self, shape, mode, done, total) -> None:
        with self.lock:
            before = (self.block or {}).get("rows", {}).get((shape, mode), [0, total])[0]
            super().row_progress(shape, mode, done, total)
            b = self.block
        if b is not None and done >= total > before:  # one line per row, when its samples are all in
            self.emit(f"{self._tag(b['index'], b['total'])} {shape}/{mode}: {done}/{total} samples")

    def block_finished(self, block: Block) -> float | None:
        with self.lock:
            b = self.block
            seconds = super().block_finished(block)
            eta = self.eta()
        total = b["total"] if b else self.total_blocks
        sha = f" {b['sha']}" if b else ""
        took = fmt_duration(seconds) if seconds is not None else "done"
        status = "" if block.status == "ok" else f" FAILED ({first_line(block.error)})"
        self.emit(f"{self._tag(block.index, total)} {block.side}{sha}: {took}{status}"
                  f" (eta {fmt_duration(eta) if eta is not None else '?'}, {self.pending} to go)")
        return seconds

    def measure_plan(self, rows, pairs, workers_per_pair) -> None:
        super().measure_plan(rows, pairs, workers_per_pair)
        self.emit(f"[measure] {len(rows)} rows, {pairs} worker pairs of {workers_per_pair} processes to start with")

    def row_started(self, row, basis, pairs) -> None:
        super().row_started(row, basis, pairs)
        self.emit(f"[row] {row} {basis}: rounds with {pairs} pairs")

    def row_finished(self, row, basis, reason, detail, point, lo, hi) -> None:
        super().row_finished(row, basis, reason, detail, point, lo, hi)
        self.emit(f"[row] {row} {basis}: {fmt_speedup(point, lo, hi)}; {reason}: {detail} "
                  f"(at {fmt_duration(self.elapsed())})")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rows = self.median_rows()
        if rows:
            self.emit("medians so far (ms; pooled samples of finished blocks):")
            for line in medians_lines(rows):
                self.emit(line)
        self.emit(f"[end] elapsed {fmt_duration(self.elapsed())}")


def fmt_speedup(point, lo, hi) -> str:
    if point is None:
        return "no speedup"
    return f"speedup {point:.4f}x" + (f" [{lo:.4f}, {hi:.4f}]" if lo is not None and hi is not None else " (no interval)")


def medians_lines(rows) -> list[str]:
    """A plain, aligned text table of `Progress.median_rows()`."""
    table = [("shape", "mode", "baseline", "candidate", "base/cand")]
    table += [(s, m, fmt_ms(b), fmt_ms(c), f"{r:.3f}x" if r is not None else "-") for s, m, b, c, r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    return ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
            for r in table]


class RichProgress(Progress):
    """A live display (rich.live) for an interactive terminal; messages scroll above it."""

    def __init__(self, stream: TextIO | None = None, console=None, clock: Callable[[], float] = time.monotonic,
                 auto_refresh: bool = True):
        from rich.console import Console
        from rich.live import Live

        super().__init__(clock)
        self.console = console or Console(file=stream or sys.stdout)
        self.live = Live(console=self.console, get_renderable=self.render, auto_refresh=auto_refresh,
                         refresh_per_second=4, transient=False, redirect_stdout=True, redirect_stderr=True)
        self.live.start()
        self._closed = False

    def _refresh(self) -> None:
        if not self._closed:
            self.live.refresh()

    def phase(self, name: str) -> None:
        super().phase(name)
        self._refresh()

    def message(self, text: str) -> None:
        self.console.print(str(text), markup=False, highlight=False)

    def bench_plan(self, total, done=()) -> None:
        super().bench_plan(total, done)
        self._refresh()

    def block_started(self, index, total, side, sha, rows=()) -> None:
        super().block_started(index, total, side, sha, rows)
        self._refresh()

    def measure_plan(self, rows, pairs, workers_per_pair) -> None:
        super().measure_plan(rows, pairs, workers_per_pair)
        self._refresh()

    def row_started(self, row, basis, pairs) -> None:
        super().row_started(row, basis, pairs)
        self._refresh()

    def rounds_progress(self, row, basis, done, target, pairs) -> None:
        super().rounds_progress(row, basis, done, target, pairs)
        self._refresh()

    def row_finished(self, row, basis, reason, detail, point, lo, hi) -> None:
        super().row_finished(row, basis, reason, detail, point, lo, hi)
        self.console.print(f"{row} {basis}: {fmt_speedup(point, lo, hi)} ({reason}: {detail})",
                           markup=False, highlight=False)
        self._refresh()

    def block_finished(self, block: Block) -> float | None:
        seconds = super().block_finished(block)
        if block.status != "ok":
            self.console.print(f"block {block.index + 1} {block.side} failed: {first_line(block.error)}",
                               style="red", markup=False, highlight=False)
        self._refresh()
        return seconds

    def render(self):
        from rich import box
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self.lock:
            eta = self.eta()
            head = Text.assemble(("harness run ", "bold"), (self.current_phase or "starting", "bold cyan"),
                                 f"  elapsed {fmt_duration(self.elapsed())}")
            if self.total_blocks:
                done = self.total_blocks - self.pending
                head.append(f"  blocks {done}/{self.total_blocks}")
                head.append(f"  eta {fmt_duration(eta)}" if eta is not None else "  eta ?")
            parts = [head]
            b = self.block
            if b is not None:
                parts.append(Text.assemble(f"block {b['index'] + 1}/{b['total']} ",
                                           (b["side"], "green" if b["side"] == "baseline" else "magenta"),
                                           f" {b['sha']}  {fmt_duration(self.clock() - b['t0'])}"))
                grid = Table.grid(padding=(0, 1))
                for (shape, mode), (n, total) in b["rows"].items():
                    grid.add_row(f"  {shape}/{mode}", ProgressBar(total=max(total, 1), completed=n, width=30),
                                 f"{n}/{total}")
                if b["rows"]:
                    parts.append(grid)
            m = self.measure
            cur = m.get("current") if m else None
            if cur is not None:
                parts.append(Text.assemble(f"row {len(m['finished']) + 1}: ", (cur["row"], "bold"),
                                           f" {cur['basis']}  {cur['pairs']} pairs  "
                                           f"rounds {cur['done']}/{cur['target']}  "
                                           f"{fmt_duration(self.clock() - cur['t0'])}"))
            rows = self.median_rows()
        if rows:
            t = Table(box=box.SIMPLE_HEAD, title="medians so far (ms)", title_justify="left", show_edge=False)
            for col in ("shape", "mode", "baseline", "candidate", "base/cand"):
                t.add_column(col, justify="left" if col in ("shape", "mode") else "right")
            for s, m, bm, cm, r in rows:
                t.add_row(s, m, fmt_ms(bm), fmt_ms(cm), f"{r:.3f}x" if r is not None else "-")
            parts.append(t)
        return Group(*parts)

    def close(self) -> None:
        if self._closed:
            return
        with self.lock:
            self.block = None
            self.current_phase = "done"
        self.live.refresh()
        self._closed = True
        self.live.stop()
