"""Experiment-file validation: each kind of bad input is rejected naming the file, field and line."""
from __future__ import annotations

import textwrap

import pytest

from harness.cli import main
from harness.spec import SpecError, load_experiment

INPUTS = "def make_inputs(shape, mode, dtype, device, seed):\n    return {}\n\n" \
         "def shape_problem(shape):\n    return 'K must be 64 or 128' if shape['K'] not in (64, 128) else None\n"

GOOD = """\
name: demo
target:
  op: pkg.mod:op
  inputs: inputs.py:make_inputs
baseline:
  ref: 0123456789abcdef0123456789abcdef01234567
candidate:
  ref: feature/x
modes: [fwd, fwdbwd]
shapes:
  - {name: dense, B: 2, T: 128, H: 2, K: 64, V: 64}
  - {name: ragged, seqlens: [10, 0, 300], H: 2, K: 128, V: 64}
gates:
  - {kind: speedup, name: endpoint, row: dense, threshold: 1.10}
  - {kind: non_regression, name: no-regress, margin: 0.02}
"""


def write(tmp_path, text: str):
    (tmp_path / "inputs.py").write_text(INPUTS)
    p = tmp_path / "exp.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def errors(tmp_path, text: str) -> str:
    with pytest.raises(SpecError) as e:
        load_experiment(write(tmp_path, text))
    return str(e.value)


def test_good_file_loads_with_defaults(tmp_path):
    loaded = load_experiment(write(tmp_path, GOOD))
    exp = loaded.exp
    assert exp.blocks == 5 and exp.max_attempts == 3 and exp.order == "abba"
    assert exp.shapes[1].varlen and exp.shapes[1].tokens == 310
    assert exp.gates[0].threshold == 1.10


@pytest.mark.parametrize("old,new,field,line", [
    ("modes: [fwd, fwdbwd]", "modes: [fwd, fwdbwd]\nbogus: 1", "bogus", 10),  # unknown key
    ("modes: [fwd, fwdbwd]", "modes: [fwd, fwdbwd]\nblocks: 2", "blocks", 10),  # blocks < 3
    ("modes: [fwd, fwdbwd]", "modes: [fwd, fwdbwd]\nblocks: many", "blocks", 10),  # wrong type
    ("threshold: 1.10", "threshold: 0", "gates[0].speedup.threshold", 14),  # threshold <= 0
    ("B: 2, T: 128", "B: 2", "shapes[0]", 11),  # dense shape without T
    ("ref: feature/x", "ref: 'x; rm -rf /'", "candidate.ref", 8),  # shell metacharacters
    ("ref: 0123456789abcdef0123456789abcdef01234567", "ref: main", "baseline.ref", 6),  # not a SHA
    ("row: dense", "row: nosuch", "gates[0].row", 14),  # gate names an unknown row
    ("threshold: 1.10}", "threshold: 1.10, basis: cpu}", "gates[0].speedup.basis", 14),  # not wall/device
])
def test_bad_values_name_field_and_line(tmp_path, old, new, field, line):
    text = GOOD.replace(old, new)
    assert text != GOOD
    msg = errors(tmp_path, text)
    assert f"exp.yaml:{line}: {field}" in msg, msg


def test_empty_shape_list(tmp_path):
    text = GOOD.split("shapes:")[0] + "shapes: []\ngates:\n  - {kind: non_regression, name: n, margin: 0.02}\n"
    msg = errors(tmp_path, text)
    assert "shapes" in msg and "at least 1" in msg


def test_shape_the_op_cannot_take(tmp_path):
    msg = errors(tmp_path, GOOD.replace("K: 64, V: 64", "K: 96, V: 64"))
    assert "shapes[0] (dense)" in msg and "K must be 64 or 128" in msg and "exp.yaml:11" in msg


def test_duplicate_key_and_bad_yaml(tmp_path):
    assert "duplicate key 'modes'" in errors(tmp_path, GOOD + "modes: [fwd]\n")
    assert "not valid YAML" in errors(tmp_path, GOOD + "  - [unclosed\n")


def test_cli_validate_exit_codes(tmp_path, capsys):
    good = write(tmp_path, GOOD)
    assert main(["validate", str(good)]) == 0
    good.write_text(GOOD.replace("modes: [fwd, fwdbwd]", "modes: [fwd, backward]"))
    assert main(["validate", str(good)]) == 2
    err = capsys.readouterr().err
    assert "exp.yaml:9: modes[1]" in err and "fwdbwd" in err


def test_byte_expression_is_checked_at_load(tmp_path):
    gate = "\n  - {kind: peak_alloc, name: peak, rows: [dense], mode: fwd, min_reduction_bytes: \"__import__('os').getcwd()\"}\n"
    msg = errors(tmp_path, GOOD.rstrip("\n") + gate)
    assert "gates[2].peak_alloc.min_reduction_bytes" in msg and "arithmetic expression" in msg
    ok = "\n  - {kind: peak_alloc, name: peak, rows: [dense], mode: fwd, min_reduction_bytes: '4*B*T*H*64 + 4*NK*B*T*H'}\n"
    assert load_experiment(write(tmp_path, GOOD.rstrip("\n") + ok)).exp.gates[2].min_reduction_bytes.startswith("4*B")


def test_device_basis_is_for_whole_call_gates(tmp_path):
    text = GOOD.replace("threshold: 1.10}", "threshold: 1.10, stage: intra, basis: device}") + \
        "stages:\n  intra: {baseline: [k], candidate: [k]}\n"
    msg = errors(tmp_path, text)
    assert "gates[0].basis" in msg and "device time already" in msg, msg
    unprofiled = GOOD.replace("threshold: 1.10}", "threshold: 1.10, basis: device}") + "stage_iters: 0\n"
    msg = errors(tmp_path, unprofiled)
    assert "exp.yaml:14: gates[0].basis" in msg and "stage_iters must be >= 1" in msg, msg
    ok = load_experiment(write(tmp_path, GOOD.replace("margin: 0.02}", "margin: 0.02, basis: device}")))
    assert ok.exp.gates[1].basis == "device" and ok.exp.gates[0].basis == "auto"  # auto: the row's primary basis
    older = load_experiment(write(tmp_path, GOOD.replace("threshold: 1.10}", "threshold: 1.10, basis: wall}")))
    assert older.exp.gates[0].basis == "eager"  # older files' `wall` is the eager basis
