"""Nsight Compute evidence (harness/ncu.py): metric table, stage sums, gate relations, command lines,
the phase end to end with a stand-in ncu, and real .ncu-rep fixtures from fixtures/ncu/ (H200)."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from harness import ncu
from harness.ncu import Launch
from harness.revisions import ResolvedSide, Revisions
from harness.spec import Experiment, LoadedExperiment, NcuExpectation

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "ncu"

# --- synthetic launches -------------------------------------------------------------------------


def full_launch(name, dur_ns=1000.0, rd=1e6, wr=5e5, regs=96, occ=40.0, theo=50.0, l2=3e6, hmma=100, gmma=0,
                drop=(), **extra) -> Launch:
    m = {
        "gpu__time_duration.sum": (dur_ns, "nsecond"),
        "dram__bytes_read.sum": (rd, "byte"),
        "dram__bytes_write.sum": (wr, "byte"),
        "dram__bytes_read.sum.per_second": (rd / (dur_ns * 1e-9), "byte/second"),
        "lts__t_bytes.sum": (l2, "byte"),
        "sm__inst_executed_pipe_tensor_op_hmma.sum": (hmma, "inst"),
        "sm__inst_executed_pipe_tensor_op_gmma.sum": (gmma, "inst"),
        "sm__throughput.avg.pct_of_peak_sustained_elapsed": (30.0, "%"),
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": (12.0, "%"),
        "sm__warps_active.avg.pct_of_peak_sustained_active": (occ, "%"),
        "sm__maximum_warps_per_active_cycle_pct": (theo, "%"),
        "launch__registers_per_thread": (regs, "register/thread"),
        "launch__occupancy_limit_registers": (2, "block"),
        "smsp__warps_active.avg.per_cycle_active": (6.0, "warp"),
        "smsp__warps_eligible.avg.per_cycle_active": (0.8, "warp"),
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": (3.0, "ratio"),
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": (1.0, "ratio"),
        "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio": (1.0, "ratio"),
    }
    m.update(extra)
    for d in drop:
        m.pop(d, None)
    return Launch(name=name, metrics=m)


def source_launch(name, spills=0, long_sb=50, barrier=10) -> Launch:
    return Launch(name=name, metrics={
        "derived__local_spilling_requests": (spills, "request"),
        "sass__inst_executed_register_spilling": (spills * 2, "inst"),
        "smsp__pcsamp_warps_issue_stalled_long_scoreboard": (long_sb, ""),
        "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued": (999, ""),
        "smsp__pcsamp_warps_issue_stalled_barrier": (barrier, ""),
        "smsp__pcsamp_warps_issue_stalled_selected": (500, ""),
    })


STAGES = {"replaced": ["dAv", "intra", "beta_reduce"]}


def baseline_passes():
    full = [full_launch("pkda_bwd_dAv_kernel", 1000, rd=1e6, wr=4e6),
            full_launch("pkda_bwd_intra_kernel", 3000, rd=5e6, wr=1e6, regs=128, occ=30.0),
            full_launch("pkda_bwd_beta_reduce_kernel", 500, rd=2e5, wr=1e5, regs=32, occ=60.0),
            full_launch("pkda_fwd_o_kernel", 800)]
    src = [source_launch("pkda_bwd_dAv_kernel"), source_launch("pkda_bwd_intra_kernel"),
           source_launch("pkda_bwd_beta_reduce_kernel"), source_launch("pkda_fwd_o_kernel")]
    return {"full": full, "source": src}


def candidate_passes(spills=0, occ=28.0):
    full = [full_launch("pkda_bwd_dAv_kernel", 900, rd=1e6, wr=1e5),
            full_launch("pkda_bwd_intra_kernel", 4000, rd=2e6, wr=1e6, regs=160, occ=occ, hmma=300)]
    src = [source_launch("pkda_bwd_dAv_kernel"), source_launch("pkda_bwd_intra_kernel", spills=spills)]
    return {"full": full, "source": src}


# --- the metric table ---------------------------------------------------------------------------


def test_metric_table_is_one_consistent_table():
    keys = [m.key for m in ncu.METRICS]
    assert len(keys) == len(set(keys))
    for m in ncu.METRICS:
        assert m.agg in ("sum", "wavg", "max", "min")
        assert m.kind in ("time", "bytes", "rate", "plain")
        assert bool(m.names) != bool(m.parts), m.key  # a candidate list or parts, not both
    names = ncu.all_ncu_names()
    for required in ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
                     "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                     "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
                     "sm__maximum_warps_per_active_cycle_pct", "launch__occupancy_limit_registers",
                     "smsp__warps_eligible.avg.per_cycle_active", "derived__local_spilling_requests"):
        assert required in names
    assert "launches" in ncu.metric_keys() and "dram_bytes" in ncu.metric_keys()


@pytest.mark.parametrize("value,unit,kind,expect", [
    (1.5, "usecond", "time", 1500.0), (2.0, "msecond", "time", 2e6), (7.0, "nsecond", "time", 7.0),
    (3.0, "Mbyte", "bytes", 3e6), (4.0, "Kbyte/block", "bytes", 4e3), (5.0, "byte", "bytes", 5.0),
    (2.0, "Gbyte/second", "rate", 2e9), (1.0, "byte/usecond", "rate", 1e6), (42.0, "%", "plain", 42.0),
])
def test_units_become_canonical(value, unit, kind, expect):
    assert ncu.to_canonical(value, unit, kind) == pytest.approx(expect)


def test_unknown_unit_is_missing_not_guessed():
    launch = full_launch("k", **{"gpu__time_duration.sum": (3.0, "fortnight")})
    v, name = ncu.launch_metric(launch, ncu.METRIC_BY_KEY["duration_ns"])
    assert v is None


def test_kernel_metrics_sum_launches_and_weight_percentages():
    passes = {"full": [full_launch("k", 1000, rd=10, occ=20.0), full_launch("k", 3000, rd=30, occ=60.0)],
              "source": [source_launch("k", spills=1), source_launch("k", spills=2)]}
    k = ncu.kernel_metrics(passes)["k"]
    assert k["launches"] == 2
    m = k["metrics"]
    assert m["duration_ns"] == 4000
    assert m["dram_read_bytes"] == 40
    assert m["achieved_occupancy_pct"] == pytest.approx((20 * 1000 + 60 * 3000) / 4000)
    assert m["spill_local_requests"] == 3 and k["sources"]["spill_local_requests"].startswith("source:")
    assert m["tensor_inst"] == 200  # hmma + gmma parts
    assert m["dram_bytes"] == m["dram_read_bytes"] + m["dram_write_bytes"]
    # stalls: pcsamp samples summed (the `_not_issued` variants and `selected` left out of the top)
    assert k["stall_samples"]["long_scoreboard"] == 100
    assert [s["reason"] for s in k["top_stalls"]][:2] == ["long_scoreboard", "barrier"]


def test_missing_metric_is_none_never_zero():
    passes = {"full": [full_launch("k", drop=("dram__bytes_write.sum", "lts__t_bytes.sum"))]}
    k = ncu.kernel_metrics(passes)["k"]
    assert k["metrics"]["dram_write_bytes"] is None
    assert k["metrics"]["l2_bytes"] is None
    assert k["metrics"]["dram_bytes"] is None  # derived from a missing part
    assert k["metrics"]["spill_local_requests"] is None  # no source pass at all
    assert "dram_write_bytes" in k["missing"]


def test_metric_missing_on_one_launch_makes_the_kernel_value_none():
    passes = {"full": [full_launch("k"), full_launch("k", drop=("dram__bytes_read.sum",))]}
    assert ncu.kernel_metrics(passes)["k"]["metrics"]["dram_read_bytes"] is None


def test_sector_fallback_is_scaled_to_bytes():
    launch = full_launch("k", drop=("lts__t_bytes.sum",), **{"lts__t_sectors.sum": (10, "sector")})
    v, name = ncu.launch_metric(launch, ncu.METRIC_BY_KEY["l2_bytes"])
    assert v == 320 and name == "lts__t_sectors.sum"


# --- stage sums ---------------------------------------------------------------------------------


def test_stage_sums_add_matched_kernels():
    kernels = ncu.kernel_metrics(baseline_passes())
    st = ncu.stage_sums(kernels, STAGES)["replaced"]
    assert st["kernels"] == ["pkda_bwd_dAv_kernel", "pkda_bwd_intra_kernel", "pkda_bwd_beta_reduce_kernel"]
    assert st["launches"] == 3
    m = st["metrics"]
    assert m["duration_ns"] == 4500
    assert m["dram_read_bytes"] == 1e6 + 5e6 + 2e5
    assert m["dram_write_bytes"] == 4e6 + 1e6 + 1e5
    assert m["registers_per_thread"] == 128
    assert m["achieved_occupancy_pct"] == pytest.approx((40 * 1000 + 30 * 3000 + 60 * 500) / 4500)
    assert m["dram_read_bytes_per_s"] == pytest.approx(m["dram_read_bytes"] / 4500e-9)
    assert st["stall_samples"]["long_scoreboard"] == 150


def test_stage_with_no_matching_kernel_is_missing_and_inconclusive():
    kernels = ncu.kernel_metrics(candidate_passes())
    st = ncu.stage_sums(kernels, {"reduce": ["beta_reduce"]})["reduce"]
    assert st["matched"] == 0 and st["kernels"] == [] and st["launches"] is None
    assert all(v is None for v in st["metrics"].values())
    assert ncu.stage_value(st, "launches") is None
    e = NcuExpectation(stage="reduce", metric="dram_bytes", relation="candidate_at_most", value=0)
    res = ncu.check_expectation(e, None, st)
    assert res["status"] is None and "matched no profiled kernel" in res["reason"]


def test_deltas_between_sides():
    b = ncu.stage_sums(ncu.kernel_metrics(baseline_passes()), STAGES)
    c = ncu.stage_sums(ncu.kernel_metrics(candidate_passes()), STAGES)
    d = ncu.deltas(b, c)["replaced"]
    assert d["launches"] == {"baseline": 3, "candidate": 2, "delta": -1, "ratio": pytest.approx(2 / 3)}
    assert d["dram_write_bytes"]["delta"] == pytest.approx(1.1e6 - 5.1e6)


# --- gate relations -----------------------------------------------------------------------------


def _stages(spills=0, occ=28.0):
    return (ncu.stage_sums(ncu.kernel_metrics(baseline_passes()), STAGES)["replaced"],
            ncu.stage_sums(ncu.kernel_metrics(candidate_passes(spills, occ)), STAGES)["replaced"])


@pytest.mark.parametrize("metric,relation,value,status", [
    ("dram_write_bytes", "lower_by_at_least", 3e6, "PASS"),      # 5.1e6 -> 1.1e6
    ("dram_write_bytes", "lower_by_at_least", 5e6, "FAIL"),
    ("launches", "lower_by_at_least", 1, "PASS"),
    ("launches", "lower_by_at_least", 2, "FAIL"),
    ("registers_per_thread", "higher_by_at_most", 32, "PASS"),  # 128 -> 160
    ("registers_per_thread", "higher_by_at_most", 16, "FAIL"),
    ("spill_local_requests", "candidate_at_most", 0, "PASS"),
    ("achieved_occupancy_pct", "candidate_ratio_at_least", 0.5, "PASS"),
    ("achieved_occupancy_pct", "candidate_ratio_at_least", 0.99, "FAIL"),
])
def test_relations(metric, relation, value, status):
    b, c = _stages()
    res = ncu.check_expectation(NcuExpectation(stage="replaced", metric=metric, relation=relation, value=value), b, c)
    assert res["status"] == status, res
    assert res["reason"]


def test_spills_on_candidate_fail_candidate_at_most_zero():
    b, c = _stages(spills=7)
    e = NcuExpectation(stage="replaced", metric="spill_local_requests", relation="candidate_at_most", value=0)
    res = ncu.check_expectation(e, b, c)
    assert res["status"] == "FAIL" and res["candidate"] == 7
    # the baseline's value is shown beside it (did the candidate bring the spills or inherit them?)
    assert res["baseline"] == ncu.stage_value(b, "spill_local_requests")
    assert res["reason"].endswith(f"(baseline {res['baseline']:g})")
    # and a baseline stage that was not profiled does not make the candidate-only rule inconclusive
    assert ncu.check_expectation(e, None, c)["status"] == "FAIL"


def test_missing_metric_makes_expectation_inconclusive():
    b = ncu.stage_sums(ncu.kernel_metrics(baseline_passes()), STAGES)["replaced"]
    cand = candidate_passes()
    cand["full"][1] = full_launch("pkda_bwd_intra_kernel", 4000, drop=("dram__bytes_write.sum",))
    c = ncu.stage_sums(ncu.kernel_metrics(cand), STAGES)["replaced"]
    assert c["metrics"]["dram_write_bytes"] is None
    assert c["missing"]["dram_write_bytes"] == ["pkda_bwd_intra_kernel"]
    e = NcuExpectation(stage="replaced", metric="dram_write_bytes", relation="lower_by_at_least", value=1)
    res = ncu.check_expectation(e, b, c)
    assert res["status"] is None and "missing" in res["reason"] and "pkda_bwd_intra_kernel" in res["reason"]


def test_unknown_metric_and_zero_baseline_ratio_are_inconclusive():
    b, c = _stages()
    e = NcuExpectation(stage="replaced", metric="dram_bogus", relation="candidate_at_most", value=0)
    assert ncu.check_expectation(e, b, c)["status"] is None
    e = NcuExpectation(stage="replaced", metric="spill_local_requests", relation="candidate_ratio_at_least", value=1)
    res = ncu.check_expectation(e, b, c)
    assert res["status"] is None and "undefined" in res["reason"]


# --- experiments, command lines, the phase with a stand-in ncu -------------------------------------

GATE = {"kind": "ncu", "name": "ncu-attribution", "row": "small", "expect": [
    {"stage": "replaced", "metric": "dram_write_bytes", "relation": "lower_by_at_least", "value": 3e6},
    {"stage": "replaced", "metric": "spill_local_requests", "relation": "candidate_at_most", "value": 0},
    {"stage": "replaced", "metric": "achieved_occupancy_pct", "relation": "candidate_ratio_at_least", "value": 0.8},
]}


def make_exp(gates=None) -> Experiment:
    return Experiment.model_validate({
        "name": "ncu-test", "target": {"op": "op:op", "inputs": "inputs.py:make_inputs"},
        "baseline": {"ref": "abcdef1"}, "candidate": {"ref": "cand"}, "modes": ["fwd", "fwdbwd"],
        "shapes": [{"name": "small", "B": 1, "T": 64, "H": 2, "K": 64, "V": 64}],
        "stages": {"replaced": {"baseline": ["dAv", "intra", "beta_reduce"], "candidate": ["dAv", "intra"]},
                   "other": {"baseline": ["fwd_o"], "candidate": ["fwd_o"]}},
        "ncu": {"rows": ["small"], "stages": ["replaced"]},
        "gates": gates or [GATE],
    })


def test_command_lines_have_both_passes_and_never_touch_clocks(tmp_path):
    cmds = ncu.build_commands("/x/ncu", ["python", "-m", "harness.ncu_target", "job.json"], tmp_path / "baseline-small",
                              ["dAv", "intra"], extra_metrics=["sm__inst_executed_pipe_tensor_op_hmma.sum"])
    assert set(cmds) == {"full", "source"}
    for name, argv in cmds.items():
        line = " ".join(argv)
        assert "--clock-control none" in line
        assert "--nvtx --nvtx-include harness.measure/" in line
        assert "-k regex:(dAv)|(intra)" in line
        assert argv[-4:] == ["python", "-m", "harness.ncu_target", "job.json"]
        assert argv[argv.index("-o") + 1] == f"{tmp_path / 'baseline-small'}-{name}"
    full, source = (" ".join(cmds[p]) for p in ("full", "source"))
    assert "--set full --section PmSampling --section PmSampling_WarpStates" in full
    assert "--metrics sm__inst_executed_pipe_tensor_op_hmma.sum" in full
    assert "--section SourceCounters" in source and "--set" not in source
    assert ncu.kernel_regex(["a"]) == "a"


def _revisions(tmp_path) -> Revisions:
    sides = {s: ResolvedSide(side=s, ref=s, sha=("a" if s == "baseline" else "b") * 40, branch=None,
                             worktree=str(tmp_path / s), subject=s) for s in ("baseline", "candidate")}
    return Revisions(repo=str(tmp_path), baseline=sides["baseline"], candidate=sides["candidate"])


def _loaded(tmp_path, exp=None) -> LoadedExperiment:
    (tmp_path / "inputs.py").write_text("def make_inputs(*a): pass\n")
    return LoadedExperiment(exp=exp or make_exp(), path=tmp_path / "exp.yaml", root=tmp_path)


def _fake_ncu(tmp_path, body: str) -> str:
    path = tmp_path / "fake-ncu"
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_missing_ncu_is_inconclusive_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_NCU", str(tmp_path / "no-such-ncu"))
    rec = ncu.ncu_run(_loaded(tmp_path), _revisions(tmp_path), tmp_path / "run", tmp_path / "profile", log=lambda s: None)
    assert rec["gate"]["status"] is None and "ncu not found" in rec["gate"]["reason"]
    on_disk = json.loads((tmp_path / "run" / "ncu.json").read_text())
    assert on_disk["gate"]["status"] is None


def test_failed_profile_is_inconclusive_with_reason(tmp_path, monkeypatch):
    fake = _fake_ncu(tmp_path, 'if [ "$1" = --version ]; then echo "Version 2025.3.1.0 (build 1)"; exit 0; fi\n'
                               'echo "==ERROR== The application returned an error code (1)."; exit 1\n')
    monkeypatch.setenv("HARNESS_NCU", fake)
    rec = ncu.ncu_run(_loaded(tmp_path), _revisions(tmp_path), tmp_path / "run", tmp_path / "profile", log=lambda s: None)
    assert rec["ncu"]["version"] == "2025.3.1.0 (build 1)"
    assert rec["gate"]["status"] is None
    assert "failed" in rec["gate"]["reason"] and "error code" in rec["gate"]["reason"]
    assert len(rec["commands"]) == 4 and all("--clock-control none" in c["command"] for c in rec["commands"])
    row = rec["sides"]["candidate"]["rows"]["small"]
    assert row["status"] == "failed"


def _stand_in_ncu(tmp_path, monkeypatch) -> None:
    """A stand-in ncu that logs its argv to argv.log and writes an empty report where -o points;
    the reader is replaced by synthetic launches (baseline_passes / candidate_passes)."""
    fake = _fake_ncu(tmp_path, 'if [ "$1" = --version ]; then echo "Version 2025.3.1.0"; exit 0; fi\n'
                               'echo "$@" >> "$(dirname "$0")/argv.log"\n'
                               'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then touch "$2.ncu-rep"; fi; shift; done\n')
    monkeypatch.setenv("HARNESS_NCU", fake)

    def reader(path, ncu_bin=None, timeout=600):
        name = Path(path).name
        passes = baseline_passes() if name.startswith("baseline") else candidate_passes()
        return passes["full" if "-full" in name else "source"], "synthetic"

    monkeypatch.setattr(ncu, "read_report", reader)


def test_phase_end_to_end_with_stand_in_reports(tmp_path, monkeypatch):
    _stand_in_ncu(tmp_path, monkeypatch)
    rec = ncu.ncu_run(_loaded(tmp_path), _revisions(tmp_path), tmp_path / "run", tmp_path / "profile", log=lambda s: None)
    assert rec["error"] is None
    assert rec["gate"]["status"] == "PASS", rec["gate"]
    checks = rec["gate"]["numbers"]["ncu-attribution"]["checks"]
    assert [c["status"] for c in checks] == ["PASS", "PASS", "PASS"]
    base = rec["sides"]["baseline"]["rows"]["small"]
    assert base["stages"]["replaced"]["launches"] == 3
    assert rec["sides"]["candidate"]["kernel_filter"] == "(dAv)|(intra)"
    assert rec["deltas"]["small"]["replaced"]["launches"]["delta"] == -1
    argv = (tmp_path / "argv.log").read_text().splitlines()
    assert len(argv) == 4 and all("--clock-control none" in a for a in argv)
    assert sum("--set full" in a for a in argv) == 2 and sum("--section SourceCounters" in a for a in argv) == 2
    on_disk = json.loads((tmp_path / "run" / "ncu.json").read_text())
    assert on_disk["gate"]["status"] == "PASS" and on_disk["mode"] == "fwdbwd"
    # the stage table prints without a GPU
    from rich.console import Console

    console = Console(record=True, width=200)
    ncu.print_stage_table(on_disk, "small", console=console)
    text = console.export_text()
    assert "replaced" in text and "ncu gate: PASS" in text


def test_resumed_phase_profiles_only_the_missing_side_rows(tmp_path, monkeypatch):
    _stand_in_ncu(tmp_path, monkeypatch)
    first = ncu.ncu_run(_loaded(tmp_path), _revisions(tmp_path), tmp_path / "run", tmp_path / "profile", log=lambda s: None)
    # the run died before ncu.json: the candidate's row is lost, the baseline's parsed row stays
    (tmp_path / "run" / "ncu.json").unlink()
    (tmp_path / "run" / "ncu" / "candidate-small.json").unlink()
    for rep in (tmp_path / "run" / "ncu").glob("*.ncu-rep"):
        rep.unlink()  # reports do not travel between machines; the parsed record does
    (tmp_path / "argv.log").unlink()
    again = ncu.ncu_run(_loaded(tmp_path), _revisions(tmp_path), tmp_path / "run", tmp_path / "profile", log=lambda s: None)
    argv = (tmp_path / "argv.log").read_text().splitlines()
    assert len(argv) == 2 and all("candidate-small" in a for a in argv)
    assert again["gate"]["status"] == first["gate"]["status"] == "PASS"
    assert again["sides"]["baseline"]["rows"]["small"]["stages"] == first["sides"]["baseline"]["rows"]["small"]["stages"]
    assert len(again["commands"]) == 4


def test_candidate_spills_fail_the_gate_end_to_end(tmp_path, monkeypatch):
    record = {"error": None, "sides": {}}
    for side, passes in (("baseline", baseline_passes()), ("candidate", candidate_passes(spills=3))):
        kernels = ncu.kernel_metrics(passes)
        record["sides"][side] = {"rows": {"small": {"status": "ok", "kernels": kernels,
                                                    "stages": ncu.stage_sums(kernels, STAGES)}}}
    gate = ncu.evaluate_gates(make_exp(), record)
    assert gate["status"] == "FAIL" and "spill_local_requests" in gate["reason"]


def test_row_not_profiled_is_inconclusive():
    gate = ncu.evaluate_gates(make_exp(), {"error": None, "sides": {"baseline": {"rows": {}}, "candidate": {"rows": {}}}})
    assert gate["status"] is None and "not profiled" in gate["reason"]


def test_raw_csv_fallback_parser():
    text = ('==PROF== Disconnected\n'
            '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","launch__registers_per_thread",'
            '"smsp__pcsamp_warps_issue_stalled_wait"\n'
            '"","","usecond","Kbyte","register/thread",""\n'
            '"0","pkda_bwd_intra_kernel","1.50","2,048.00","128","17"\n'
            '"1","pkda_bwd_intra_kernel","2.50","n/a","128","3"\n')
    launches = ncu.parse_raw_csv(text)
    assert [la.name for la in launches] == ["pkda_bwd_intra_kernel"] * 2
    k = ncu.kernel_metrics({"full": launches})["pkda_bwd_intra_kernel"]
    assert k["metrics"]["duration_ns"] == pytest.approx(4000)
    assert k["metrics"]["dram_read_bytes"] is None  # n/a on one launch
    assert k["metrics"]["registers_per_thread"] == 128


def test_parse_command_on_missing_file_is_a_usage_error(tmp_path):
    from harness.cli import main

    assert main(["ncu", "--parse", str(tmp_path / "nope.ncu-rep")]) == 2


# --- real reports from the H200 (tools/capture_ncu_fixtures.sh) ------------------------------------

FULL_REPS = sorted(FIXTURES.glob("*full*.ncu-rep")) if FIXTURES.is_dir() else []
SOURCE_REPS = sorted(FIXTURES.glob("*source*.ncu-rep")) if FIXTURES.is_dir() else []
needs_fixtures = pytest.mark.skipif(
    not FULL_REPS or not SOURCE_REPS,
    reason="no real .ncu-rep files in fixtures/ncu/ yet: the lead runs tools/capture_ncu_fixtures.sh on the H200 "
           "and commits its *-full.ncu-rep and *-source.ncu-rep there")


def _reader_available() -> bool:
    try:
        import ncu_report  # noqa: F401
        return True
    except ImportError:
        return ncu.find_ncu() is not None


@needs_fixtures
def test_real_full_report():
    if not _reader_available():
        pytest.skip("neither ncu_report nor ncu is installed to read .ncu-rep files")
    for path in FULL_REPS:
        # the PmSampling sections make a full-set report of three small kernels about 4 MB
        assert path.stat().st_size < 5 * 2**20, f"{path} is over 5 MB: filter the capture harder"
        launches, reader = ncu.read_report(path)
        assert launches, f"{path}: no kernel launches"
        kernels = ncu.kernel_metrics({"full": launches})
        assert all("pkda" in name for name in kernels), list(kernels)
        for name, k in kernels.items():
            m = k["metrics"]
            assert m["duration_ns"] is not None and m["duration_ns"] > 0, (name, k["missing"])
            assert m["registers_per_thread"] is not None and m["registers_per_thread"] > 0
            assert m["dram_read_bytes"] is not None and m["dram_read_bytes"] >= 0
            assert m["dram_write_bytes"] is not None and m["dram_write_bytes"] >= 0
            assert m["l2_bytes"] is not None and m["l2_bytes"] > 0
            assert m["achieved_occupancy_pct"] is not None and 0 < m["achieved_occupancy_pct"] <= 100
            assert m["theoretical_occupancy_pct"] is not None and 0 < m["theoretical_occupancy_pct"] <= 100
            assert m["sm_sol_pct"] is not None and m["warps_eligible_per_cycle"] is not None
            assert k["stall_ratio"], f"{name}: no warp-state stall ratios in a --set full report"
            assert k["top_stalls"]


@needs_fixtures
def test_real_source_report():
    if not _reader_available():
        pytest.skip("neither ncu_report nor ncu is installed to read .ncu-rep files")
    for path in SOURCE_REPS:
        launches, _ = ncu.read_report(path)
        assert launches and all("pkda" in la.name for la in launches)
        kernels = ncu.kernel_metrics({"source": launches})
        for name, k in kernels.items():
            # the source pass counts spill instructions; the request count comes from the full pass
            assert k["metrics"]["spill_instructions"] is not None, (name, k["missing"])
            assert k["metrics"]["spill_instructions"] >= 0
            assert k["stall_samples"], f"{name}: SourceCounters gave no stall samples"


@needs_fixtures
def test_real_capture_values():
    """Figures read from the committed H200 capture (tools/capture_ncu_fixtures.sh: one fwd+bwd at
    B=1 T=256 H=2 K=V=64 bf16, the materialised backward's three kernels)."""
    if not _reader_available():
        pytest.skip("neither ncu_report nor ncu is installed to read .ncu-rep files")
    full, _ = ncu.read_report(FIXTURES / "pkda-small-full.ncu-rep")
    source, _ = ncu.read_report(FIXTURES / "pkda-small-source.ncu-rep")
    k = ncu.kernel_metrics({"full": full, "source": source})
    assert sorted(k) == ["pkda_bwd_beta_reduce_kernel", "pkda_bwd_dAv_kernel", "pkda_bwd_intra_kernel"]
    regs = {n: v["metrics"]["registers_per_thread"] for n, v in k.items()}
    assert regs == {"pkda_bwd_dAv_kernel": 112, "pkda_bwd_intra_kernel": 252, "pkda_bwd_beta_reduce_kernel": 26}
    tensor = {n: v["metrics"]["tensor_inst"] for n, v in k.items()}
    assert tensor == {"pkda_bwd_dAv_kernel": 512, "pkda_bwd_intra_kernel": 4096, "pkda_bwd_beta_reduce_kernel": 0}
    assert k["pkda_bwd_intra_kernel"]["metrics"]["duration_ns"] == 22848
    assert k["pkda_bwd_intra_kernel"]["metrics"]["theoretical_occupancy_pct"] == 12.5
    assert all(v["metrics"]["spill_local_requests"] == 0 for v in k.values())  # K=V=64: no spills
    assert k["pkda_bwd_dAv_kernel"]["top_stalls"][0]["reason"] == "long_scoreboard"
    assert k["pkda_bwd_intra_kernel"]["stall_samples"]["barrier"] == 70


@needs_fixtures
def test_real_reports_merge_into_stages():
    if not _reader_available():
        pytest.skip("neither ncu_report nor ncu is installed to read .ncu-rep files")
    full, _ = ncu.read_report(FULL_REPS[0])
    src_path = FIXTURES / FULL_REPS[0].name.replace("full", "source")
    source = ncu.read_report(src_path)[0] if src_path.is_file() else []
    kernels = ncu.kernel_metrics({"full": full, "source": source})
    st = ncu.stage_sums(kernels, {"all": ["pkda"]})["all"]
    assert st["matched"] == len(kernels) > 0
    assert st["metrics"]["duration_ns"] > 0 and st["metrics"]["dram_bytes"] is not None
    if source:
        assert st["metrics"]["spill_local_requests"] is not None


def test_parse_command_prints_kernel_and_stage_tables(monkeypatch, capsys, tmp_path):
    from harness.cli import main

    monkeypatch.setattr(ncu, "read_report", lambda path, ncu_bin=None, timeout=600: (baseline_passes()["full"], "synthetic"))
    assert main(["ncu", "--parse", str(tmp_path / "x-full.ncu-rep"), "--stage", "replaced=dAv|intra"]) == 0
    out = capsys.readouterr().out
    assert "pkda_bwd_intra_kernel" in out and "stage replaced" in out and "registers_per_thread" in out
    assert main(["ncu", "--parse", str(tmp_path / "x-full.ncu-rep"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rec = data[str(tmp_path / "x-full.ncu-rep")]
    assert rec["launches"] == 4 and rec["kernels"]["pkda_bwd_dAv_kernel"]["metrics"]["duration_ns"] == 1000
    assert main(["ncu", "--parse", "x.ncu-rep", "--stage", "bad"]) == 2
    assert main(["ncu"]) == 2


def test_module_reader_uses_the_ncu_report_api(monkeypatch, tmp_path):
    """The calls read_report_module makes, against a stand-in with ncu_report's method names."""
    import types

    class M:
        def __init__(self, v, u): self.v, self.u = v, u
        def value(self): return self.v
        def unit(self): return self.u

    class Action:
        def __init__(self, name, metrics): self._n, self._m = name, metrics
        def name(self): return self._n
        def metric_names(self): return tuple(self._m)
        def metric_by_name(self, n): return M(*self._m[n]) if n in self._m else None
        def nvtx_state(self): return None

    class Range:
        def __init__(self, acts): self.acts = acts
        def num_actions(self): return len(self.acts)
        def action_by_idx(self, i): return self.acts[i]

    class Ctx:
        def num_ranges(self): return 1
        def range_by_idx(self, i): return Range([Action("pkda_bwd_intra_kernel", {
            "gpu__time_duration.sum": (2500, "nsecond"), "launch__registers_per_thread": (128, "register/thread"),
            "dram__bytes_read.sum": (4096, "byte"), "some__unwanted_metric": (1, "")})])

    fake = types.ModuleType("ncu_report")
    fake.load_report = lambda path: Ctx()
    monkeypatch.setitem(sys.modules, "ncu_report", fake)
    rep = tmp_path / "r.ncu-rep"
    rep.write_bytes(b"")
    launches, reader = ncu.read_report(rep)
    assert reader == "ncu_report" and [la.name for la in launches] == ["pkda_bwd_intra_kernel"]
    assert "some__unwanted_metric" not in launches[0].metrics
    k = ncu.kernel_metrics({"full": launches})["pkda_bwd_intra_kernel"]["metrics"]
    assert k["duration_ns"] == 2500 and k["registers_per_thread"] == 128 and k["dram_read_bytes"] == 4096
    assert k["dram_write_bytes"] is None


def test_ncu_command_without_ncu_is_inconclusive(temp_repo):
    """`harness ncu EXP` in a real temporary repository: revisions resolve, the record lands under
    profile/<exp>/ncu/<timestamp>/, and a machine without ncu exits 3 (INCONCLUSIVE), no crash."""
    import subprocess

    temp_repo.branch("fast", work=2)
    exp = temp_repo.experiment("ncu-cli", "fast", """\
        - {kind: ncu, name: attribution, row: small, expect: [{stage: all, metric: launches, relation: candidate_at_most, value: 10}]}
        """, extra="stages:\n  all: {baseline: [tanh], candidate: [tanh]}\nncu: {rows: [small], stages: [all]}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_NCU": "/nonexistent/ncu"}
    res = subprocess.run([sys.executable, "-m", "harness", "ncu", str(exp), "--profile-root", str(temp_repo.root / "profile")],
                         cwd=temp_repo.root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "ncu gate: INCONCLUSIVE" in res.stdout
    [path] = list((temp_repo.root / "profile" / "ncu-cli" / "ncu").glob("*/ncu.json"))
    rec = json.loads(path.read_text())
    assert rec["gate"]["status"] is None and "ncu not found" in rec["gate"]["reason"]


def test_dram_rate_derived_when_the_stored_report_lacks_it():
    """The H200's stored reports hold dram__bytes_read.sum but not its `.per_second` (the CLI computes
    that when printing). Figures from a real pkda_bwd_dAv_kernel launch there: 277,760 B in 4,896 ns;
    `ncu --import --csv --page raw` printed 56,732,026,143.79 byte/s."""
    la = full_launch("pkda_bwd_dAv_kernel", 4896, rd=277760, wr=0,
                     drop=("dram__bytes_read.sum.per_second",))
    rec = ncu.kernel_metrics({"full": [la]})["pkda_bwd_dAv_kernel"]
    assert rec["metrics"]["dram_read_bytes_per_s"] == pytest.approx(56_732_026_143.79, rel=1e-9)
    assert rec["sources"]["dram_read_bytes_per_s"].startswith("derived")
    assert "dram_read_bytes_per_s" not in rec["missing"]
    # without the bytes there is nothing to derive from: still missing, never 0
    la = full_launch("k", 4896, drop=("dram__bytes_read.sum.per_second", "dram__bytes_read.sum"))
    rec = ncu.kernel_metrics({"full": [la]})["k"]
    assert rec["metrics"]["dram_read_bytes_per_s"] is None and "dram_read_bytes_per_s" in rec["missing"]


@pytest.mark.parametrize("aa", [False, True])
def test_each_side_is_profiled_with_its_declared_env_and_an_aa_run_with_the_baselines(tmp_path, monkeypatch, aa):
    fake = _fake_ncu(tmp_path, 'if [ "$1" = --version ]; then echo "Version 2025.3.1.0"; exit 0; fi\n'
                               'for a in "$@"; do case "$a" in *-full) echo "$(basename "$a") KNOB=${KNOB:-unset}" '
                               '>> "$(dirname "$0")/env.log";; esac; done\n')
    monkeypatch.setenv("HARNESS_NCU", fake)
    monkeypatch.delenv("KNOB", raising=False)
    data = make_exp().model_dump(exclude_none=True)
    data["candidate"]["env"] = {"KNOB": "cand"}
    exp = Experiment.model_validate(data)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"aa": aa}))
    ncu.ncu_run(_loaded(tmp_path, exp), _revisions(tmp_path), run_dir, tmp_path / "profile", log=lambda s: None)
    lines = sorted((tmp_path / "env.log").read_text().split("\n"))[1:]
    assert lines == ["baseline-small-full KNOB=unset", f"candidate-small-full KNOB={'unset' if aa else 'cand'}"]


def test_a_package_side_is_profiled_as_installed_with_its_own_op(tmp_path, monkeypatch):
    fake = _fake_ncu(tmp_path, 'if [ "$1" = --version ]; then echo "Version 2025.3.1.0"; exit 0; fi\n')
    monkeypatch.setenv("HARNESS_NCU", fake)
    data = make_exp().model_dump(exclude_none=True)
    data["baseline"] = {"package": {"name": "fla-core", "version": "0.6.0"}, "op": "fla.ops.precond_kda:chunk_precond_kda"}
    exp = Experiment.model_validate(data)
    revs = _revisions(tmp_path)
    revs = Revisions(repo=revs.repo, candidate=revs.candidate, baseline=ResolvedSide(
        side="baseline", ref="fla-core==0.6.0", sha="", branch=None, worktree="", subject="installed",
        kind="package", package="fla-core", version="0.6.0"))
    ncu.ncu_run(_loaded(tmp_path, exp), revs, tmp_path / "run", tmp_path / "profile", log=lambda s: None)
    base = json.loads((tmp_path / "run" / "ncu" / "baseline-small-job.json").read_text())
    cand = json.loads((tmp_path / "run" / "ncu" / "candidate-small-job.json").read_text())
    assert base["package"] == {"name": "fla-core", "version": "0.6.0"}
    assert base["op"] == "fla.ops.precond_kda:chunk_precond_kda" and base["worktree"] == ""
    assert cand["package"] is None and cand["op"] == "op:op"
