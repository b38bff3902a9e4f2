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
    ("B: 2, T: 128", "B: 2, T: 0", "shapes[0]", 11),  # a dimension that is not a positive integer
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
    assert main(["validate", "--schema-only", str(good)]) == 0
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


def test_stages_that_share_a_kernel_are_refused_at_load(tmp_path):
    # a kernel counts in one stage; the profile stopped at such an overlap only after a device
    # run's verify (pkda-atk-tc, 2026-12-07): the file is refused at load now, naming both stages
    both = GOOD + "stages:\n  state: {baseline: [fwd_h_kernel, dhu_kernel], candidate: [fwd_h_kernel, dhu_kernel]}\n" \
        "  dhu: {baseline: [dhu_kernel], candidate: [dhu_kernel]}\n"
    msg = errors(tmp_path, both)
    assert "stages.dhu.baseline" in msg and "'state' and 'dhu' both match kernels named 'dhu_kernel'" in msg, msg
    by_regex = GOOD + "stages:\n  a: {baseline: ['bwd_.*'], candidate: [x]}\n  b: {baseline: [bwd_dhu], candidate: [y]}\n"
    assert "'a' and 'b' both match kernels named 'bwd_dhu'" in errors(tmp_path, by_regex)
    apart = GOOD + "stages:\n  a: {baseline: [fwd_h_kernel], candidate: [fwd_h_kernel]}\n" \
        "  b: {baseline: [dhu_kernel, 'dhu_.*_kernel'], candidate: [dhu_kernel]}\n"
    assert sorted(load_experiment(write(tmp_path, apart)).exp.stages) == ["a", "b"]


FREE_DIMS = """\
name: pairwise
target:
  repo: ../elsewhere
  op: pkg.mod:op
  inputs: inputs.py:make_inputs
baseline:
  ref: 0123456789abcdef0123456789abcdef01234567
candidate:
  ref: feature/x
modes: [fwdbwd]
shapes:
  - {name: wide, M: 4096, N: 512, D: 64}
gates:
  - {kind: peak_alloc, name: peak, rows: [wide], min_reduction_bytes: "4*M*N"}
  - {kind: pytest, name: own, path: tests/test_op.py, k: fast}
fixture_shapes:
  - {name: tiny, M: 3, N: 2, D: 1}
fixtures:
  reference: adapter.py:ref
  cases: [tiny]
  rtol: 0.001
  atol: 0.0
"""


FREE_INPUTS = "def make_inputs(shape, mode, dtype, device, seed):\n    return {}\n\n" \
              "def shape_problem(shape):\n    return None if {'M', 'N', 'D'} <= set(shape) else 'needs M, N, D'\n"


def write_free(tmp_path, text: str):
    path = write(tmp_path, text)
    (tmp_path / "inputs.py").write_text(FREE_INPUTS)
    (tmp_path / "adapter.py").write_text("def ref(x):\n    return x\n")
    return path


def test_free_form_dims_adapter_and_target_beside_the_file(tmp_path):
    from harness.gates import eval_bytes_expr, shape_dims

    loaded = load_experiment(write_free(tmp_path, FREE_DIMS))
    wide = loaded.exp.shapes[0]
    assert wide.dims == {"M": 4096, "N": 512, "D": 64} and wide.tokens is None
    assert shape_dims(wide) == {"M": 4096, "N": 512, "D": 64}  # no B, T or K: nothing derived
    assert eval_bytes_expr("4*M*N", shape_dims(wide)) == 4 * 4096 * 512
    assert loaded.target_repo == (tmp_path.parent / "elsewhere").resolve()
    assert loaded.reference_adapter == tmp_path / "adapter.py" and loaded.exp.fixtures.reference_is_adapter
    assert loaded.exp.gates[1].path == "tests/test_op.py" and loaded.exp.gates[1].run_on_cpu
    # PKDA's names keep their meaning: tokens, NT, NK derived from B, T, K or seqlens
    ragged = load_experiment(write(tmp_path, GOOD)).exp.shapes[1]
    assert shape_dims(ragged) == {"H": 2, "K": 128, "V": 64, "B": 1, "T": 310, "NT": 1 + 0 + 5, "tokens": 310, "NK": 2}


@pytest.mark.parametrize("old,new,field,problem", [
    ('"4*M*N"', '"4*B*T*M"', "gates[0].min_reduction_bytes", "uses ['B', 'T'], not a dimension of row 'wide'"),
    ("D: 64}", "D: 64, tokens: 3}", "shapes[0]", "'tokens' is computed from the other dims"),
    ("D: 64}", "D: 1.5}", "shapes[0]", "dimension D must be a positive integer, got 1.5"),
    ("path: tests/test_op.py", "path: ../outside.py", "gates[1].pytest.path", "relative to the target repository"),
    ("k: fast}", "k: fast, cpu_k: x, run_on_cpu: false}", "gates[1].pytest", "cpu_k selects the tests of a CPU run"),
    ("reference: adapter.py:ref", "reference: missing.py:ref", "fixtures.reference", "missing.py does not exist"),
])
def test_free_form_problems_name_their_field(tmp_path, old, new, field, problem):
    text = FREE_DIMS.replace(old, new)
    assert text != FREE_DIMS
    with pytest.raises(SpecError) as e:
        load_experiment(write_free(tmp_path, text))
    assert field in str(e.value) and problem in str(e.value), str(e.value)


def test_a_shape_problem_that_raises_is_named(tmp_path):
    msg = errors(tmp_path, GOOD.replace("{name: dense, B: 2, T: 128, H: 2, K: 64, V: 64}", "{name: dense, M: 2}"))
    assert "shapes[0] (dense)" in msg and "shape_problem raised KeyError: 'K'" in msg, msg


CPU_FIXTURES = FREE_DIMS + """\
cpu:
  shapes: [{name: wide, M: 8, N: 4, D: 2}]
  fixture_shapes: [{name: tiny, M: 2, N: 1, D: 1}]
"""


@pytest.mark.parametrize("old,new,problem", [
    ("fixture_shapes: [{name: tiny, M: 2", "fixture_shapes: [{name: small, M: 2",
     "names ['small'] must be unique names from fixture_shapes ['tiny']"),
    ("fixture_shapes: [{name: tiny, M: 2, N: 1, D: 1}]", "fixture_shapes: [{name: tiny, M: 2, N: 1, D: 1}, {name: tiny, M: 1, N: 1, D: 1}]",
     "names ['tiny', 'tiny'] must be unique"),
    ("fixture_shapes: [{name: tiny, M: 2, N: 1, D: 1}]", "fixture_shapes: [{name: tiny, M: 2, N: 1}]",
     "cpu.fixture_shapes[0] (tiny)"),  # the inputs factory cannot take it: named like any shape
])
def test_cpu_fixture_stand_ins_name_declared_cases(tmp_path, old, new, problem):
    loaded = load_experiment(write_free(tmp_path, CPU_FIXTURES))
    assert loaded.exp.cpu.fixture_shapes[0].dims == {"M": 2, "N": 1, "D": 1}
    assert (loaded.exp.cpu.warmup, loaded.exp.cpu.profile_iters) == (0, 1)  # the CPU defaults
    text = CPU_FIXTURES.replace(old, new)
    assert text != CPU_FIXTURES
    with pytest.raises(SpecError) as e:
        load_experiment(write_free(tmp_path, text))
    assert "cpu.fixture_shapes" in str(e.value) and problem in str(e.value), str(e.value)
