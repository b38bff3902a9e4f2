"""Typed records of measured blocks, read back from the append-only samples.jsonl.

The worker appends one JSON object per line, flushed as it is taken:
  block_start {block, side, attempt, t, host, pid, gpu}         gpu: clocks/temperature/throttle
  sample      {block, side, attempt, shape, mode, i, ms}
  peak        {block, side, attempt, shape, mode, bytes}
  stage       {block, side, attempt, shape, mode, i, stage, ms}  device time of one stage, one call
  device      {block, side, attempt, shape, mode, i, ms}         summed device time of one profiled call
  kernels     {block, side, attempt, shape, mode, iters, kernels: {name: [total_ms, launches]}}
  failure     {block, side, attempt, shape, mode, error}             a training row's: shape=row, mode="train"
  train_step  {block, side, attempt, row, step, warmup, ms, loss, tokens}   one optimizer step of a
              training row (harness/training.py); warm-up steps are recorded but never timed data
  train_row   {block, side, attempt, row, tokens, first_loss, final_loss, peak_bytes, params, config}
  block_end   {block, side, attempt, t, status: ok|failed, error, gpu}
A block counts only through the attempt that wrote its block_end; lines of an attempt that died
stay in the file (nothing is deleted) but are never read as data, so a resumed run neither loses
nor duplicates a block.

The lockstep engine (harness/measure/) writes its own kinds (harness/measure/model.py) and, per
worker, the kinds above with `block` = the worker's id. `load_measurement` reads a samples.jsonl of
either engine into one `Measurement`: per-worker records as Blocks, and the timed rounds as
stats.Series per (shape, mode, basis). It is the one path by which measurements are read back.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

RowKey = tuple[str, str]  # (shape name, mode)


@dataclass
class Block:
    """One fresh-process block of the first engine, or one side worker of the lockstep engine
    (index = its worker id, `pair` its worker pair)."""

    index: int
    side: str
    attempt: str
    status: str = "running"  # ok | failed | running (no block_end: a crashed attempt)
    error: str | None = None
    t_start: str | None = None
    t_end: str | None = None
    host: str | None = None
    gpu_before: dict | None = None
    gpu_after: dict | None = None
    samples: dict[RowKey, list[float]] = field(default_factory=dict)
    stage_samples: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    device_samples: dict[RowKey, list[float]] = field(default_factory=dict)  # per profiled call
    peaks: dict[RowKey, int] = field(default_factory=dict)
    kernels: dict[RowKey, dict] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    provenance: dict | None = None  # where a package side's op was imported from, and its version
    train_ms: dict[str, list[float]] = field(default_factory=dict)  # row -> timed step times
    train_losses: dict[str, list[float]] = field(default_factory=dict)  # row -> loss of every step, warm-up first
    train_tokens: dict[str, int] = field(default_factory=dict)  # row -> tokens per step
    train_rows: dict[str, dict] = field(default_factory=dict)  # row -> its train_row record (row finished)
    pair: int | None = None  # the lockstep engine's worker pair (None: a block of the first engine)

    @property
    def complete(self) -> bool:
        return self.status in ("ok", "failed")

    def device_ms(self, row: RowKey) -> list[float]:
        """Summed device time of each profiled call of a row (kernels, copies, memsets). Records
        written before `device` lines existed give their kernel table's mean per call instead."""
        if self.device_samples.get(row):
            return list(self.device_samples[row])
        rec = self.kernels.get(row)
        if rec and rec.get("iters"):
            return [sum(float(ms) for ms, _ in (rec.get("kernels") or {}).values()) / int(rec["iters"])]
        return []


def read_jsonl(path: Path) -> list[dict]:
    """All whole lines of a JSONL file; a torn last line (a kill mid-write) is skipped."""
    if not path.exists():
        return []
    out = []
    with path.open() as f:
        for line in f:
            if not line.endswith("\n"):
                break  # torn tail
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def append_jsonl(path: Path, record: dict) -> None:
    """Append one record and flush it to disk before returning."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        # a kill mid-write can leave a torn line: start ours on a fresh line
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(record, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def load_blocks(samples_path: Path) -> list[Block]:
    """Every attempt's block, in file order; use `completed_blocks` for data."""
    return _blocks(read_jsonl(samples_path))


def _blocks(recs: list[dict]) -> list[Block]:
    attempts: dict[str, Block] = {}
    for rec in recs:
        kind = rec["type"]
        key = rec["attempt"]
        if kind == "worker_start":  # a lockstep worker: its records carry block = its id
            key = f"{rec['attempt']}/{rec['worker']}"
            attempts[key] = Block(index=rec["worker"], side=rec["side"], attempt=rec["attempt"], t_start=rec.get("t"),
                                  host=rec.get("host"), gpu_before=rec.get("gpu"), pair=rec.get("pair"),
                                  provenance=rec.get("provenance"))
            continue
        if "worker" in rec or (kind not in ("block_start", "block_end") and f"{key}/{rec.get('block')}" in attempts):
            key = f"{rec['attempt']}/{rec.get('worker', rec.get('block'))}"
        if kind == "worker_end":
            b = attempts.get(key)
            if b is not None:
                b.status = rec["status"]
                b.error = rec.get("error")
                b.t_end = rec.get("t")
                b.gpu_after = rec.get("gpu")
            continue
        if kind == "block_start":
            attempts[key] = Block(index=rec["block"], side=rec["side"], attempt=key, t_start=rec.get("t"),
                                  host=rec.get("host"), gpu_before=rec.get("gpu"))
            continue
        b = attempts.get(key)
        if b is None and kind == "block_end":  # a worker that died before it could open its block
            b = attempts[key] = Block(index=rec["block"], side=rec["side"], attempt=key)
        if b is None:
            continue
        row = (rec.get("shape"), rec.get("mode"))
        if kind == "sample":
            b.samples.setdefault(row, []).append(float(rec["ms"]))
        elif kind == "stage":
            b.stage_samples.setdefault((rec["shape"], rec["mode"], rec["stage"]), []).append(float(rec["ms"]))
        elif kind == "device":
            b.device_samples.setdefault(row, []).append(float(rec["ms"]))
        elif kind == "peak":
            b.peaks[row] = int(rec["bytes"])
        elif kind == "kernels":
            b.kernels[row] = {"iters": rec["iters"], "kernels": rec["kernels"]}
        elif kind == "train_step":
            name = rec["row"]
            b.train_losses.setdefault(name, []).append(float(rec["loss"]))
            b.train_tokens[name] = int(rec["tokens"])
            if not rec.get("warmup"):
                b.train_ms.setdefault(name, []).append(float(rec["ms"]))
        elif kind == "train_row":
            b.train_rows[rec["row"]] = {k: v for k, v in rec.items() if k not in ("type", "block", "side", "attempt")}
        elif kind == "provenance":
            b.provenance = {k: v for k, v in rec.items() if k not in ("type", "block", "side", "attempt")}
        elif kind == "failure":
            b.failures.append({k: rec.get(k) for k in ("shape", "mode", "error")})
        elif kind == "block_end":
            b.status = rec["status"]
            b.error = rec.get("error")
            b.t_end = rec.get("t")
            b.gpu_after = rec.get("gpu")
    return list(attempts.values())


def completed_blocks(samples_path: Path) -> list[Block]:
    """One Block per block index: the attempt that finished it, ordered by index."""
    return completed_blocks_of(read_jsonl(samples_path))


def run_is_aa(run_dir: Path) -> bool:
    """Whether the run in run_dir is an A/A run (`harness run --aa`: run.json "aa")."""
    try:
        return bool(json.loads((Path(run_dir) / "run.json").read_text()).get("aa"))
    except (OSError, ValueError):
        return False


def declared_side(side: str, aa: bool) -> str:
    """Whose declaration (env, op, package) a phase runs `side` with: its own, or the baseline's on
    both sides of an A/A run, which measures the baseline against itself."""
    return "baseline" if aa else side


@dataclass
class Measurement:
    """Everything measured in one run directory, from either engine (see the module docstring)."""

    engine: str  # lockstep | blocks | none
    workers: list[Block]  # lockstep: every worker; blocks: the completed blocks
    series: dict  # (shape, mode, basis) -> stats.Series of complete, unthrottled rounds
    excluded: dict = field(default_factory=dict)  # (shape, mode, basis) -> rounds left out (throttled)
    methods: dict = field(default_factory=dict)  # (shape, mode) -> the latest measure.model.RowMethod
    row_ends: dict = field(default_factory=dict)  # (shape, mode, basis) -> the latest measure.model.RowEnd
    throttled: list = field(default_factory=list)  # (shape, mode, basis, pair, round, why) of left-out rounds


def load_measurement(samples_path: Path) -> Measurement:
    """The one reader of a run's samples.jsonl, whichever engine wrote it."""
    from harness.measure import model
    from harness.stats import Round, Series

    recs = read_jsonl(Path(samples_path))
    if not any(r.get("type") == "measure_start" for r in recs):
        blocks = completed_blocks_of(recs)
        return Measurement("blocks" if blocks else "none", blocks, _block_series(blocks))
    workers = [b for b in _blocks(recs) if b.pair is not None]
    m = Measurement(model.ENGINE, workers, {})
    bursts: dict[tuple, dict[str, model.Burst]] = {}
    for d in recs:
        rec = model.parse(d)
        if isinstance(rec, model.Burst):
            bursts.setdefault((rec.attempt, rec.pair, rec.shape, rec.mode, rec.basis, rec.round), {})[rec.side] = rec
        elif isinstance(rec, model.RoundDone):
            sides = bursts.pop((rec.attempt, rec.pair, rec.shape, rec.mode, rec.basis, rec.round), {})
            key = (rec.shape, rec.mode, rec.basis)
            why = next((b.throttled for b in sides.values() if b.throttled), None)
            if why:
                m.excluded[key] = m.excluded.get(key, 0) + 1
                m.throttled.append((*key, rec.pair, rec.round, why))
                continue
            if "baseline" in sides and "candidate" in sides:
                m.series.setdefault(key, Series()).add(rec.pair, Round(
                    sides["baseline"].ms, sides["candidate"].ms, sides["control"].ms if "control" in sides else None))
        elif isinstance(rec, model.RowMethod):
            m.methods[(rec.shape, rec.mode)] = rec
        elif isinstance(rec, model.RowEnd):
            m.row_ends[(rec.shape, rec.mode, rec.basis)] = rec
    return m


def completed_blocks_of(recs: list[dict]) -> list[Block]:
    """The first engine's blocks: one per block index, the attempt that finished it, by index."""
    done: dict[int, Block] = {}
    for b in _blocks(recs):
        if b.complete and b.index not in done:
            done[b.index] = b
    return [done[i] for i in sorted(done)]


def _block_series(blocks: list[Block]) -> dict:
    """The first engine's ok blocks as one-round pairs (i-th baseline with i-th candidate block):
    the eager basis from their samples, the device basis from their profiled calls."""
    from harness.stats import Series

    ok = sorted((b for b in blocks if b.status == "ok"), key=lambda b: b.index)
    keys = {k for b in ok for k in (*b.samples, *b.device_samples, *b.kernels)}
    out = {}
    for key in keys:
        for basis, get in (("eager", lambda b, k: b.samples.get(k) or []), ("device", lambda b, k: b.device_ms(k))):
            per = {side: [list(get(b, key)) for b in ok if b.side == side and get(b, key)]
                   for side in ("baseline", "candidate")}
            series = Series.from_blocks(per["baseline"], per["candidate"])
            if series:
                out[(*key, basis)] = series
    return out
