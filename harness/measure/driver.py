"""The driver: worker pairs in lockstep rounds, the stopping rule, and the run's records.

Per row (shape, mode), in declaration order:
  1. every live worker prepares the row, one after the other (warm-up, compile, autotune: the first
     worker of a fresh machine pays for it, the others find the shared Triton cache), and captures
     it as a CUDA graph when it can;
  2. the row's primary basis is graph if every worker captured it, else eager (the reason is kept);
  3. per basis (the primary first; eager too when the primary is graph), rounds: each live pair in
     turn runs one burst per side, the side order rotating from round to round through whole cycles
     of orders, its sides relabelled per pair (side_order), until the stopping rule (stopping.py) is satisfied;
     pairs are added when offsets dominate;
  4. the row is released.
Training rows follow, with optimizer steps as the bursts. Last, every row is prepared again for one
eager call per worker for its peak allocation and `stage_iters` profiled calls for stage times and
summed device time (last because a process that has run the profiler launches more slowly ever
after). The driver is the only writer of samples.jsonl (model.py lists what it writes); resuming reads it back, keeps every complete round and
finished row, and goes on with fresh pairs where the last session stopped.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from harness import children, stats
from harness.measure import stopping
from harness.measure.detail.channel import Channel, ChannelClosed, ChannelTimeout
from harness.measure.detail.telemetry import late_replay, throttled
from harness.measure.model import (ENGINE, ROUND_FIELD, Burst, MeasureStart, RoundDone, RowEnd, RowMethod, RowPrepared,
                                   WorkerEnd, WorkerJob, WorkerStart)
from harness.progress import Progress, as_progress
from harness.records import append_jsonl, declared_side, load_measurement
from harness.revisions import Revisions, check_unmoved
from harness.spec import LoadedExperiment, MeasureSpec, setup_error

TRAIN_MODE = "train"
# seconds a worker may take to answer: its start (imports), a row's preparation (compile and autotune
# on a fresh machine take minutes per shape), anything else (a burst, a profiled call)
TIMEOUTS = {"hello": 600.0, "prepare": float(os.environ.get("HARNESS_PREPARE_TIMEOUT", 3600)), "other": 1200.0}
# the side order of a round, by round index: every side in every position and after every other
# side equally often over a cycle, so drift within a round and any effect of a burst's position in
# its round cancel; a pair's rounds are whole cycles (on the H200, 2026-12-03, rounds that were not
# gave the workers measured first in more rounds a 0.1% edge in A/A runs: docs/perf/measurement.md)
ORDERS = {2: [(0, 1), (1, 0)], 3: [(0, 1, 2), (2, 1, 0), (1, 2, 0), (0, 2, 1), (2, 0, 1), (1, 0, 2)]}


def side_order(n_sides: int, key: str, index: int) -> tuple[int, ...]:
    """The side order of round `index` of one pair on one row and basis (`key` names them): the
    sequence of ORDERS, with the sides relabelled by a permutation drawn for that pair. The pairs'
    rounds run interleaved, so with one sequence for all every pair would put the same side first at
    the same moment, and anything tied to the moment (the first rounds of a basis, a pause of the
    host) would land on one side in every pair, a bias the spread of pairs cannot show: on the H200
    (pkda-aa, 2026-12-04) the 5th eager round of a row was slow for whichever side went first (the
    control in every pair) in 3 of its 6 pairs, and two eager A/A controls read 7-10% slower.
    Relabelled per pair it becomes spread between pairs, which the interval pays for. Only the
    labels change: within a pair, whole cycles still put every side in every position equally often
    and give every side one back-to-back burst (its last and next first) per cycle. Drawing the
    cycle's order instead broke that, and a CPU run's A/A control then excluded 1.0 (CI,
    2026-12-04). Seeded by the key, so a round's order can be recomputed."""
    orders = ORDERS[n_sides]
    relabel = random.Random(key).sample(range(n_sides), n_sides)
    return tuple(relabel[i] for i in orders[index % len(orders)])


# device memory kept free beside the rows the workers hold: allocator fragmentation, the profiled
# calls of extras, a worker's context growing
MEMORY_HEADROOM = 0.08  # of the device's total


def pairs_that_fit(needs: list[tuple[int, int]], memory: dict | None, footprint: int,
                   regrow: int = 0) -> tuple[set[int], str]:
    """Which pairs (in order) can also prepare a row, and why the others cannot.

    All pairs of a row hold it at once (rounds go from pair to pair), so a large row times the
    workers can exceed the device (on the H200, 2026-12-04: 18 workers of 11 GiB each at
    B4_T4096_H64_D128 fwd+bwd). `needs`: (pair id, workers of it still to prepare the row);
    `memory`: the last reading of a worker that prepared it ({"free", "total"} bytes, the device's,
    every process counted), or None without CUDA (no limit); `footprint`: the most bytes one worker
    reserved while preparing it (its peak: the others prepare at once); `regrow`: what the workers
    that already prepared it gave back after preparing and will take again in their rounds (their
    peak less what they hold now: the free reading does not count it)."""
    ids = {pid for pid, _ in needs}
    if not memory or footprint <= 0:
        return ids, ""
    room = memory["free"] - MEMORY_HEADROOM * memory["total"] - regrow
    fit = set()
    for pid, n in needs:
        if n * footprint <= room:
            fit.add(pid)
            room -= n * footprint
    left = ids - fit
    why = (f"device memory holds no more of this row: {footprint / 2**30:.1f} GiB a worker, "
           f"{memory['free'] / 2**30:.1f} of {memory['total'] / 2**30:.1f} GiB free") if left else ""
    return fit, why


def prepare_order(pairs: list, rng: random.Random | None = None) -> tuple[list, list]:
    """(leaders, rest): the (pair, worker) that prepare a row alone, one after the other, then the
    rest, sent at once. A leader per side (the control too: it is the baseline's code, and whichever
    of the two goes first compiles for both), each from the first pair that has the side. Both lists
    are shuffled: a worker's place in them decides when it allocates the row's memory and captures
    its graph, and a side always first or always solo would carry that into every pair alike (on the
    H200, 2026-12-04, with the baseline always first to be sent the rest's prepare and the control
    never a leader, the compute-bound A/A row read the baseline 0.14% faster than both other sides
    in the pairs that had no leader); drawn at random it is per-pair spread the interval pays for."""
    rng = rng or random
    leaders, seen = [], set()
    for pair in pairs:
        for w in pair.workers:
            if w.side not in seen:
                seen.add(w.side)
                leaders.append((pair, w))
    led = {id(w) for _, w in leaders}
    rest = [(p, w) for p in pairs for w in p.workers if id(w) not in led]
    rng.shuffle(leaders)
    rng.shuffle(rest)
    return leaders, rest


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def release_message(key: tuple[str, str], what: str) -> dict:
    """What a worker is sent to free a row (shape, mode): its graph only, or all it holds of it."""
    return {"cmd": "release", "shape": key[0], "mode": key[1], "what": what}


class WorkerLost(Exception):
    """A worker died or stopped answering; its pair can measure no more."""


@dataclass(eq=False)
class WorkerHandle:
    id: int
    pair: int
    side: str
    proc: subprocess.Popen
    channel: Channel
    log_path: Path
    alive: bool = True

    def send(self, message: dict) -> None:
        if not self.alive:
            raise WorkerLost(f"worker {self.id} is not running")
        try:
            self.channel.send(message)
        except ChannelClosed as e:
            self._lost(e)

    def reply(self, timeout: float) -> dict:
        try:
            return self.channel.recv(timeout)
        except (ChannelClosed, ChannelTimeout) as e:
            self._lost(e)

    def request(self, message: dict, timeout: float) -> dict:
        """The worker's reply; WorkerLost when it is gone or silent (it is then killed)."""
        self.send(message)
        return self.reply(timeout)

    def _lost(self, e: Exception):
        self.kill()
        raise WorkerLost(f"worker {self.id} ({self.side}, pair {self.pair}): {e}; log {self.log_path}: "
                         f"{self.log_tail()}") from None

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def kill(self) -> None:
        self.alive = False
        children.kill_group(self.proc)  # the worker and anything it started
        self.channel.close()


@dataclass(eq=False)
class Pair:
    id: int
    workers: list[WorkerHandle]  # baseline, candidate[, control]
    rows: set = field(default_factory=set)  # rows this pair prepared and can measure

    @property
    def alive(self) -> bool:
        return all(w.alive for w in self.workers)


@dataclass
class RowPlan:
    shape: dict  # the shape as the inputs factory takes it (with "name")
    mode: str
    gated: set  # bases gates read for this row: "auto", "graph", "eager"

    @property
    def key(self) -> tuple[str, str]:
        return self.shape["name"], self.mode

    @property
    def name(self) -> str:
        return f"{self.shape['name']}/{self.mode}"


def gated_bases(exp, shape: str, mode: str) -> set[str]:
    """The timed bases the experiment's whole-call gates read for one row."""
    from harness.spec import GeomeanGate, NonRegressionGate, SpeedupGate

    out = set()
    for g in exp.gates:
        if isinstance(g, SpeedupGate) and g.stage is None and (g.row, g.mode) == (shape, mode):
            out.add(g.basis)
        elif isinstance(g, GeomeanGate) and g.mode == mode and shape in g.rows:
            out.add(g.basis)
        elif isinstance(g, NonRegressionGate) and mode in g.modes and (g.rows == "all" or shape in g.rows):
            out.add(g.basis)
    return out - {"device"}


class Driver:
    def __init__(self, loaded: LoadedExperiment, revisions: Revisions, run_dir: Path, settings, profile_root: Path,
                 progress: Progress):
        from harness.measure.sides import side_env, side_op, training_job_row

        self.loaded, self.exp, self.revisions = loaded, loaded.exp, revisions
        self.run_dir, self.settings, self.profile_root = Path(run_dir), settings, Path(profile_root)
        self.spec: MeasureSpec = settings.measure
        self.progress = progress
        self.samples_path = self.run_dir / "samples.jsonl"
        self.attempt = uuid.uuid4().hex[:12]
        self.side_env, self.side_op, self.training_job_row = side_env, side_op, training_job_row
        self.sides = ["baseline", "candidate"] + (["control"] if self.spec.control else [])
        self.pairs: list[Pair] = []
        self.cannot_start: str | None = None  # set when a whole batch of new pairs failed to start
        # row key -> (pairs that held it at once, why no more): set when device memory or pairs_at_once
        # held fewer than were asked to prepare it; the row's further pairs run in waves
        self.at_once: dict[tuple[str, str], tuple[int, str]] = {}
        self.offered: dict[tuple[str, str], set[int]] = {}  # row key -> pairs this session asked to prepare it
        self.training_jobs: dict[tuple[str, str], tuple[dict, int]] = {}  # training row key -> (job row, tokens)
        self.started_any = False  # whether any pair of this session started
        self.known = load_measurement(self.samples_path)
        self.next_worker = max((w.index for w in self.known.workers), default=-1) + 1
        self.next_pair = max((w.pair for w in self.known.workers if w.pair is not None), default=-1) + 1

    # --- records -----------------------------------------------------------------------------------
    def write(self, record) -> None:
        append_jsonl(self.samples_path, record.to_json() if hasattr(record, "to_json") else record)

    def write_kind(self, kind: str, worker: WorkerHandle, **fields) -> None:
        """A per-worker record of the first engine's kinds (peak, stage, device, kernels, failure,
        train_step, train_row), keyed by the worker's id as its `block`."""
        self.write({"type": kind, "block": worker.id, "side": worker.side, "attempt": self.attempt,
                    "pair": worker.pair, **fields})

    # --- workers -----------------------------------------------------------------------------------
    def _job(self, worker_id: int, pair: int, side: str, channel: tuple[int, int]) -> WorkerJob:
        declared = "baseline" if side == "control" else declared_side(side, self.settings.aa)
        rev_side = "baseline" if side == "control" else side
        _, inputs_fn = self.exp.target.inputs.split(":")
        op = self.side_op(self.exp, declared)
        return WorkerJob(worker=worker_id, pair=pair, side=side, worktree=getattr(self.revisions, rev_side).worktree,
                         op=op["op"], package=op["package"], inputs_file=str(self.loaded.inputs_file),
                         inputs_fn=inputs_fn, dtype=self.settings.dtype, seed=self.exp.seed,
                         warmup=self.settings.warmup, l2_flush=self.settings.l2_flush,
                         stage_patterns={name: getattr(p, "baseline" if side == "control" else side)
                                         for name, p in self.exp.stages.items()},
                         channel=channel)

    def _spawn(self, pair: int, side: str) -> WorkerHandle:
        worker_id = self.next_worker
        self.next_worker += 1
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        job = self._job(worker_id, pair, side, (to_child_r, from_child_w))
        jobs = self.run_dir / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        job_path = jobs / f"worker-{worker_id:03d}-{side}.json"
        job_path.write_text(json.dumps(job.to_json(), indent=1))
        log_path = self.run_dir / "logs" / f"worker-{worker_id:03d}-{side}-{self.attempt}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        declared = "baseline" if side == "control" else declared_side(side, self.settings.aa)
        env = self.side_env(self.loaded, declared, self.profile_root, self.settings.cpu_mode)
        env["PYTHONUNBUFFERED"] = "1"
        with log_path.open("w") as log:
            # harness/children.py: killed with its process group on every way out of the harness
            proc = children.start([sys.executable, "-m", "harness.measure.worker", str(job_path)], cwd=self.run_dir,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(to_child_r, from_child_w))
        os.close(to_child_r)
        os.close(from_child_w)
        return WorkerHandle(worker_id, pair, side, proc, Channel(from_child_r, to_child_w), log_path)

    def start_pairs(self, n: int) -> list[Pair]:
        """Start n pairs at once (their imports run in parallel), then wait for each worker's hello."""
        new = []
        for _ in range(n):
            pid = self.next_pair
            self.next_pair += 1
            # each pair's sides start in a random order (worker ids, given at spawn, record it): a
            # process started first or last in every pair would carry any start-order effect (CUDA
            # context and allocation placement) into every pair alike, a bias no number of pairs
            # averages out; drawn at random it is one more per-pair offset the interval pays for
            order = random.sample(range(len(self.sides)), len(self.sides))
            started = {i: self._spawn(pid, self.sides[i]) for i in order}
            new.append(Pair(pid, [started[i] for i in range(len(self.sides))]))
        first_error: dict[str, tuple[str, Path]] = {}  # side -> (why its first worker did not start, its log)
        for pair in new:
            for w in pair.workers:
                try:
                    hello = w.channel.recv(TIMEOUTS["hello"])
                except (ChannelClosed, ChannelTimeout) as e:
                    w.kill()
                    hello = {"ok": False, "error": f"{e}: {w.log_tail()}"}
                self.write(WorkerStart(self.attempt, w.id, pair.id, w.side, hello.get("pid"), hello.get("host"),
                                       _now(), hello.get("gpu"), hello.get("provenance")))
                if not hello.get("ok"):
                    first_error.setdefault(w.side, (str(hello.get("error")), w.log_path))
                    w.kill()
                    self.write(WorkerEnd(self.attempt, w.id, "failed", f"the worker did not start: {hello.get('error')}",
                                         _now()))
                    self.progress.message(f"worker {w.id} ({w.side}, pair {pair.id}) did not start: "
                                          f"{str(hello.get('error')).splitlines()[0] if hello.get('error') else ''}")
        children.raise_if_stopped()  # workers a stop killed are not workers that failed to start
        live = [p for p in new if p.alive]
        for p in new:
            if not p.alive:
                self.end_pair(p, "a worker of its pair did not start")
        if new and not live:
            # every new pair failed to start (an op that does not import, a package at the wrong
            # version): a setup error, which more pairs would only repeat; before anything was
            # measured it is the run's error (exit 2, never a verdict, never an attempt)
            self.cannot_start = "no worker pair could start (see the failed workers)"
            if not self.started_any:
                raise setup_error(self.loaded, *[(self._op_field(side), f"the {side} worker did not start: "
                                                  f"{why.strip().splitlines()[-1] if why.strip() else why} (log: {log})")
                                                 for side, (why, log) in first_error.items()])
        self.started_any = self.started_any or bool(live)
        self.pairs += live
        return live

    def _op_field(self, side: str) -> str:
        """The experiment field that names what a worker of `side` imports."""
        declared = "baseline" if side == "control" else declared_side(side, self.settings.aa)
        rev = getattr(self.exp, declared)
        if rev.is_package:
            return f"{declared}.package"
        return f"{declared}.op" if rev.op else "target.op"

    def end_pair(self, pair: Pair, why: str | None = None) -> None:
        for w in pair.workers:
            if w.alive:
                try:
                    reply = w.request({"cmd": "exit"}, 60)
                    gpu = reply.get("gpu")
                except WorkerLost:
                    gpu = None
                w.kill()
                self.write(WorkerEnd(self.attempt, w.id, "failed" if why else "ok", why, _now(), gpu))
        if pair in self.pairs:
            self.pairs.remove(pair)

    def lose(self, pair: Pair, err: Exception) -> None:
        """A worker of `pair` is gone: record it, stop the pair's other workers."""
        self.progress.message(f"pair {pair.id} lost: {str(err).splitlines()[0]}")
        for w in pair.workers:
            if not w.alive:
                self.write(WorkerEnd(self.attempt, w.id, "failed", str(err)[-2000:], _now()))
        self.end_pair(pair, f"another worker of pair {pair.id} was lost")

    def live_pairs(self, key) -> list[Pair]:
        return [p for p in self.pairs if p.alive and key in p.rows]

    # --- a row -------------------------------------------------------------------------------------
    def prepare(self, pairs: list[Pair], row: RowPlan, graph: bool) -> dict[int, dict]:
        """Prepare the row on every worker of `pairs`; returns worker id -> reply for those that did.

        The first worker of each side prepares alone (it compiles and autotunes the side's kernels
        into the shared Triton cache; autotuning beside another process's GPU work would time the
        contention), then every other worker at once: they find the cache, and nothing is timed.
        Both orders are drawn at random (prepare_order)."""
        message = {"cmd": "prepare", "shape": row.shape, "mode": row.mode, "graph": graph}
        replies: dict[int, dict] = {}
        failed: set[int] = set()
        leaders, rest = prepare_order(pairs)
        for batch in ([x] for x in leaders):
            self._prepare_batch(batch, message, replies, failed)
        measured = [replies[w.id]["memory"] for _, w in leaders if (replies.get(w.id) or {}).get("memory")]
        footprint = max((m["peak_reserved"] for m in measured), default=0)
        # a leader frees its cached blocks after preparing and takes them again in its rounds: on an
        # H100 (2026-12-05) B1_T8192_H96_D128 fwd+bwd let 3 pairs of 9.2 GiB workers in on a reading
        # taken while the leaders held less, and a pair ran out of memory in the rounds
        regrow = sum(max(m["peak_reserved"] - m["reserved"], 0) for m in measured)
        waiting = [(p.id, sum(q is p for q, _ in rest)) for p in pairs]  # workers of each pair still to prepare
        fit, why = pairs_that_fit(waiting, measured[-1] if measured else None, footprint, regrow)
        held = sum(1 for p in self.pairs if p.alive and row.key in p.rows)
        at_once = self.spec.pairs_at_once
        if at_once is not None and held + len(fit) > at_once:
            # the leaders' pairs first: they hold the row already
            keep = sorted(fit, key=dict(waiting).get)[:max(at_once - held, 0)]
            fit, why = set(keep), f"at most {at_once} pairs hold a row at once (measure.pairs_at_once)"
        if why:
            self.at_once[row.key] = (held + len(fit), why)
            self.progress.message(f"{row.name}: {len(pairs) - len(fit)} pair(s) wait for a later wave of this row: {why}")
        self.offered.setdefault(row.key, set()).update(fit)
        for pair, w in leaders:
            if pair.id not in fit:  # a leader whose pair waits gives the row's memory back
                self._release(pair, w, row.key, "all")
        rest = [(p, w) for p, w in rest if p.id in fit]
        self._prepare_batch(rest, message, replies, failed)
        for pair in pairs:
            if pair.alive and pair.id in fit and pair.id not in failed and all(w.id in replies for w in pair.workers):
                pair.rows.add(row.key)
        return replies

    def _prepare_batch(self, batch: list[tuple[Pair, WorkerHandle]], message: dict, replies: dict, failed: set) -> None:
        sent = []
        for pair, w in batch:
            if pair.id in failed or not pair.alive:
                continue
            try:
                w.send(message)
                sent.append((pair, w))
            except WorkerLost as e:
                failed.add(pair.id)
                self.lose(pair, e)
        for pair, w in sent:
            if not w.alive:
                continue
            try:
                reply = w.reply(TIMEOUTS["prepare"])
            except WorkerLost as e:
                failed.add(pair.id)
                self.lose(pair, e)
                continue
            if not reply.get("ok"):
                failed.add(pair.id)
                self.write_kind("failure", w, shape=message["shape"]["name"], mode=message["mode"],
                                error=reply.get("error"), trace=reply.get("trace"))
                self.progress.message(f"{message['shape']['name']}/{message['mode']}: worker {w.id} ({w.side}) "
                                      f"failed to prepare: {str(reply.get('error')).splitlines()[0]}")
                continue
            replies[w.id] = reply
            self.write(RowPrepared(self.attempt, w.id, pair.id, w.side, message["shape"]["name"], message["mode"],
                                   reply.get("configs") or {}))

    def measure_row(self, row: RowPlan) -> None:
        done = {b for (s, m, b) in self.known.row_ends if (s, m) == row.key}
        graph_wanted = self.spec.graph and not self.settings.cpu_mode
        if done and (self.known.methods.get(row.key) is not None
                     and set(self.known.methods[row.key].bases) <= done):
            return
        self.ensure_pairs(self.spec.pairs)
        pairs = [p for p in self.pairs if p.alive]
        replies = self.prepare(pairs, row, graph_wanted)
        live = self.live_pairs(row.key)
        reasons = sorted({r.get("graph_reason") for r in replies.values() if not r.get("graph")} - {None})
        graph_ok = graph_wanted and bool(live) and all(replies[w.id].get("graph") for p in live for w in p.workers)
        if not graph_wanted:
            reasons = ["no CUDA device (CPU run)"] if self.settings.cpu_mode else ["measure.graph is false"]
        primary = "graph" if graph_ok else "eager"
        bases = [primary] + (["eager"] if primary == "graph" and self.spec.eager else [])
        self.write(RowMethod(self.attempt, row.key[0], row.mode, primary, bases,
                             None if graph_ok else "; ".join(reasons) or "no worker could prepare the row",
                             {k: v for k, v in row.shape.items() if k != "name"}))
        gated = {primary if b == "auto" else b for b in row.gated} | {primary}
        for basis in bases:
            if basis in done:
                continue
            if basis == "eager" and primary == "graph":
                for p in self.live_pairs(row.key):
                    self.request_all(p, release_message(row.key, "graph"))
            self.rounds(row, basis, gated=basis in gated, graph=primary == "graph")
        self.release_row(row)

    def release_row(self, row: RowPlan) -> None:
        """Every live pair that holds the row frees it and no longer counts as holding it."""
        for p in self.live_pairs(row.key):
            self.request_all(p, release_message(row.key, "all"))
            p.rows.discard(row.key)

    def _release(self, pair: Pair, w: WorkerHandle, key: tuple[str, str], what: str) -> None:
        try:
            w.request(release_message(key, what), TIMEOUTS["other"])
        except WorkerLost as e:
            self.lose(pair, e)

    def more_pairs(self, row: RowPlan, basis: str, graph: bool, n: int, measured: set[int]) -> list[Pair]:
        """Up to n more pairs that hold the row, ready for `basis`. Where fewer pairs than asked for
        could hold the row at once (device memory, pairs_at_once: self.at_once), the pairs that hold
        it now have done their rounds: they release it (their rounds stay in the series) and the next
        wave prepares it, first from live pairs that waited (`measured`: pairs with rounds on this row
        and basis, never asked again), then fresh pairs. On the H100 (2026-12-05) device memory held
        2 of 8 pairs at B2_T16384_H16_D128 fwd+bwd (11.3 GiB a worker), and the row ended at +-1.26%
        on t with 1 degree of freedom; the interval needs pairs, not pairs at the same moment."""
        if row.key in self.at_once:
            self.release_row(row)
        offered = self.offered.get(row.key, set())
        take = [p for p in self.pairs if p.alive and row.key not in p.rows and p.id not in measured
                and p.id not in offered][:n]
        if len(take) < n and not self.cannot_start:
            take += self.start_pairs(n - len(take))
        if not take:
            return []
        replies = self.prepare(take, row, graph)
        joined = []
        for p in take:
            if row.key not in p.rows:
                continue
            if basis == "graph" and not all(replies.get(w.id, {}).get("graph") for w in p.workers):
                p.rows.discard(row.key)  # a pair that could not capture the row cannot join its graph basis
                self.request_all(p, release_message(row.key, "all"))
                continue
            if graph and basis != "graph":
                self.request_all(p, release_message(row.key, "graph"))
            joined.append(p)
        return joined

    def request_all(self, pair: Pair, message: dict, timeout: float = TIMEOUTS["other"]) -> list[dict] | None:
        replies = []
        for w in pair.workers:
            try:
                replies.append(w.request(message, timeout))
            except WorkerLost as e:
                self.lose(pair, e)
                return None
        return replies

    def ensure_pairs(self, n: int) -> None:
        have = sum(1 for p in self.pairs if p.alive)
        if have < n and not self.cannot_start:
            self.start_pairs(n - have)

    def series(self, key, basis: str) -> stats.Series:
        return self.known.series.get((*key, basis), stats.Series())

    def rounds(self, row: RowPlan, basis: str, gated: bool, graph: bool) -> None:
        """Rounds on one basis until the stopping rule (or, for a basis no gate reads, a fixed count)."""
        t0 = time.monotonic()
        series = self.series(row.key, basis)
        self.known.series[(*row.key, basis)] = series
        counts: dict[int, int] = {}  # rounds each pair of this session has done on this row and basis
        cycle = len(ORDERS[len(self.sides)])
        whole = lambda n: -(-n // cycle) * cycle  # noqa: E731 - rounds up to whole cycles of side orders
        target = whole(self.spec.min_rounds if gated else self.spec.secondary_rounds)
        lim = stopping.Limits(self.spec.target_half_width, self.spec.min_rounds, self.spec.max_rounds,
                              self.spec.max_pairs, self.spec.row_budget_s)
        self.progress.row_started(row.name, basis, len(self.live_pairs(row.key)))
        while True:
            live = self.live_pairs(row.key)
            if not live:
                self.end_row(row, basis, "failed", "no worker pair could measure the row", series, t0)
                return
            over = False
            while not over and any(counts.get(p.id, 0) < target for p in self.live_pairs(row.key)):
                for pair in self.live_pairs(row.key):
                    if counts.get(pair.id, 0) < target:
                        self.one_round(pair, row, basis, counts.get(pair.id, 0), series)
                        counts[pair.id] = counts.get(pair.id, 0) + 1
                live = self.live_pairs(row.key)
                if live:
                    self.progress.rounds_progress(row.name, basis, min(counts.get(p.id, 0) for p in live), target,
                                                  len(live))
                # the budget ends a row only between whole cycles of side orders, as the target does
                over = time.monotonic() - t0 >= lim.budget_s and all(counts.get(p.id, 0) % cycle == 0 for p in live)
            iv = stats.ratio_interval(series, "base", "cand")
            if not gated:
                self.end_row(row, basis, "fixed", f"{target} rounds (no gate reads {basis})", series, t0, iv)
                return
            live = self.live_pairs(row.key)
            done_rounds = min((counts.get(p.id, 0) for p in live), default=0)
            cap = self.at_once.get(row.key)
            # operator rows take further pairs in waves (more_pairs); a training row's pairs hold it at once
            lim.max_pairs = min(self.spec.max_pairs, cap[0]) if cap and row.mode == TRAIN_MODE else self.spec.max_pairs
            # pairs of an earlier session of a resumed run count with their rounds, but cannot add more
            d = stopping.decide(iv, max(iv.n_blocks, len(live)), done_rounds, time.monotonic() - t0, lim)
            if cap and d.stop == "limit":
                d.detail += f" ({'in waves: ' if row.mode != TRAIN_MODE else ''}{cap[1]})"
            if d.stop:
                self.end_row(row, basis, d.stop, d.detail, series, t0, iv)
                return
            if d.add_pairs:
                wave = " in a new wave" if cap and row.mode != TRAIN_MODE else ""
                self.progress.message(f"{row.name} {basis}: {d.detail}; {d.add_pairs} more pair(s){wave}")
                new = (self.more_training_pairs(row, d.add_pairs) if row.mode == TRAIN_MODE
                       else self.more_pairs(row, basis, graph, d.add_pairs, set(counts)))
                if not new:
                    self.end_row(row, basis, "limit", f"{d.detail}; no more pairs could take the row", series, t0, iv)
                    return
            target = max(target, whole(d.rounds))

    def one_round(self, pair: Pair, row: RowPlan, basis: str, index: int, series: stats.Series) -> None:
        children.raise_if_stopped()
        order = side_order(len(pair.workers), f"{self.attempt}:{pair.id}:{row.key}:{basis}", index)
        bursts: dict[str, list[float]] = {}
        bad = None
        for i in order:
            w = pair.workers[i]
            if row.mode == TRAIN_MODE:
                message = {"cmd": "train_burst", "name": row.key[0], "steps": row.shape["steps"]}
            else:
                message = {"cmd": "burst", "shape": row.key[0], "mode": row.mode, "basis": basis,
                           "calls": self.spec.calls_per_burst}
            try:
                reply = w.request(message, TIMEOUTS["other"])
            except WorkerLost as e:
                self.lose(pair, e)
                return
            if not reply.get("ok"):
                self.write_kind("failure", w, shape=row.key[0], mode=row.mode, error=reply.get("error"),
                                trace=reply.get("trace"))
                pair.rows.discard(row.key)
                self.progress.message(f"{row.name} {basis}: pair {pair.id} stops on this row: "
                                      f"{str(reply.get('error')).splitlines()[0]}")
                return
            why = throttled(reply.get("gpu")) or late_replay(reply.get("late"))
            bad = bad or why
            bursts[w.side] = reply["ms"]
            self.write(Burst(self.attempt, w.id, pair.id, w.side, row.key[0], row.mode, basis, index,
                             reply["ms"], reply.get("gpu"), why, reply.get("enqueue_us"), reply.get("retimed") or 0))
        self.write(RoundDone(self.attempt, pair.id, row.key[0], row.mode, basis, index))
        if bad is None:
            series.add(pair.id, stats.Round(**{ROUND_FIELD[s]: ms for s, ms in bursts.items()}))
        else:
            self.known.excluded[(*row.key, basis)] = self.known.excluded.get((*row.key, basis), 0) + 1

    def end_row(self, row: RowPlan, basis: str, reason: str, detail: str, series: stats.Series, t0: float,
                iv: stats.Interval | None = None) -> None:
        iv = iv or stats.ratio_interval(series, "base", "cand")
        seconds = time.monotonic() - t0
        rec = RowEnd(self.attempt, row.key[0], row.mode, basis, reason, detail, iv.n_blocks, iv.n_rounds,
                     iv.rel_half_width, seconds)
        self.write(rec)
        self.known.row_ends[(*row.key, basis)] = rec
        self.progress.row_finished(row.name, basis, reason, detail, iv.point, iv.lo, iv.hi)

    def extras(self, row: RowPlan) -> None:
        """Peak allocation and profiled calls of every baseline and candidate worker (the control is
        the baseline's code: its stage times would only repeat the baseline's), once every timed round
        of the run is done: the row is prepared again (eagerly) on every live pair for it.

        Why last: once torch.profiler has run in a process, that process launches more slowly for
        the rest of its life (CUPTI stays attached: pytorch/pytorch#144455). On the H200 (2026-12-04)
        the baseline and candidate workers profiled each row right after its rounds and the A/A
        control never did: on the eager rows after the first, the control read 1.5-10% faster than
        the baseline running the same code (B8_T1024_H8_D64 fwd+bwd: 0.899 [0.887, 0.911])."""
        want_peak = not self.settings.cpu_mode
        if not want_peak and self.settings.stage_iters <= 0:
            return
        if any(row.key in w.peaks or row.key in w.kernels for w in self.known.workers):
            return  # an earlier session of a resumed run did this row
        self.ensure_pairs(self.spec.pairs)
        self.prepare([p for p in self.pairs if p.alive], row, graph=False)
        for pair in self.live_pairs(row.key):
            for w in pair.workers[:2]:
                try:
                    reply = w.request({"cmd": "extras", "shape": row.key[0], "mode": row.mode, "peak": want_peak,
                                       "stage_iters": self.settings.stage_iters}, TIMEOUTS["other"])
                except WorkerLost as e:
                    self.lose(pair, e)
                    break
                if not reply.get("ok"):
                    self.write_kind("failure", w, shape=row.key[0], mode=row.mode, error=reply.get("error"),
                                    trace=reply.get("trace"))
                    continue
                self._write_extras(w, row, reply)
        self.release_row(row)

    def _write_extras(self, w: WorkerHandle, row: RowPlan, reply: dict) -> None:
        shape, mode = row.key
        if reply.get("peak_bytes") is not None:
            self.write_kind("peak", w, shape=shape, mode=mode, bytes=int(reply["peak_bytes"]))
        calls = reply.get("calls") or []
        if not calls:
            return
        totals: dict[str, list] = {}
        for i, kernels in enumerate(calls):
            for stage in self.exp.stages:
                self.write_kind("stage", w, shape=shape, mode=mode, i=i, stage=stage,
                                ms=sum(ms for _, ms, st in kernels if st == stage))
            self.write_kind("device", w, shape=shape, mode=mode, i=i, ms=sum(ms for _, ms, _ in kernels))
            for name, ms, _ in kernels:
                t = totals.setdefault(name, [0.0, 0])
                t[0] += ms
                t[1] += 1
        self.write_kind("kernels", w, shape=shape, mode=mode, iters=len(calls), kernels=totals)

    # --- training rows -----------------------------------------------------------------------------
    def measure_training_row(self, trow) -> None:
        row = RowPlan({"name": trow.name, "steps": trow.steps}, TRAIN_MODE, {"eager"})
        if (*row.key, "eager") in self.known.row_ends:
            return
        self.ensure_pairs(self.spec.pairs)
        job_row, tokens = self.training_job_row(self.loaded, trow), trow.B * trow.T
        self.train_prepare([p for p in self.pairs if p.alive], row, job_row, tokens)
        self.write(RowMethod(self.attempt, trow.name, TRAIN_MODE, "eager", ["eager"],
                             "optimizer steps are timed eagerly", {"B": trow.B, "T": trow.T}))
        self.rounds(row, "eager", gated=True, graph=False)
        config = {k: v for k, v in job_row.items() if k != "model_file"}
        for pair in self.live_pairs(row.key):
            for w in pair.workers:
                try:
                    reply = w.request({"cmd": "train_end", "name": trow.name}, TIMEOUTS["other"])
                except WorkerLost as e:
                    self.lose(pair, e)
                    break
                if reply.get("ok"):
                    summary = {k: reply.get(k) for k in ("first_loss", "final_loss", "peak_bytes", "params")}
                    self.write_kind("train_row", w, row=trow.name, tokens=tokens, config=config, **summary)
            pair.rows.discard(row.key)

    def train_prepare(self, pairs: list[Pair], row: RowPlan, job_row: dict, tokens: int) -> list[Pair]:
        """Each pair in turn builds the training row (model, optimizer, warm-up steps); the first pair
        that device memory cannot hold beside the others ends it. Returns the pairs that joined."""
        self.training_jobs[row.key] = (job_row, tokens)
        footprint, memory = 0, None  # the largest warm-up peak of a worker so far, the latest reading
        joined = []
        for pair in pairs:
            fit, why = pairs_that_fit([(pair.id, len(pair.workers))], memory, footprint)
            if not fit:  # pairs prepare one after the other: the first that does not fit ends it
                self.at_once[row.key] = (sum(1 for p in self.pairs if row.key in p.rows), why)
                self.progress.message(f"{row.name}: pairs from {pair.id} on left out of this row: {why}")
                break
            ok = True
            for w in pair.workers:
                try:
                    reply = w.request({"cmd": "train_prepare", "row": job_row}, TIMEOUTS["prepare"])
                except WorkerLost as e:
                    self.lose(pair, e)
                    ok = False
                    break
                if reply.get("memory"):
                    memory = reply["memory"]
                    footprint = max(footprint, memory["peak_reserved"])
                if not reply.get("ok"):
                    self.write_kind("failure", w, shape=row.key[0], mode=TRAIN_MODE, error=reply.get("error"),
                                    trace=reply.get("trace"))
                    ok = False
                    break
                self.write(RowPrepared(self.attempt, w.id, pair.id, w.side, row.key[0], TRAIN_MODE,
                                       reply.get("configs") or {}))
                for i, (ms, loss) in enumerate(reply["steps"]):
                    self.write_kind("train_step", w, row=row.key[0], step=i, warmup=True, ms=ms, loss=loss,
                                    tokens=tokens)
            if ok:
                pair.rows.add(row.key)
                joined.append(pair)
        return joined

    def more_training_pairs(self, row: RowPlan, n: int) -> list[Pair]:
        """n fresh pairs for a training row, built as the first were (train_prepare)."""
        new = [] if self.cannot_start else self.start_pairs(n)
        job_row, tokens = self.training_jobs[row.key]
        return self.train_prepare(new, row, job_row, tokens) if new else []

    # --- the whole measurement ---------------------------------------------------------------------
    def run(self) -> None:
        rows = [RowPlan(s.model_dump(exclude_none=True), m, gated_bases(self.exp, s.name, m))
                for s in self.settings.shapes for m in self.exp.modes]
        self.write(MeasureStart(self.attempt, ENGINE, self.spec.model_dump()))
        self.progress.measure_plan([r.name for r in rows] + [f"{t.name}/{TRAIN_MODE}" for t in self.settings.training],
                                   self.spec.pairs, len(self.sides))
        try:
            for row in rows:
                check_unmoved(self.revisions)
                self.measure_row(row)
            for trow in self.settings.training:
                check_unmoved(self.revisions)
                self.measure_training_row(trow)
            # profiled calls only after every timed round (extras: the profiler slows a process for good)
            for row in rows:
                check_unmoved(self.revisions)
                self.extras(row)
            check_unmoved(self.revisions)
        finally:
            for pair in list(self.pairs):
                self.end_pair(pair)
            for pair in list(self.pairs):
                for w in pair.workers:
                    w.kill()


def run_measurement(loaded: LoadedExperiment, revisions: Revisions, run_dir: Path, settings, profile_root: Path,
                    log=print) -> None:
    """Measure every row of `settings` (a harness.measure.sides.BenchSettings) with the lockstep engine into
    run_dir/samples.jsonl, resuming what an earlier session left."""
    Driver(loaded, revisions, run_dir, settings, profile_root, as_progress(log)).run()
