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

Damage. Every record is one JSON object on one line, appended with one write and fsynced. A kill
mid-write leaves a prefix of a line; a prefix of a JSON object is never a JSON object (its closing
brace is its last byte), and the next append starts on a fresh line, so no append can glue onto a
torn line to make a valid-looking record. Readers check every line against RECORD_TYPES (one
pydantic model per record type, fields the readers rely on); a torn, undecodable, non-JSON or
invalid line is quarantined (skipped, left in the file, and described by a `Damage` the report
shows) instead of stopping the read. A block whose block_end is damaged is incomplete, so a resume
re-runs it: a resume always starts from the last good record. Types missing from RECORD_TYPES pass
unchecked and readers ignore the types they do not know.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

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


# --- what a valid record is: one model per record type -----------------------------------------
# Add a type by adding its model to RECORD_TYPES; list only fields some reader relies on (extra
# fields always pass). Strict: no string is read as a number, no bool as an int.

Ms = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]  # a measured duration
Index = Annotated[int, Field(strict=True, ge=0)]  # a block, sample or step number; a byte count
Name = Annotated[str, Field(strict=True, min_length=1)]


class Record(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Name


class BlockRecord(Record):
    block: Index
    side: Name
    attempt: Name


class RowRecord(BlockRecord):
    shape: Name
    mode: Name


class SampleRecord(RowRecord):
    i: Index
    ms: Ms


class PeakRecord(RowRecord):
    bytes: Index


class StageRecord(RowRecord):
    i: Index
    stage: Name
    ms: Ms


class DeviceRecord(RowRecord):
    i: Index
    ms: Ms


class KernelsRecord(RowRecord):
    iters: Index
    kernels: dict[str, Annotated[list[Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]],
                                 Field(min_length=2, max_length=2)]]  # name -> [total ms, launches]


class FailureRecord(RowRecord):
    error: str


class TrainStepRecord(BlockRecord):
    row: Name
    step: Index
    warmup: bool
    ms: Ms
    loss: float  # NaN allowed: a diverged step is a finding, not damage
    tokens: Index


class TrainRowRecord(BlockRecord):
    row: Name


class BlockEndRecord(BlockRecord):
    status: Literal["ok", "failed"]
    error: str | None = None


class AttemptRecord(Record):  # attempts.jsonl (harness/attempts.py)
    sha: Name
    verdict: Name


class ReopenRecord(Record):
    reason: str


# record type -> its model (a pydantic model); the lockstep engine's types are dataclasses in
# harness/measure/model.py's own table, whose field types come from this module (see record_model)
RECORD_TYPES: dict[str, type] = {
    "block_start": BlockRecord, "provenance": BlockRecord, "sample": SampleRecord, "peak": PeakRecord,
    "stage": StageRecord, "device": DeviceRecord, "kernels": KernelsRecord, "failure": FailureRecord,
    "train_step": TrainStepRecord, "train_row": TrainRowRecord, "block_end": BlockEndRecord,
    "attempt": AttemptRecord, "reopen": ReopenRecord,
}

log = logging.getLogger(__name__)
_logged: set = set()  # Damage already logged by this process


@dataclass(frozen=True)
class Damage:
    """One quarantined line of a records file (or the file itself, line 0)."""

    path: str
    line: int
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.problem}" if self.line else f"{self.path}: {self.problem}"

    def to_json(self) -> dict:
        return {"file": self.path, "line": self.line, "problem": self.problem}


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    text = "".join(c if c.isprintable() else "?" for c in text)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def record_model(kind: str) -> type | None:
    """The model a record of this type is checked against: this module's table, then the lockstep
    engine's (harness/measure/model.py); None for a type neither knows (it passes unchecked)."""
    from harness.measure import model as lockstep

    return RECORD_TYPES.get(kind) or lockstep.RECORD_TYPES.get(kind)


@functools.cache
def _validator(model: type):
    """validate(record dict) for a pydantic model or a dataclass (the lockstep engine's records)."""
    return model.model_validate if issubclass(model, BaseModel) else TypeAdapter(model).validate_python


def check_record(rec) -> str | None:
    """Why `rec` (one parsed line) is not a valid record, or None."""
    if not isinstance(rec, dict):
        return f"not a JSON object but {type(rec).__name__}"
    kind = rec.get("type")
    if not isinstance(kind, str) or not kind:
        return "no record type"
    model = record_model(kind)
    if model is None:
        return None
    try:
        _validator(model)(rec)
    except ValidationError as e:
        return f"{kind} record: " + "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'record'}: {err['msg']}" for err in e.errors()[:3])
    return None


def read_jsonl(path: Path, damage: list[Damage] | None = None) -> list[dict]:
    """Every valid record of a JSONL file, in order. A torn, undecodable, non-JSON or invalid line is
    skipped and described in `damage` (logged as a warning when no list is given); so is a path that
    is not a regular file. A missing file has no records."""
    path = Path(path)
    found: list[Damage] = []
    out: list[dict] = []
    if not path.exists():
        return out
    if not path.is_file():
        found.append(Damage(str(path), 0, "not a regular file: no records read from it"))
    else:
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    if raw.strip():
                        found.append(Damage(str(path), lineno, f"torn last line (an interrupted write) {_excerpt(raw)}"))
                    break
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    found.append(Damage(str(path), lineno, f"not UTF-8 text {_excerpt(raw)}"))
                    continue
                except ValueError:
                    found.append(Damage(str(path), lineno, f"not a JSON line {_excerpt(raw)}"))
                    continue
                problem = check_record(rec)
                if problem:
                    found.append(Damage(str(path), lineno, f"{problem} {_excerpt(raw)}"))
                    continue
                out.append(rec)
    if damage is not None:
        damage.extend(found)
    else:
        for d in found:
            if d not in _logged:  # the same file is read again and again during a run: say it once
                _logged.add(d)
                log.warning("quarantined %s", d)
    return out


def append_jsonl(path: Path, record: dict) -> None:
    """Append one record as one line in one write and fsync it before returning. A torn line left by
    a kill mid-write stays on a line of its own (see the module docstring)."""
    import os

    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with path.open("a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = b"\n" + line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:  # a failed write names no file: say which (a full disk, most often)
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def load_blocks(samples_path: Path, damage: list[Damage] | None = None) -> list[Block]:
    """Every attempt's block, in file order; use `completed_blocks` for data. `damage`: see read_jsonl."""
    return _blocks(read_jsonl(samples_path, damage))


def _blocks(recs: list[dict]) -> list[Block]:
    attempts: dict[str, Block] = {}
    for rec in recs:
        kind = rec["type"]
        key = rec.get("attempt")
        if key is None:
            continue  # a kind that belongs to no block or worker (or one this reader does not know)
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


def completed_blocks(samples_path: Path, damage: list[Damage] | None = None) -> list[Block]:
    """One Block per block index: the attempt that finished it, ordered by index."""
    return completed_blocks_of(read_jsonl(samples_path, damage))


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
    retimed: dict = field(default_factory=dict)  # (shape, mode, basis) -> calls timed again (late replays)
    methods: dict = field(default_factory=dict)  # (shape, mode) -> the latest measure.model.RowMethod
    row_ends: dict = field(default_factory=dict)  # (shape, mode, basis) -> the latest measure.model.RowEnd
    throttled: list = field(default_factory=list)  # (shape, mode, basis, pair, round, why) of left-out rounds
    # worker -> (side, {kernel: {tuning key: config}}): the autotune choices it reported, all rows
    configs: dict = field(default_factory=dict)
    config_rows: dict = field(default_factory=dict)  # (kernel, key) -> the row whose prepare first reported it


def load_measurement(samples_path: Path, damage: list[Damage] | None = None) -> Measurement:
    """The one reader of a run's samples.jsonl, whichever engine wrote it. `damage`: see read_jsonl."""
    from harness.measure import model
    from harness.stats import Round, Series

    recs = read_jsonl(Path(samples_path), damage)
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
            if any(b.retimed for b in sides.values()):
                m.retimed[key] = m.retimed.get(key, 0) + sum(b.retimed for b in sides.values())
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
        elif isinstance(rec, model.RowPrepared):
            _, kernels = m.configs.setdefault(rec.worker, (rec.side, {}))
            for kernel, keys in rec.configs.items():
                kernels.setdefault(kernel, {}).update(keys)
                for key in keys:
                    m.config_rows.setdefault((kernel, key), f"{rec.shape}/{rec.mode}")
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

