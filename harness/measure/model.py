"""The data model the driver and its side workers share, and its one JSON form.

Everything a measurement produces is one of these records, appended by the driver (the only writer)
to the run's samples.jsonl as it arrives, and read back by harness/records.py through `parse`:

    measure_start  {attempt, engine, settings}                     a driver session began (one per resume)
    worker_start   {attempt, worker, pair, side, pid, host, gpu, provenance}
    worker_end     {attempt, worker, status, error}
    row_method     {attempt, shape, mode, primary, bases, graph_reason, dims}
    row_prepared   {attempt, worker, pair, side, shape, mode, configs}   a worker prepared the row: the
                                                                    autotune configs its process chose
                                                                    since its last report
    burst          {attempt, worker, pair, side, shape, mode, basis, round, ms, gpu, throttled, enqueue_us,
                    retimed}
    round          {attempt, pair, shape, mode, basis, round}       every burst of that round is written
    row_end        {attempt, shape, mode, basis, reason, detail, pairs, rounds, rel_half_width}
and, per worker and row, the first engine's kinds with `block` = the worker's id (records.py):
    peak, stage, device, kernels, failure, train_step, train_row.

A round counts only through its `round` record, written after all its bursts: the bursts of a round
cut short by a crash stay in the file and are never read as data, so a resumed run neither loses
nor repeats one. Ids (`worker`, `pair`) grow across a run's driver sessions and are never reused.

`side` is "baseline", "candidate" or "control" (the pair's baseline twin: the A/A control).
Sizes: `ms` are milliseconds of one timed call each; `gpu` is a telemetry reading taken right after
the burst (detail/telemetry.py).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any, Literal

from pydantic import Field

# Field types: the readers check every record against them (harness/records.py: record_model)
from harness.records import Index, Ms, Name

Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]

ENGINE = "lockstep"
WORKER_SIDES = ("baseline", "candidate", "control")
# the stats.Round field of each worker side
ROUND_FIELD = {"baseline": "base", "candidate": "cand", "control": "control"}


@dataclass
class Record:
    """Base of every record: its JSON object is its fields plus `type`."""

    TYPE = ""

    def to_json(self) -> dict:
        return {"type": self.TYPE, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class MeasureStart(Record):
    TYPE = "measure_start"
    attempt: Name
    engine: Name
    settings: dict


@dataclass
class WorkerStart(Record):
    TYPE = "worker_start"
    attempt: Name
    worker: Index
    pair: Index
    side: Name
    pid: int | None = None
    host: str | None = None
    t: str | None = None
    gpu: dict | None = None
    provenance: dict | None = None  # where a package side's op came from


@dataclass
class WorkerEnd(Record):
    TYPE = "worker_end"
    attempt: Name
    worker: Index
    status: Literal["ok", "failed"]
    error: str | None = None
    t: str | None = None
    gpu: dict | None = None


@dataclass
class RowMethod(Record):
    """How a row is timed in this session: `primary` is what basis "auto" reads (graph where every
    worker captured the call, else eager), `bases` every timed basis measured, `graph_reason` why
    there is no graph basis (None when there is)."""

    TYPE = "row_method"
    attempt: Name
    shape: Name
    mode: Name
    primary: Name
    bases: list[str]
    graph_reason: str | None = None
    dims: dict = field(default_factory=dict)


@dataclass
class WorkerRow(Record):
    """Base of what one worker did on one row."""

    attempt: Name
    worker: Index
    pair: Index
    side: Name
    shape: Name
    mode: Name


@dataclass
class RowPrepared(WorkerRow):
    """A worker prepared a row (a training row: mode "train"); `configs` is what the Triton
    autotuners of its process chose since its last report (preparing this row, as a rule),
    {module.kernel: {tuning key: config}} (detail/autotune.py)."""

    TYPE = "row_prepared"
    configs: dict = field(default_factory=dict)


@dataclass
class Burst(WorkerRow):
    TYPE = "burst"
    basis: Name
    round: Index
    ms: Annotated[list[Ms], Field(min_length=1)]
    gpu: dict | None = None
    throttled: str | None = None  # why the burst cannot be trusted (the round is left out): its clock, a late replay
    enqueue_us: Finite | None = None  # the host's slowest enqueue of one call (detail/timing.py); None: not taken
    retimed: Index = 0  # calls timed again because the host enqueued their replay after the hold ran out


@dataclass
class RoundDone(Record):
    TYPE = "round"
    attempt: Name
    pair: Index
    shape: Name
    mode: Name
    basis: Name
    round: Index


@dataclass
class RowEnd(Record):
    """What ended a row's rounds on one basis: resolved (half-width <= target), budget (its time),
    limit (max_pairs and max_rounds reached), fixed (a basis no gate reads: secondary_rounds),
    failed (too few workers left)."""

    TYPE = "row_end"
    attempt: Name
    shape: Name
    mode: Name
    basis: Name
    reason: Name
    detail: str = ""
    pairs: Index = 0
    rounds: Index = 0
    rel_half_width: Finite | None = None
    seconds: Ms | None = None


RECORD_TYPES: dict[str, type[Record]] = {c.TYPE: c for c in (MeasureStart, WorkerStart, WorkerEnd, RowMethod, RowPrepared,
                                                               Burst, RoundDone, RowEnd)}


def parse(d: dict) -> Record | None:
    """The typed record of one samples.jsonl object of this engine, or None for other kinds."""
    cls = RECORD_TYPES.get(d.get("type"))
    return cls.from_json(d) if cls is not None else None


# --- what the driver and a worker say to each other -------------------------------------------

@dataclass
class WorkerJob:
    """What a side worker is started with (a JSON file: its argv[1])."""

    worker: int
    pair: int
    side: str  # baseline | candidate | control
    worktree: str
    op: str  # "module:function"
    package: dict | None  # {"name", "version"} of an installed side, else None
    inputs_file: str
    inputs_fn: str
    dtype: str
    seed: int
    warmup: int
    l2_flush: bool
    stage_patterns: dict[str, list[str]]
    channel: tuple[int, int] = (-1, -1)  # fds the worker reads commands from / writes replies to

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "WorkerJob":
        d = dict(d)
        d["channel"] = tuple(d.get("channel") or (-1, -1))
        return cls(**d)


def encode(message: dict[str, Any]) -> bytes:
    """One message on a channel: a JSON object on one line (NaN and inf refused: they are no data)."""
    return (json.dumps(message, allow_nan=False, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    return json.loads(line)
