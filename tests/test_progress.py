"""Progress of `harness run` (harness/progress.py): the quiet, line-oriented output is a committed
snapshot (time injected, so it is deterministic) and holds no control characters; the ETA comes from
the blocks finished; and `harness run --quiet` end to end writes plain lines only."""
from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest

from harness.measure.blocks import SamplesTail
from harness.progress import Progress, QuietProgress, RichProgress, as_progress, make_progress, plain
from harness.records import Block

from test_e2e import SPEEDUP_GATE, run_exp

SNAPSHOT = Path(__file__).parent / "snapshots" / "quiet_progress.txt"
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # anything but \n (no tabs either in our lines)
ROWS = [("small", "fwd", 3), ("small", "fwdbwd", 3), ("large", "fwd", 3)]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def block(index: int, side: str, scale: float, status: str = "ok", error: str | None = None) -> Block:
    b = Block(index=index, side=side, attempt=f"att{index}", status=status, error=error)
    if status == "ok":
        b.samples = {("small", "fwd"): [1.0 * scale, 1.2 * scale, 1.1 * scale],
                     ("small", "fwdbwd"): [3.0 * scale, 3.3 * scale, 3.1 * scale],
                     ("large", "fwd"): [250.0 * scale, 260.0 * scale, 255.0 * scale]}
    return b


def drive(p: Progress, clock: Clock) -> None:
    """A resumed run of 5 blocks: block 1 done before, then two good blocks, a crashed one, a good one."""
    p.phase("resolve")
    p.message("resuming run 20260101T000000Z-abcd (42 records so far)")
    clock.t += 2.0
    p.phase("verify")
    p.message("verify: candidate: correctness PASS, \x1b[32mgreen\x1b[0m text\r with a carriage return")
    clock.t += 1.5
    p.phase("bench")
    p.bench_plan(5, [block(0, "baseline", 1.0)])
    plan = [(1, "candidate", "1a2b3c4d5e", 0.5, 10.0), (2, "candidate", "1a2b3c4d5e", 0.5, 14.0),
            (3, "baseline", "9f8e7d6c5b", None, 3.0), (4, "baseline", "9f8e7d6c5b", 1.0, 12.0)]
    for index, side, sha, scale, seconds in plan:
        p.block_started(index, 5, side, sha, ROWS)
        for shape, mode, n in ROWS:
            for done in range(1, n + 1):
                clock.t += seconds / 9
                p.row_progress(shape, mode, done, n)
                if scale is None:
                    break
            if scale is None:
                break
        if scale is None:
            p.block_finished(block(index, side, 1.0, "failed", "worker exited -9: Killed\nTraceback ..."))
        else:
            p.block_finished(block(index, side, scale))
    clock.t += 0.7
    p.phase("report")
    p.message("verdict: GO  report: reports/exp/20260101T000000Z-abcd/index.html")
    clock.t += 0.3
    p.close()


def quiet_output() -> str:
    clock, out = Clock(), io.StringIO()
    drive(QuietProgress(stream=out, clock=clock), clock)
    return out.getvalue()


def test_quiet_output_matches_snapshot():
    text = quiet_output()
    if os.environ.get("HARNESS_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), "quiet progress changed; HARNESS_UPDATE_SNAPSHOTS=1 rewrites the snapshot"


def test_quiet_output_has_no_control_characters():
    text = quiet_output()
    assert "\x1b" not in text and "\r" not in text
    assert not CONTROL.search(text)
    assert "green text with a carriage return" in text  # the message's escapes dropped, its words kept
    assert plain("\x1b[1;31mbold\x1b[0m\ta\rb\x07") == "bold\tab"


def test_eta_is_the_mean_finished_block_times_blocks_left():
    clock = Clock()
    p = Progress(clock=clock)
    p.bench_plan(6, [block(0, "baseline", 1.0)])  # resumed: 5 blocks left to run
    assert p.eta() is None  # nothing finished by this process yet
    p.block_started(1, 6, "candidate", "c", ROWS)
    clock.t += 10
    p.block_finished(block(1, "candidate", 0.5))
    assert p.eta() == pytest.approx(40.0)  # 10 s x 4 blocks
    p.block_started(2, 6, "candidate", "c", ROWS)
    clock.t += 20
    p.block_finished(block(2, "candidate", 0.5))
    assert p.eta() == pytest.approx(45.0)  # mean 15 s x 3 blocks
    p.block_started(3, 6, "baseline", "b", ROWS)
    clock.t += 5
    assert p.eta() == pytest.approx(40.0)  # less the 5 s the running block has already taken
    clock.t += 100
    assert p.eta() == pytest.approx(30.0)  # an overdue block counts as done, never negative
    # medians pool the samples of finished good blocks per side, the resumed block included
    rows = {(s, m): (b, c, r) for s, m, b, c, r in p.median_rows()}
    assert rows[("small", "fwd")] == pytest.approx((1.1, 0.55, 2.0))


def test_a_plain_log_callable_gets_quiet_lines():
    lines: list[str] = []
    p = as_progress(lines.append)
    assert isinstance(p, QuietProgress) and as_progress(p) is p
    p.phase("bench")
    p("free-form \x1b[2Kline")
    assert lines == ["[phase] bench (at 0.0 s)", "free-form line"]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mode_choice(monkeypatch):
    monkeypatch.delenv("HARNESS_QUIET", raising=False)
    assert isinstance(make_progress(stream=io.StringIO()), QuietProgress)  # not a terminal
    assert isinstance(make_progress(quiet=True, stream=FakeTTY()), QuietProgress)
    monkeypatch.setenv("HARNESS_QUIET", "1")
    assert isinstance(make_progress(stream=FakeTTY()), QuietProgress)
    monkeypatch.setenv("HARNESS_QUIET", "0")
    live = make_progress(stream=FakeTTY())
    assert isinstance(live, RichProgress)
    live.close()


def test_rich_display_renders_every_event():
    from rich.console import Console

    out = io.StringIO()
    clock = Clock()
    p = RichProgress(console=Console(file=out, force_terminal=True, width=100), clock=clock, auto_refresh=False)
    drive(p, clock)
    text = plain(out.getvalue())
    for word in ("medians so far", "base/cand", "large", "2.000x", "block 4 baseline failed", "verdict: GO"):
        assert word in text, word


def test_samples_tail_counts_one_attempt_and_skips_torn_lines(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"type": "sample", "attempt": "old", "shape": "s", "mode": "fwd", "i": 0, "ms": 1}) + "\n")
    tail = SamplesTail(path, "new")
    assert tail.poll() == {}
    rec = lambda i, att="new": json.dumps({"type": "sample", "attempt": att, "shape": "s", "mode": "fwd", "i": i, "ms": 1})
    with path.open("a") as f:
        f.write(rec(0) + "\n" + rec(0, "other") + "\n" + rec(1) + "\n" + rec(2)[:20])  # a line still being written
    assert tail.poll() == {("s", "fwd"): 2}
    with path.open("a") as f:
        f.write(rec(2)[20:] + "\n")
    assert tail.poll() == {("s", "fwd"): 3}


def test_harness_run_quiet_writes_plain_lines(temp_repo):
    temp_repo.branch("fast", work=2)
    exp = temp_repo.experiment("quiet", "fast", SPEEDUP_GATE, samples=3)
    res = run_exp(temp_repo, exp, "--quiet")
    assert res.returncode in (0, 1, 3), res.stdout + res.stderr
    for stream in (res.stdout, res.stderr):
        assert "\x1b" not in stream and "\r" not in stream and not CONTROL.search(stream), stream
    lines = res.stdout.splitlines()
    for expected in ("[phase] resolve", "[phase] bench", "[measure] 1 rows, 3 worker pairs of 2 processes",
                     "[row] small/fwd eager: rounds with 3 pairs", "[phase] report", "verdict: "):
        assert any(line.startswith(expected) for line in lines), (expected, res.stdout)
    # what ends the row depends on the CPU's noise (a quiet machine resolves it): any reason, one line
    assert any(re.fullmatch(r"\[row\] small/fwd eager: speedup [\d.]+x \[[\d.]+, [\d.]+\]; "
                            r"(resolved|budget|limit): .* \(at .*\)", line) for line in lines), res.stdout
    assert any(line.startswith("[end] elapsed ") for line in lines)


def test_harness_run_quiet_lines_of_the_blocks_engine(temp_repo):
    temp_repo.branch("fast", work=2)
    exp = temp_repo.experiment("quiet-blocks", "fast", SPEEDUP_GATE, samples=3, engine="blocks")
    res = run_exp(temp_repo, exp, "--quiet")
    assert res.returncode in (0, 1, 3), res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for expected in ("[phase] resolve", "[phase] bench", "[bench] 6 blocks, 0 already complete, 6 to run",
                     "[block 1/6] baseline", "[block 6/6] candidate", "[phase] report", "verdict: "):
        assert any(line.startswith(expected) for line in lines), (expected, res.stdout)
    assert any(re.fullmatch(r"\[block 3/6\] small/fwd: 3/3 samples", line) for line in lines), res.stdout
    assert any(re.fullmatch(r"\[block 6/6\] candidate \w{10}: [\d.]+ s \(eta 0\.0 s, 0 to go\)", line)
               for line in lines), res.stdout
    table = lines.index("medians so far (ms; pooled samples of finished blocks):")
    assert lines[table + 1].split() == ["shape", "mode", "baseline", "candidate", "base/cand"]
    assert lines[table + 2].split()[:2] == ["small", "fwd"]
    assert any(line.startswith("[end] elapsed ") for line in lines)
