"""harness/records.py: appends that cannot tear into a valid-looking record, and readers that
quarantine damaged lines (with a Damage naming file and line) instead of crashing."""
from __future__ import annotations

import json

import pytest
from pydantic import Field

from harness import records as R
from harness.records import Damage, append_jsonl, completed_blocks, load_blocks, load_measurement, read_jsonl

SAMPLE = {"type": "sample", "block": 0, "side": "baseline", "attempt": "a0", "shape": "s", "mode": "fwd", "i": 0}


def write_block(path, index: int, side: str, attempt: str, ms: list[float], end: bool = True) -> None:
    base = {"block": index, "side": side, "attempt": attempt}
    append_jsonl(path, {"type": "block_start", **base, "t": "x"})
    for i, v in enumerate(ms):
        append_jsonl(path, {"type": "sample", **base, "shape": "s", "mode": "fwd", "i": i, "ms": v})
    if end:
        append_jsonl(path, {"type": "block_end", **base, "status": "ok", "error": None})


def test_torn_last_line_is_skipped_and_the_next_append_starts_a_fresh_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    write_block(path, 0, "baseline", "a0", [1.0, 2.0])
    write_block(path, 1, "candidate", "a1", [3.0])
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # a kill mid-write, then the file cut by 40 bytes: block 1 has no end
    damage: list[Damage] = []
    assert [b.index for b in completed_blocks(path, damage)] == [0]
    assert len(damage) == 1 and damage[0].line == 7 and "torn last line" in damage[0].problem

    write_block(path, 1, "candidate", "a2", [4.0])  # the resume re-runs block 1
    damage = []
    blocks = completed_blocks(path, damage)
    assert [(b.index, b.attempt, b.samples[("s", "fwd")]) for b in blocks] == [(0, "a0", [1.0, 2.0]),
                                                                               (1, "a2", [4.0])]
    assert [d.line for d in damage] == [7] and "not a JSON line" in damage[0].problem
    # the fragment stays on a line of its own: nothing was glued onto it
    lines = path.read_bytes().split(b"\n")
    assert lines[6] == data[:-40].split(b"\n")[6] and json.loads(lines[7])["type"] == "block_start"
    # and every later read (a later resume) still works
    assert [b.index for b in completed_blocks(path)] == [0, 1]


def test_a_prefix_of_a_record_is_never_read_as_a_record(tmp_path):
    path = tmp_path / "samples.jsonl"
    line = json.dumps({**SAMPLE, "ms": 12.5}, sort_keys=True)
    for cut in range(1, len(line)):
        path.write_text(line[:cut] + "\n")
        assert read_jsonl(path, []) == [], line[:cut]


def test_garbled_middle_line_is_quarantined_and_later_records_still_read(tmp_path):
    path = tmp_path / "samples.jsonl"
    write_block(path, 0, "baseline", "a0", [1.0, 2.0, 3.0])
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = '{"type": "sample", "blo#k": 0, garbage\n'
    path.write_text("".join(lines))
    write_block(path, 1, "candidate", "a1", [5.0])
    damage: list[Damage] = []
    blocks = completed_blocks(path, damage)
    assert [b.index for b in blocks] == [0, 1]
    assert blocks[0].samples[("s", "fwd")] == [1.0, 3.0]
    assert [(d.line, d.problem.split(" ")[0]) for d in damage] == [(3, "not")]


@pytest.mark.parametrize("record, problem", [
    ({"type": "sample"}, "attempt: Field required"),
    ({**SAMPLE, "ms": "abc"}, "ms: Input should be a valid number"),
    ({**SAMPLE, "ms": -1.5}, "ms: Input should be greater than or equal to 0"),
    ({**SAMPLE, "ms": True}, "ms: Input should be a valid number"),
    ({**SAMPLE, "block": "0", "ms": 1.0}, "block: Input should be a valid integer"),
    ({"type": "block_end", "block": 0, "side": "baseline", "attempt": "a0", "status": "maybe"}, "status"),
    ({"block": 0, "ms": 1.0}, "no record type"),
])
def test_record_with_missing_or_invalid_fields_is_quarantined(tmp_path, record, problem):
    path = tmp_path / "samples.jsonl"
    append_jsonl(path, record)
    append_jsonl(path, {**SAMPLE, "ms": 2.0})
    damage: list[Damage] = []
    assert read_jsonl(path, damage) == [{**SAMPLE, "ms": 2.0}]
    assert len(damage) == 1 and damage[0].line == 1 and problem in damage[0].problem, damage


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_ms_is_quarantined(tmp_path, literal):
    path = tmp_path / "samples.jsonl"
    text = json.dumps({**SAMPLE, "ms": 0.0}).replace("0.0", literal)
    path.write_text(text + "\n")
    damage: list[Damage] = []
    assert read_jsonl(path, damage) == []
    assert "finite number" in damage[0].problem


def test_non_utf8_line_is_quarantined(tmp_path):
    path = tmp_path / "samples.jsonl"
    append_jsonl(path, {**SAMPLE, "ms": 1.0})
    with path.open("ab") as f:
        f.write(b'{"type": "sample", "shape": "\xff\xfe"}\n')
    append_jsonl(path, {**SAMPLE, "i": 1, "ms": 2.0})
    damage: list[Damage] = []
    assert [r["ms"] for r in read_jsonl(path, damage)] == [1.0, 2.0]
    assert damage[0].line == 2 and damage[0].problem.startswith("not UTF-8 text")


def test_directory_in_place_of_the_file_is_damage_not_a_crash(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.mkdir()
    damage: list[Damage] = []
    assert completed_blocks(path, damage) == []
    assert damage == [Damage(str(path), 0, "not a regular file: no records read from it")]
    with pytest.raises(IsADirectoryError) as e:
        append_jsonl(path, {**SAMPLE, "ms": 1.0})
    assert e.value.filename == str(path)


def test_block_with_a_damaged_block_end_is_incomplete_so_a_resume_reruns_it(tmp_path):
    path = tmp_path / "samples.jsonl"
    write_block(path, 0, "baseline", "a0", [1.0])
    text = path.read_text().replace('"status": "ok"', '"status": 7')
    path.write_text(text)
    assert completed_blocks(path, []) == []
    assert [b.complete for b in load_blocks(path, [])] == [False]


def test_unknown_record_types_pass_unchecked_and_block_readers_ignore_them(tmp_path):
    path = tmp_path / "samples.jsonl"
    append_jsonl(path, {"type": "future_kind", "pair": 0, "x": 3})  # a type this reader does not know
    write_block(path, 0, "baseline", "a0", [1.0])
    damage: list[Damage] = []
    assert read_jsonl(path, damage)[0] == {"type": "future_kind", "pair": 0, "x": 3} and damage == []
    assert [b.index for b in completed_blocks(path)] == [0]


def test_a_new_record_type_is_checked_once_added_to_the_table(tmp_path, monkeypatch):
    class FutureRecord(R.Record):
        step: R.Index
        ms: R.Ms = Field(default=0.0)

    monkeypatch.setitem(R.RECORD_TYPES, "future_kind", FutureRecord)
    path = tmp_path / "samples.jsonl"
    append_jsonl(path, {"type": "future_kind", "step": 3, "ms": 1.0})
    append_jsonl(path, {"type": "future_kind", "step": -1})
    damage: list[Damage] = []
    assert read_jsonl(path, damage) == [{"type": "future_kind", "step": 3, "ms": 1.0}]
    assert "step: Input should be greater than or equal to 0" in damage[0].problem


def test_damage_is_logged_once_when_no_list_is_given(tmp_path, caplog):
    path = tmp_path / "samples.jsonl"
    path.write_text("not json\n")
    for _ in range(3):
        assert read_jsonl(path) == []
    assert [r.getMessage() for r in caplog.records] == [f"quarantined {path}:1: not a JSON line 'not json'"]


def test_lockstep_records_with_damaged_lines_keep_every_whole_round(tmp_path):
    """The lockstep engine's records (harness/measure/model.py) are checked too: a burst with a NaN
    or an empty ms list, or a garbled round line, drops that round only."""
    from harness.measure import model
    from harness.records import load_measurement

    path = tmp_path / "samples.jsonl"
    append_jsonl(path, model.MeasureStart("s1", model.ENGINE, {}).to_json())
    for w, side in enumerate(("baseline", "candidate")):
        append_jsonl(path, model.WorkerStart("s1", w, 0, side).to_json())
    for r in range(4):
        for w, side in enumerate(("baseline", "candidate")):
            burst = model.Burst("s1", w, 0, side, "small", "fwd", "eager", r, [2.0, 2.0] if w == 0 else [1.0, 1.0])
            line = burst.to_json()
            if (r, side) == (1, "candidate"):
                line["ms"] = [float("nan")]
            if (r, side) == (2, "baseline"):
                line["ms"] = []
            append_jsonl(path, line)
        if r == 3:
            with path.open("ab") as f:
                f.write(b'{"type": "round", "attempt": "s1", "pa\n')
        else:
            append_jsonl(path, model.RoundDone("s1", 0, "small", "fwd", "eager", r).to_json())
    damage: list[Damage] = []
    m = load_measurement(path, damage)
    series = m.series[("small", "fwd", "eager")]
    assert len(series.pairs[0]) == 1 and series.pairs[0][0].base == [2.0, 2.0]  # round 0: the only whole one
    assert [d.problem.split(":")[0] for d in damage] == ["burst record", "burst record", "not a JSON line '{\"type\""]
    assert "ms.0: Input should be a finite number" in damage[0].problem
    assert "ms: List should have at least 1 item" in damage[1].problem


def test_resume_after_a_torn_last_line_and_a_garbled_middle_line_completes_and_resumes_again(temp_repo):
    """End to end: a finished run's samples.jsonl cut by 40 bytes (its last block_end torn) and one
    line in the middle garbled; `harness run --resume` re-runs only the torn block, a second resume
    (every later one) still works, and the report lists both damaged lines."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "harness", "run", str(exp), "--run-id", "r1", *extra,
                               "--profile-root", str(temp_repo.root / "profile"),
                               "--reports-root", str(temp_repo.root / "reports")],
                              cwd=temp_repo.root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                              text=True, timeout=600)

    exp = temp_repo.experiment("torn", "main", "- {kind: speedup, name: e, row: small, mode: fwd, threshold: 1.25}\n",
                               blocks=3, samples=2, engine="blocks")
    first = run()
    assert first.returncode in (0, 1, 3), first.stdout + first.stderr
    samples = temp_repo.root / "profile" / "torn" / "runs" / "r1" / "samples.jsonl"
    before = {b.index: b.attempt for b in completed_blocks(samples)}
    assert sorted(before) == list(range(6))
    data = samples.read_bytes()[:-40]
    lines = data.split(b"\n")
    garbled = next(i for i, line in enumerate(lines) if b'"sample"' in line and b'"block": 1,' in line)
    lines[garbled] = lines[garbled][:25] + b"#" + lines[garbled][26:]
    samples.write_bytes(b"\n".join(lines))

    second = run("--resume")
    assert second.returncode in (0, 1, 3), second.stdout + second.stderr
    assert "Traceback" not in second.stderr
    after = completed_blocks(samples)
    assert [b.index for b in after] == list(range(6))
    assert [b.index for b in after if b.attempt != before[b.index]] == [5]  # only the torn block ran again
    third = run("--resume")
    assert third.returncode == second.returncode, third.stdout + third.stderr
    [report] = (temp_repo.root / "reports" / "torn").glob("*/report.json")
    damage = json.loads(report.read_text())["damage"]
    assert [d["line"] for d in damage] == [garbled + 1, len(lines)]
    assert "not a JSON line" in damage[0]["problem"] and "not a JSON line" in damage[1]["problem"]


def test_autotune_choices_of_every_worker_add_up_over_the_run(tmp_path):
    """row_prepared records (measure/model.py) carry what a worker tuned since its last report: the
    reader merges them per worker and remembers the row that first tuned each kernel and key, and
    the report's section lists where workers differ."""
    from harness import analyse
    from harness.measure.model import MeasureStart, RowPrepared

    path = tmp_path / "samples.jsonl"
    recs = [MeasureStart("a1", "lockstep", {}),
            RowPrepared("a1", 0, 0, "baseline", "big", "fwd", {"k.f": {"(64,)": "B: 32"}}),
            RowPrepared("a1", 1, 0, "candidate", "big", "fwd", {"k.f": {"(64,)": "B: 32"}}),
            RowPrepared("a1", 0, 0, "baseline", "big", "fwdbwd", {"k.g": {"(64,)": "w: 4"}}),
            RowPrepared("a1", 1, 0, "candidate", "big", "fwdbwd", {}),
            RowPrepared("a1", 1, 0, "candidate", "small", "fwdbwd", {"k.g": {"(64,)": "w: 8"}})]
    for r in recs:
        append_jsonl(path, r.to_json())
    m = load_measurement(path)
    assert m.configs[1] == ("candidate", {"k.f": {"(64,)": "B: 32"}, "k.g": {"(64,)": "w: 8"}})
    assert m.config_rows == {("k.f", "(64,)"): "big/fwd", ("k.g", "(64,)"): "big/fwdbwd"}
    section = analyse._autotune_section(m)
    assert section == {"rows": 2, "workers": 2, "tuned": 2, "differences": [
        {"row": "big/fwdbwd", "kernel": "k.g", "key": "(64,)", "by_side": {"baseline": {"w: 4": 1}, "candidate": {"w: 8": 1}}}]}
