"""report.json from a real run directory, and the HTML rendered from it (harness/analyse.py,
harness/report.py). The run directory is written the way the worker writes it: run.json plus
samples.jsonl through records.append_jsonl."""
from __future__ import annotations

import json
import random
import re
import textwrap
from pathlib import Path

import pytest

from harness import analyse, report
from harness.measure.blocks import block_plan
from harness.records import append_jsonl
from harness.spec import load_experiment

XSS = "<script>alert(1)</script>"
BRANCH = "feat/x<script>window.__pwned=1<"  # git allows < > ( ) = in ref names
KERNEL = "chunk_bwd_<img src=x onerror=window.__pwned=2>_kernel"
SUBJECT = 'bwd: fuse dAqk "on chip" & drop <partials>'

EXPERIMENT = textwrap.dedent("""\
    name: demo-report
    description: "Candidate halves the time. {xss}"
    target: {{op: "kernels.pkda:pkda", inputs: "inputs.py:make_inputs"}}
    baseline: {{ref: "0123456789abcdef0123456789abcdef01234567"}}
    candidate: {{ref: "feat/fast"}}
    modes: [fwd, fwdbwd]
    shapes:
      - {{name: S1, B: 1, T: 256, H: 2, K: 32, V: 32}}
      - {{name: S2, B: 2, T: 128, H: 2, K: 32, V: 32}}
    blocks: 4
    samples_per_block: 8
    stages:
      bwd.intra: {{baseline: ["chunk_bwd"], candidate: ["chunk_bwd"]}}
    gates:
      - {{name: s1-speedup, kind: speedup, row: S1, mode: fwdbwd, threshold: 1.5}}
      - {{name: s1-device, kind: speedup, row: S1, mode: fwdbwd, threshold: 1.5, basis: device}}
      - {{name: geomean-fwdbwd, kind: geomean, rows: [S1, S2], mode: fwdbwd, threshold: 1.2}}
      - {{name: peak-down, kind: peak_alloc, rows: [S1], mode: fwdbwd, min_reduction_bytes: "1024"}}
      - {{name: frozen, kind: frozen_paths}}
    {extra}""")
IMPOSSIBLE_GATE = "  - {name: s1-triple, kind: speedup, row: S1, mode: fwdbwd, threshold: 3.0}\n"

BASE_MS = {("S1", "fwd"): 2.0, ("S1", "fwdbwd"): 6.0, ("S2", "fwd"): 1.0, ("S2", "fwdbwd"): 3.0}
FAILED_BLOCK = 5  # a candidate block in the ABBA plan of 4 blocks a side
ROW_FAILURE = {"block": 2, "shape": "S2", "mode": "fwd", "error": "RuntimeError: out of resources: shared memory"}


def build_run_dir(tmp_path: Path, impossible_gate: bool = True) -> tuple[object, Path]:
    """An experiment file and one finished run of it: candidate 2x faster than baseline, one failed
    block, one failed row inside an ok block. Returns (loaded experiment, run dir)."""
    (tmp_path / "inputs.py").write_text("def make_inputs(shape, mode, dtype, device, seed):\n    return {}\n")
    exp_file = tmp_path / "demo-report.yaml"
    exp_file.write_text(EXPERIMENT.format(xss=XSS, extra=IMPOSSIBLE_GATE if impossible_gate else ""))
    loaded = load_experiment(exp_file)
    exp = loaded.exp
    run_dir = tmp_path / "profile" / exp.name / "runs" / "20260101T000000Z-abcd"
    plan = block_plan(exp.blocks, exp.order, exp.seed)
    run = {
        "run_id": run_dir.name, "experiment": exp.name, "experiment_file": str(exp_file),
        "experiment_yaml": exp_file.read_text(), "cpu_mode": True, "aa": False,
        "device": {"kind": "cpu", "name": "x86_64", "host": "testhost", "boost_sm_clock_mhz": 1980},
        "versions": {"python": "3.11.7", "torch": "2.13.0", "triton": "3.7.1", "cuda": None,
                     "harness_sha": "f" * 40},
        "host": "testhost", "commands": ["harness run demo-report.yaml"],
        "started": "2026-01-01T00:00:00+00:00", "finished": "2026-01-01T00:05:00+00:00",
        "revisions": {"repo": str(tmp_path),
                      "baseline": {"side": "baseline", "ref": exp.baseline.ref, "sha": exp.baseline.ref, "branch": None,
                                   "worktree": "/wt/b", "subject": "baseline: materialised dAqk"},
                      "candidate": {"side": "candidate", "ref": "feat/fast", "sha": "89abcdef" * 5, "branch": BRANCH,
                                    "worktree": "/wt/c", "subject": SUBJECT}},
        "plan": [{"block": i, "side": s} for i, s in enumerate(plan)],
        "timing": {"method": "wall", "l2_flush": False, "samples_per_block": exp.samples_per_block, "warmup": 1},
        "dtype": "float32", "slurm": None,
    }
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps(run))
    samples = run_dir / "samples.jsonl"
    rng = random.Random(7)
    for index, side in enumerate(plan):
        base = {"block": index, "side": side, "attempt": f"a{index}"}
        gpu = {"sm_clock_mhz": 1980 if index != 3 else 1200, "max_sm_clock_mhz": 1980, "temperature_c": 40 + index,
               "throttle_reasons": ["sw_thermal_slowdown"] if index == 3 else []}
        if index == 1:  # an idle GPU before the block: its idle clock is no low-clock block
            gpu = {**gpu, "sm_clock_mhz": 345, "throttle_reasons": ["gpu_idle"]}
        append_jsonl(samples, {"type": "block_start", **base, "t": f"2026-01-01T00:0{index}:00+00:00",
                               "host": "testhost", "pid": 100 + index, "gpu": gpu})
        if index == FAILED_BLOCK:
            append_jsonl(samples, {"type": "sample", **base, "shape": "S1", "mode": "fwd", "i": 0, "ms": 99.0})
            append_jsonl(samples, {"type": "block_end", **base, "t": None, "status": "failed", "gpu": None,
                                   "error": "worker exited -11: Segmentation fault"})
            continue
        drift = 1 + 0.01 * index
        for (shape, mode), ms in BASE_MS.items():
            if index == ROW_FAILURE["block"] and (shape, mode) == (ROW_FAILURE["shape"], ROW_FAILURE["mode"]):
                append_jsonl(samples, {"type": "failure", **base, "shape": shape, "mode": mode,
                                       "error": ROW_FAILURE["error"]})
                continue
            mean = ms * drift * (1.0 if side == "baseline" else 0.5)
            for i in range(exp.samples_per_block):
                append_jsonl(samples, {"type": "sample", **base, "shape": shape, "mode": mode, "i": i,
                                       "ms": mean * (1 + rng.gauss(0, 0.01))})
            peak = 1_000_000 if side == "baseline" else 995_904  # 4096 B less
            append_jsonl(samples, {"type": "peak", **base, "shape": shape, "mode": mode, "bytes": peak})
            if mode == "fwdbwd":
                for i in range(2):
                    append_jsonl(samples, {"type": "stage", **base, "shape": shape, "mode": mode, "i": i,
                                           "stage": "bwd.intra", "ms": mean * 0.3})
                    if index % 2 == 0:  # odd blocks stand for records written before `device` lines
                        append_jsonl(samples, {"type": "device", **base, "shape": shape, "mode": mode, "i": i,
                                               "ms": mean * 0.5})
                append_jsonl(samples, {"type": "kernels", **base, "shape": shape, "mode": mode, "iters": 2,
                                       "kernels": {KERNEL: [mean * 0.6, 2], "chunk_fwd_o": [mean * 0.4, 2]}})
        append_jsonl(samples, {"type": "block_end", **base, "t": f"2026-01-01T00:0{index}:30+00:00", "status": "ok",
                               "error": None, "gpu": gpu})
    # a crashed attempt of block 0 before the one that finished: never read as data
    append_jsonl(samples, {"type": "block_start", "block": 0, "side": "baseline", "attempt": "dead", "t": None,
                           "host": "testhost", "pid": 1, "gpu": None})
    append_jsonl(samples, {"type": "sample", "block": 0, "side": "baseline", "attempt": "dead", "shape": "S1",
                           "mode": "fwd", "i": 0, "ms": 1000.0})
    return loaded, run_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    loaded, run_dir = build_run_dir(tmp)
    data = analyse.build_report(loaded, run_dir)
    html_path = analyse.write_report(data, tmp / "reports" / loaded.exp.name / run_dir.name)
    return data, html_path


def _gate(data, name):
    return next(g for g in data["gates"] if g["name"] == name)


def test_report_json_numbers(built):
    data, html_path = built
    on_disk = json.loads((html_path.parent / "report.json").read_text())
    assert on_disk == data
    assert data["schema_version"] == analyse.SCHEMA_VERSION
    assert data["verdict"] == "NO-GO"
    # deciding gates are the FAIL ones only (frozen_paths is INCONCLUSIVE without freeze.json)
    assert [g["name"] for g in data["deciding_gates"]] == ["s1-triple"]
    assert _gate(data, "frozen")["status"] == "INCONCLUSIVE"
    assert data["terminal"] is None
    assert data["no_gpu_verdict"] == analyse.NO_GPU_VERDICT

    rows = {r["name"]: r for r in data["rows"]}
    s1 = rows["S1/fwdbwd"]
    # baseline ~6 ms (x drift), candidate half of it; the dead attempt's 1000 ms never counts
    assert 5.9 < s1["baseline"]["median"] < 6.3
    assert 2.95 < s1["candidate"]["median"] < 3.15
    # one candidate block failed: the blocks pair by position, and the summaries describe the very
    # pairs the interval is computed over (the fourth baseline block has no partner)
    assert s1["baseline"]["n"] == 3 * 8 and s1["candidate"]["n"] == 3 * 8
    assert set(s1["baseline"]) >= {"n", "median", "mean", "std", "min", "p10", "p90", "quantile_method"}
    assert 1.9 < s1["speedup"]["point"] < 2.1 and 1.8 < s1["speedup"]["lo"] <= s1["speedup"]["hi"] < 2.2
    assert s1["peak_bytes"] == {"baseline": 1_000_000, "candidate": 995_904, "delta": -4096,
                                "delta_fraction": pytest.approx(-0.004096)}
    assert s1["stages"][0]["stage"] == "bwd.intra" and s1["stages"][0]["speedup"]["point"] == pytest.approx(2.0, rel=0.05)
    assert s1["kernels"]["baseline"][0]["kernel"] == KERNEL
    # device time per call: the summed kernel time of each profiled call (half the block's mean time;
    # from `device` lines, or from the kernel table of blocks without them), its speedup and interval
    dv = s1["device_ms"]
    assert dv["baseline"] == pytest.approx(0.5 * s1["baseline"]["median"], rel=0.02)
    assert dv["baseline"] == pytest.approx(sum(k["ms_per_call"] for k in s1["kernels"]["baseline"]), rel=0.02)
    assert dv["ratio"] == dv["speedup"]["point"] and 1.8 < dv["ratio"] < 2.2
    assert dv["speedup"]["lo"] <= dv["ratio"] <= dv["speedup"]["hi"] and dv["speedup"]["n_blocks"] == 3
    dg = _gate(data, "s1-device")
    # it judges the very interval the row shows; the failed block keeps it from PASS as it does s1-speedup
    assert dg["numbers"]["basis"] == "device" and dg["numbers"]["lo"] == dv["speedup"]["lo"] > 1.5
    assert dg["status"] == _gate(data, "s1-speedup")["status"] == "INCONCLUSIVE" and "failure" in dg["reason"]
    assert 0 <= s1["mann_whitney_p"] < 0.01
    # the gate judged the very interval the row shows
    assert _gate(data, "s1-speedup")["numbers"]["lo"] == s1["speedup"]["lo"]

    failed = [b for b in data["blocks"] if b["status"] == "failed"]
    assert [b["index"] for b in failed] == [FAILED_BLOCK] and "Segmentation fault" in failed[0]["error"]
    assert any(f["block"] == FAILED_BLOCK and "Segmentation" in f["error"] for f in data["failures"])
    assert any(f.get("shape") == "S2" and f.get("mode") == "fwd" for f in data["failures"])
    assert [b["index"] for b in data["blocks"] if b["low_clock"]] == [3]
    assert {g["name"] for g in data["geomeans"]} >= {"geomean-fwdbwd", "all rows (fwd)", "all rows (fwdbwd)"}
    prov = data["provenance"]
    assert prov["candidate"]["branch"] == BRANCH and prov["bench_base"] is None  # nothing frozen in this run
    assert prov["versions"]["harness_sha"] == "f" * 40  # the harness SHA is provenance, not BENCH_BASE
    assert data["experiment"]["description"].endswith(XSS)


def test_html_escapes_and_is_self_contained(built):
    data, html_path = built
    html = html_path.read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert XSS not in html
    assert BRANCH not in html and "feat/x&lt;script&gt;window.__pwned=1&lt;" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror" in html
    assert "&lt;partials&gt;" in html
    # a CPU run's banner itself says it is a smoke test, not only the notice below it
    banner = html[html.index('id="verdict"'):html.index("</section>", html.index('id="verdict"'))]
    assert "CPU smoke test" in banner
    data_gpu = dict(data, no_gpu_verdict=None)
    assert 'id="cpu-smoke"' not in report.render_html(data_gpu)
    # no external resources: every src/href is a fragment, a relative path or absent
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", html, re.I)
    # exactly one script: the table sorter
    assert html.count("<script") == 1
    assert f'id="verdict-text">{data["verdict"]}<' in html
    assert "No GPU verdict" in html
    for anchor in ("gates", "rows", "speedup", "forest", "series", "peak", "stages", "failures", "frozen", "profile",
                   "ncu", "provenance", "gate-s1-triple", "row-S1-fwdbwd"):
        assert f'id="{anchor}"' in html, anchor
    assert html.index('id="verdict"') < html.index('id="gates"') < html.index('id="rows"') < html.index('id="forest"')
    assert html.index('id="forest"') < html.index('id="series"') < html.index('id="peak"') < html.index('id="provenance"')
    assert html.count('<svg class="plot"') >= 1 + 2 * len(data["rows"])
    assert " ms<" in html and " B (" in html  # numbers carry units


def test_verdict_inconclusive_names_inconclusive_gates(tmp_path):
    loaded, run_dir = build_run_dir(tmp_path, impossible_gate=False)
    data = analyse.build_report(loaded, run_dir)
    assert data["verdict"] == "INCONCLUSIVE"
    # no gate fails: the deciding gates are the INCONCLUSIVE ones (frozen has no record; a failed
    # block keeps the timing gates from passing)
    assert "frozen" in [g["name"] for g in data["deciding_gates"]]
    assert {g["status"] for g in data["deciding_gates"]} == {"INCONCLUSIVE"}
    assert len(data["deciding_gates"]) == sum(g["status"] == "INCONCLUSIVE" for g in data["gates"])
    html = report.render_html(data)
    assert 'class="banner inconclusive"' in html


def test_index_lists_runs_newest_first(built, tmp_path):
    data, html_path = built
    reports = tmp_path / "reports"
    older = json.loads(json.dumps(data))
    older["run"]["id"] = "20250101T000000Z-0000"
    older["run"]["started"] = "2025-01-01T00:00:00+00:00"
    older["verdict"] = "GO"
    older["phases"]["attempts"] = [{"attempt": 1, "verdict": "GO", "note": XSS}]
    for rep in (data, older):
        d = reports / rep["experiment"]["name"] / rep["run"]["id"]
        d.mkdir(parents=True)
        (d / "report.json").write_text(json.dumps(rep))
    index = report.render_index(reports).read_text()
    assert index.index(data["run"]["id"]) < index.index(older["run"]["id"])
    assert f'href="demo-report/{data["run"]["id"]}/index.html"' in index
    assert "&lt;script&gt;" in index and XSS not in index
    assert "Attempt history" in index


def test_report_and_compare_commands(tmp_path, capsys):
    from harness.cli import main

    loaded, run_dir = build_run_dir(tmp_path)
    profile, reports = tmp_path / "profile", tmp_path / "reports"
    args = ["report", str(loaded.path), "--profile-root", str(profile), "--reports-root", str(reports)]
    assert main(args) == 1  # NO-GO
    out = capsys.readouterr().out
    published = reports / "demo-report" / run_dir.name
    assert f"NO-GO: {published / 'index.html'}" in out
    assert (published / "report.json").is_file()
    assert not (run_dir / "report.json").exists()  # never into the run folder: a live run may hold it
    assert (reports / "index.html").is_file()
    assert main(args + ["--run", "no-such-run"]) == 2

    # B: the same report with row S1/fwd's speedup gone and the first gate failing
    data = json.loads((published / "report.json").read_text())
    other = json.loads(json.dumps(data))
    other["run"]["id"] = "B"
    first = other["rows"][0]
    for iv in (first["speedup"], first["bases"][first["primary_basis"]]["speedup"]):  # as read, on its basis
        iv.update(point=1.0, lo=0.9, hi=1.1)
    other["gates"][0]["status"] = "FAIL"
    (tmp_path / "b.json").write_text(json.dumps(other))
    out_html = tmp_path / "cmp.html"
    assert main(["compare", str(published), str(tmp_path / "b.json"), "--out", str(out_html)]) == 0
    out = capsys.readouterr().out
    assert "S1/fwd" in out and "B slower" in out and str(out_html) in out
    html = out_html.read_text()
    assert "B slower (intervals disjoint)" in html and html.count("<script") == 1
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)

    # runs with different rows: each row only one side has is named, nothing crashes
    other["rows"] = [r for r in other["rows"] if r["name"] != "S2/fwd"]
    extra = json.loads(json.dumps(other["rows"][0]))
    extra.update(name="S3/fwd", shape="S3")
    other["rows"].append(extra)
    (tmp_path / "b.json").write_text(json.dumps(other))
    assert main(["compare", str(published), str(tmp_path / "b.json"), "--out", str(out_html)]) == 0
    out = capsys.readouterr().out
    assert "rows only in A: S2/fwd" in out and "rows only in B: S3/fwd" in out
    html = out_html.read_text()
    assert 'id="only-in-a">Rows only in A: S2/fwd<' in html and 'id="only-in-b">Rows only in B: S3/fwd<' in html


def test_report_command_formats(tmp_path, capsys):
    """`harness report` on a report directory (no records needed): the page re-rendered from
    report.json alone, the verdict as a table, markdown (stdout stays the markdown) or JUnit."""
    import xml.etree.ElementTree as ET

    from harness.cli import main

    loaded, run_dir = build_run_dir(tmp_path)
    data = analyse.build_report(loaded, run_dir)
    published = tmp_path / "reports" / loaded.exp.name / run_dir.name
    analyse.write_report(data, published)
    (published / "index.html").write_text("stale")
    before = (published / "report.json").read_text()
    roots = ["--reports-root", str(tmp_path / "reports")]
    assert main(["report", str(published), *roots]) == 1
    out = capsys.readouterr().out
    assert out.startswith("NO-GO demo-report run ") and f"NO-GO: {published / 'index.html'}" in out
    assert (published / "index.html").read_text().startswith("<!DOCTYPE html>")  # re-rendered
    assert (published / "report.json").read_text() == before  # never rewritten
    assert (tmp_path / "reports" / "index.html").is_file()
    assert main(["report", str(published / "report.json"), "--format", "md", *roots]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("### NO-GO: demo-report run ") and "index.html" not in captured.out
    assert f"NO-GO: {published / 'index.html'}" in captured.err
    junit = tmp_path / "ci" / "verdict.xml"
    assert main(["report", str(published), "--format", "junit", "--out", str(junit), *roots]) == 1
    cases = ET.parse(junit).getroot().find("testsuite").findall("testcase")
    assert [c.get("name") for c in cases] == [g["name"] for g in data["gates"]]
    assert main(["report", str(tmp_path / "nothing-here"), *roots]) == 2


def test_phase_records_reach_gates_and_sections(tmp_path):
    loaded, run_dir = build_run_dir(tmp_path, impossible_gate=False)
    verify = {"kind": "verify", "sides": {"candidate": {"cases": [
        {"case": "tiny", "mode": "fwdbwd", "status": "PASS",
         "tensors": [{"name": "dq", "max_abs": 1e-6, "max_rel": 2e-5, "worst_ratio": 0.1, "status": "PASS"}]}]}},
        "gates": {"correctness": {"status": "PASS", "reason": "every tensor within tolerance", "numbers": {}},
                  "frozen_paths": {"status": "FAIL", "reason": f"frozen path kernels/{XSS} changed", "numbers": {}}}}
    profile = {"rows": [{"row": "S1/fwdbwd", "stage_share_wall": {"bwd.intra": 0.3, "fwd.o": 0.5, "host/gaps": 0.2},
                         "endpoint_samples_ms": [1.0] * 40}],
               "gate": {"status": None, "reason": "stages not visible on CPU", "numbers": {}}}
    freeze = {"kind": "freeze", "status": "PASS", "terminal": False, "baseline_sha": "0123456789abcdef" * 2,
              "manifest_sha256": "ab" * 32, "gate": {"status": "PASS", "reason": "baseline matches the oracle twice"}}
    stage = {"kernels": ["k_intra"], "metrics": {"duration_ns": 2000.0}, "stall_samples": {"wait": 30, "selected": 50,
                                                                                     "long_scoreboard": 10}}
    ncu_rec = {"rows": ["S1"], "mode": "fwdbwd", "nvtx_range": "harness.measure", "ncu": {"version": "2025.3.1.0"},
               "metric_table": {"duration_ns": {"label": "duration"}},
               "sides": {side: {"rows": {"S1": {"status": "ok", "stages": {"replaced": stage},
                                                "kernels": {f"k_{side}": {"launches": 1, "metrics": {"duration_ns": 2000.0},
                                                                          "top_stalls": [{"reason": "wait"}]}}}}}
                         for side in ("baseline", "candidate")},
               "deltas": {"S1": {"replaced": {"duration_ns": {"baseline": 2000.0, "candidate": 1000.0, "delta": -1000.0,
                                                              "ratio": 0.5}}}},
               "commands": [{"side": "baseline", "row": "S1", "pass": "full", "rc": 0, "wall_s": 3.5,
                             "command": f"ncu --clock-control none -o {XSS}"}],
               "gate": {"status": "PASS", "reason": "replaced.dram_bytes lower", "numbers": {}}}
    for name, rec in (("verify", verify), ("profile", profile), ("freeze", freeze), ("ncu", ncu_rec)):
        (run_dir / f"{name}.json").write_text(json.dumps(rec))
    data = analyse.build_report(loaded, run_dir)
    assert _gate(data, "frozen")["status"] == "FAIL" and data["verdict"] == "NO-GO"
    assert [g["name"] for g in data["deciding_gates"]] == ["frozen"]
    assert data["phases"]["verify"]["gates"]["correctness"]["status"] == "PASS"
    assert data["phases"]["freeze"]["manifest_sha256"] == "ab" * 32
    html = report.render_html(data)
    assert 'aria-label="profile-shares"' in html  # stage-share bars from the profile record
    assert "40 values" in html  # long sample lists fold away
    assert f"kernels/{XSS}" not in html and "kernels/&lt;script&gt;" in html
    # the Nsight Compute section: the stage side by side (missing metrics say so), kernels, stall
    # bars without the issuing state, the commands (escaped) and the ncu version in the provenance
    view = report.ncu_view(data["phases"]["ncu"])
    (st,) = view["rows"][0]["stages"]
    by_key = {m["key"]: m for m in st["metrics"]}
    assert by_key["duration_ns"]["baseline"] == "2.00 us" and by_key["duration_ns"]["candidate"] == "1.00 us"
    assert by_key["duration_ns"]["ratio"] == 0.5 and by_key["dram_read_bytes"]["baseline"] == "missing"
    assert st["stalls"]["baseline"] == {"wait": 0.75, "long_scoreboard": 0.25}
    assert {k["name"] for k in view["rows"][0]["kernels"]} == {"k_baseline", "k_candidate"}
    assert 'id="ncu-S1-replaced"' in html and 'aria-label="ncu-stalls-S1-replaced"' in html
    assert 'id="ncu-kernels-S1"' in html and "ncu 2025.3.1.0, 1 profiles" in html
    assert f"-o {XSS}" not in html


def test_provenance_env_of_runs_recorded_before_sides_carried_it(tmp_path):
    from types import SimpleNamespace

    exp = SimpleNamespace(baseline=SimpleNamespace(env={}), candidate=SimpleNamespace(env={"KNOB": "1"}))
    side = {"sha": "a" * 40, "ref": "a" * 40}
    run = {"revisions": {"repo": "/r", "baseline": dict(side), "candidate": dict(side)}}
    prov = analyse._provenance(run, tmp_path, exp)
    assert prov["baseline"]["env"] == {} and prov["candidate"]["env"] == {"KNOB": "1"}
    prov = analyse._provenance({**run, "aa": True}, tmp_path, exp)  # an A/A run ran the baseline twice
    assert prov["candidate"]["env"] == {}
    recorded = {"revisions": {"repo": "/r", "baseline": dict(side), "candidate": {**side, "env": {"KNOB": "2"}}}}
    assert analyse._provenance(recorded, tmp_path, exp)["candidate"]["env"] == {"KNOB": "2"}  # the record wins


def test_recorded_command_reads_as_typed(monkeypatch):
    """`python -m harness run X` is recorded as `harness run X`, not `__main__.py run X`."""
    from harness.run import invoked_command
    monkeypatch.setattr("sys.argv", ["/x/harness/__main__.py", "run", "experiments/a b.yaml", "--run-id", "h200"])
    assert invoked_command() == "harness run 'experiments/a b.yaml' --run-id h200"
    monkeypatch.setattr("sys.argv", ["/usr/bin/harness", "report", "e.yaml"])
    assert invoked_command() == "harness report e.yaml"


def test_autotune_choices_show_under_the_speedup_table():
    """measurement.autotune (analyse._autotune_section) on the page: a sentence when every worker ran
    the same configs, and a table per differing kernel and key when some did not, escaped."""
    data = json.loads((Path(__file__).resolve().parents[1] / "reports" / "pkda-aa" / "h100-1205" / "report.json").read_text())
    data["measurement"]["autotune"] = {"rows": 10, "workers": 24, "tuned": 31, "differences": []}
    page = report.render_html(data)
    assert "all 24 workers ran the same configs" in page and 'id="autotune-table"' not in page
    data["measurement"]["autotune"]["differences"] = [
        {"row": "B4_T2048_H16_D128/fwdbwd", "kernel": "kernels.pkda.bwd.pkda_bwd_intra_kernel", "key": "(2048, '<b>')",
         "by_side": {"baseline": {"num_warps: 4": 8}, "candidate": {"num_warps: 4": 7, "num_warps: 8": 1}}}]
    page = report.render_html(data)
    assert "workers chose differently</b> for 1" in page and 'id="autotune-table"' in page
    assert "num_warps: 8 (1)" in page and "(2048, &#39;&lt;b&gt;&#39;)" in page
    del data["measurement"]["autotune"]  # a report from before: no line
    assert 'id="autotune"' not in report.render_html(data)
