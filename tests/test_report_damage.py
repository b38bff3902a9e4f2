"""`harness report` / `compare` / `run` on damaged records (harness/analyse.py, harness/report.py):
a damaged line is quarantined and listed in the report; a damaged run.json is refused (exit 2)
naming the file; another experiment's damaged report never breaks this one's report or the index."""
from __future__ import annotations

import json
import shutil

import pytest

from harness.cli import main
from test_report import build_run_dir
from test_report_schema import _errors

GOOD_SAMPLE = {"type": "sample", "block": 0, "side": "baseline", "attempt": "a0", "shape": "S1", "mode": "fwd", "i": 0}
DAMAGE = {
    # name: (bytes written as one line in the middle of samples.jsonl, problem named in the report)
    "garbled": (b'{"type": "sample", "block": 0, "sid', "not a JSON line"),
    "no_attempt": (b'{"type": "sample"}', "sample record: block: Field required"),
    "ms_text": (json.dumps({**GOOD_SAMPLE, "ms": "abc"}).encode(), "ms: Input should be a valid number"),
    "ms_nan": (json.dumps({**GOOD_SAMPLE, "ms": float("nan")}).encode(), "ms: Input should be a finite number"),
    "ms_negative": (json.dumps({**GOOD_SAMPLE, "ms": -3.0}).encode(), "ms: Input should be greater than or equal to 0"),
    "not_utf8": (b'{"type": "sample", "shape": "\xc3\x28"}', "not UTF-8 text"),
}


def report_args(loaded, tmp_path) -> list[str]:
    return ["report", str(loaded.path), "--profile-root", str(tmp_path / "profile"),
            "--reports-root", str(tmp_path / "reports")]


def published(tmp_path, run_dir) -> tuple[dict, str]:
    out = tmp_path / "reports" / "demo-report" / run_dir.name
    return json.loads((out / "report.json").read_text()), (out / "index.html").read_text()


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_report_quarantines_a_damaged_samples_line_and_lists_it(tmp_path, capsys, kind):
    loaded, run_dir = build_run_dir(tmp_path)
    samples = run_dir / "samples.jsonl"
    lines = samples.read_bytes().split(b"\n")
    raw, problem = DAMAGE[kind]
    lines.insert(5, raw)  # inside block 0
    samples.write_bytes(b"\n".join(lines))
    assert main(report_args(loaded, tmp_path)) == 1  # the verdict of the good records: NO-GO
    assert "Traceback" not in capsys.readouterr().err
    data, html = published(tmp_path, run_dir)
    assert [(d["file"], d["line"]) for d in data["damage"]] == [(str(samples), 6)]
    assert problem in data["damage"][0]["problem"]
    assert 'id="damage"' in html and "Damaged records were not read (1)" in html and f"{samples}:6" in html
    assert _errors(data) == []  # docs/report.schema.json declares the damage list


def test_report_of_a_run_whose_samples_file_is_a_folder_lists_it(tmp_path):
    loaded, run_dir = build_run_dir(tmp_path)
    (run_dir / "samples.jsonl").unlink()
    (run_dir / "samples.jsonl").mkdir()
    assert main(report_args(loaded, tmp_path)) == 3  # no blocks: INCONCLUSIVE
    data, _ = published(tmp_path, run_dir)
    assert data["damage"] == [{"file": str(run_dir / "samples.jsonl"), "line": 0,
                               "problem": "not a regular file: no records read from it"}]


def test_damaged_phase_record_reads_as_missing_and_is_listed(tmp_path):
    loaded, run_dir = build_run_dir(tmp_path)
    (run_dir / "verify.json").write_bytes(b'{"gates": {"correctness": ')
    assert main(report_args(loaded, tmp_path)) == 1
    data, _ = published(tmp_path, run_dir)
    assert [d["file"] for d in data["damage"]] == [str(run_dir / "verify.json")]
    assert data["damage"][0]["problem"].startswith("unreadable: ") and "read as missing" in data["damage"][0]["problem"]


@pytest.mark.parametrize("content, problem", [
    (b'{"run_id": "x", "cpu_mode": tr', "is damaged (unreadable: "),
    (b"\xff\xfe{}", "is damaged (unreadable: "),
    (b"[]", "is damaged (not a JSON object but list)"),
    (b"{}", "lacks run_id, experiment, cpu_mode, plan (damaged): no report can say what this run measured"),
])
def test_report_refuses_a_damaged_run_json_naming_it(tmp_path, capsys, content, problem):
    loaded, run_dir = build_run_dir(tmp_path)
    (run_dir / "run.json").write_bytes(content)
    assert main(report_args(loaded, tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / 'run.json'} " in err and problem in err and "Traceback" not in err
    assert not (tmp_path / "reports" / "demo-report" / run_dir.name / "report.json").exists()


def test_compare_builds_from_a_run_folder_with_damaged_lines(tmp_path, capsys):
    loaded, run_dir = build_run_dir(tmp_path)
    with (run_dir / "samples.jsonl").open("ab") as f:
        f.write(b'{"type": "sample"}\n\xff\n')
    out = tmp_path / "cmp.html"
    assert main(["compare", str(run_dir), str(run_dir), "--out", str(out)]) == 0
    assert "S1/fwd" in capsys.readouterr().out and out.is_file()


@pytest.mark.parametrize("content", [b"{}", b"[]", b"null", b'{"experiment": 5, "run": []}', b"\xff"])
def test_another_experiments_damaged_report_never_breaks_a_report_or_the_index(tmp_path, capsys, content):
    loaded, run_dir = build_run_dir(tmp_path)
    other = tmp_path / "reports" / "other-exp" / "r9"
    other.mkdir(parents=True)
    (other / "report.json").write_bytes(content)
    assert main(report_args(loaded, tmp_path)) == 1
    index = (tmp_path / "reports" / "index.html").read_text()
    assert f"demo-report/{run_dir.name}/index.html" in index and "other-exp/r9" not in index
    assert "Traceback" not in capsys.readouterr().err


def test_a_report_rendered_while_a_run_holds_the_folder_writes_nothing_into_it(tmp_path):
    from harness.runlock import run_lock

    loaded, run_dir = build_run_dir(tmp_path)
    before = sorted(p.name for p in run_dir.iterdir())
    with run_lock(run_dir, command="harness run (in progress)"):
        assert main(report_args(loaded, tmp_path)) == 1
        assert sorted(p.name for p in run_dir.iterdir()) == sorted(before + ["run.lock"])
    shutil.rmtree(tmp_path / "reports")
