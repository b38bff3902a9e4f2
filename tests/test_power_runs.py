"""tools/power_runs.py's --measure: a measurement design tried on an experiment without copying its
file, checked as the file's own settings are, named in the output files."""
from pathlib import Path

import pytest

from harness.spec import load_experiment
from tool_module import load_tool

ROOT = Path(__file__).resolve().parent.parent
power_runs = load_tool("power_runs")


def test_measure_settings_replace_the_files_and_name_the_outputs():
    loaded = load_experiment(ROOT / "experiments" / "power-aa.yaml")
    same, suffix = power_runs.with_measure(loaded, [])
    assert same is loaded and suffix == ""
    changed, suffix = power_runs.with_measure(loaded, ["calls_per_burst=5", "min_rounds=30"])
    assert (changed.exp.measure.calls_per_burst, changed.exp.measure.min_rounds) == (5, 30)
    assert changed.exp.measure.max_pairs == loaded.exp.measure.max_pairs  # the rest as the file has it
    assert loaded.exp.measure.calls_per_burst == 1  # the loaded experiment itself is untouched
    assert suffix == "-calls_per_burst5-min_rounds30"


@pytest.mark.parametrize("setting,named", [("calls_per_bust=1", "calls_per_burst"), ("calls_per_burst", "KEY=VALUE"),
                                           ("calls_per_burst=0", "calls_per_burst"), ("pairs=two", "pairs")])
def test_a_bad_measure_setting_is_refused_by_name(setting, named):
    loaded = load_experiment(ROOT / "experiments" / "power-aa.yaml")
    with pytest.raises(SystemExit) as e:
        power_runs.with_measure(loaded, [setting])
    assert named in str(e.value) and setting in str(e.value)


def test_the_table_shows_left_out_rounds_and_retimed_calls():
    """A report's basis (harness/analyse.py) read into the run's summary and its table line; a report
    from before the re-timing (no retimed_calls) reads as 0."""
    iv = {"point": 1.001, "lo": 0.998, "hi": 1.004, "rel_half_width": 0.003}
    basis = {"speedup": iv, "aa_control": iv, "pairs": 8, "rounds": 96, "excluded_rounds": 2, "retimed_calls": 7,
             "stop": {"reason": "resolved", "seconds": 1.8}, "baseline": {"median": 0.21}, "candidate": {"median": 0.21}}
    old = {k: v for k, v in basis.items() if k != "retimed_calls"}
    report = {"run": {"id": "r1"}, "verdict": "GO", "gates": [],
              "rows": [{"name": "launch/fwd", "primary_basis": "graph", "bases": {"graph": basis, "eager": old}}]}
    run = power_runs.summarize_run(report, 27.0)
    assert [run["rows"][0]["bases"][b]["retimed_calls"] for b in ("graph", "eager")] == [7, 0]
    header, graph, eager = power_runs.table([run])
    assert "left retimed" in header
    assert graph.split()[-2:] == ["7", "resolved"] and graph.split()[-3] == "2"
    assert eager.split()[-2:] == ["0", "resolved"]
