"""tools/power_runs.py's --measure: a measurement design tried on an experiment without copying its
file, checked as the file's own settings are, named in the output files."""
import importlib.util
from pathlib import Path

import pytest

from harness.spec import load_experiment

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("power_runs", ROOT / "tools" / "power_runs.py")
power_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(power_runs)


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
