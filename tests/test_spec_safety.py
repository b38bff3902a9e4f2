"""harness/spec.py reading hostile or absurd experiment files: every one refused with exit 2 and a
message naming the file, line and field, quickly and in bounded memory."""
from __future__ import annotations

import time

import pytest

from harness.cli import main
from harness.spec import MAX_YAML_BYTES, SpecError, load_experiment
from test_spec import GOOD, write


def refused(tmp_path, text: str | bytes, seconds: float = 5) -> str:
    """The SpecError message for an experiment file with this content, read within `seconds`."""
    if isinstance(text, bytes):
        (tmp_path / "inputs.py").write_text("def make_inputs(*a):\n    return {}\n")
        path = tmp_path / "exp.yaml"
        path.write_bytes(text)
    else:
        path = write(tmp_path, text)
    t0 = time.monotonic()
    with pytest.raises(SpecError) as e:
        load_experiment(path)
    assert time.monotonic() - t0 < seconds
    return str(e.value)


BOMB = """\
a: &a [x, x, x, x, x, x, x, x, x]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_alias_bomb_at_top_level_is_refused_quickly(tmp_path):
    msg = refused(tmp_path, BOMB + GOOD)
    assert "exp.yaml:6: <top>: more than 100000 values once aliases are expanded (an alias bomb?)" in msg


def test_alias_bomb_as_description_is_refused_quickly(tmp_path):
    anchors = BOMB.replace("a: &a", "x-a: &a").replace("\nb: &b", "\nx-b: &b")
    text = GOOD.replace("name: demo\n", "name: demo\n" + "".join(f"  {line}\n" for line in anchors.splitlines())
                        .replace("  x-a", "x-anchors:\n  x-a", 1) + "description: *i\n")
    assert "an alias bomb?" in refused(tmp_path, text)


def test_a_few_aliases_still_load(tmp_path):
    text = GOOD.replace("shapes:\n  - {name: dense, B: 2, T: 128, H: 2, K: 64, V: 64}",
                        "shapes:\n  - &dense {name: dense, B: 2, T: 128, H: 2, K: 64, V: 64}")
    text += "cpu:\n  shapes: [*dense]\n"
    assert load_experiment(write(tmp_path, text)).exp.cpu.shapes[0].T == 128


def test_random_bytes_are_refused_as_not_utf8(tmp_path):
    msg = refused(tmp_path, b"name: demo\n" + bytes(range(128, 256)) * 4)
    assert "exp.yaml:2: <top>: not UTF-8 text (byte 11): an experiment file is UTF-8 YAML" in msg


@pytest.mark.parametrize("nesting", ["[" * 5000 + "]" * 5000, "{a: " * 5000 + "1" + "}" * 5000])
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path, nesting):
    assert "nested deeper than 32 levels" in refused(tmp_path, GOOD + f"description: {nesting}\n")


@pytest.mark.parametrize("key", ["? [a, b]\n: 1\n", "{a: 1}: 2\n", "? {a: 1}\n: 2\n", "x: &k [1]\n*k : 3\n"])
def test_a_list_or_mapping_as_a_key_is_refused(tmp_path, key):
    assert "a mapping key must be a plain value, not a list or a mapping" in refused(tmp_path, GOOD + key)


def test_a_file_larger_than_any_experiment_is_refused_unread(tmp_path):
    msg = refused(tmp_path, GOOD + "#" * MAX_YAML_BYTES + "\n")
    assert f"an experiment file is at most {MAX_YAML_BYTES} bytes" in msg


@pytest.mark.parametrize("old, new, field, expected", [
    ("shapes:\n", "blocks: 1000000000\nshapes:\n", "blocks", "less than or equal to 1000"),
    ("T: 128,", "T: 1e20,", "shapes[0]", "dimension T must be a positive integer, got"),
    ("T: 128,", "T: 1.0e+20,", "shapes[0]", "dimension T must be a positive integer, got"),  # YAML 1.1 reads this form as a float
    ("T: 128,", "T: 100000000000000000000,", "shapes[0]", "more than a run can take (at most 2147483647)"),
    ("shapes:\n", "samples_per_block: 1e18\nshapes:\n", "samples_per_block", "valid integer"),
    ("shapes:\n", "samples_per_block: 1.0e+18\nshapes:\n", "samples_per_block", "valid integer"),
    ("shapes:\n", "samples_per_block: 1000000000000000000\nshapes:\n", "samples_per_block", "less than or equal to 100000"),
    ("B: 2,", "B: 8.0,", "shapes[0]", "dimension B must be a positive integer, got 8.0"),
    ("shapes:\n", "samples_per_block: true\nshapes:\n", "samples_per_block", "valid integer"),
    ("shapes:\n", "blocks: '5'\nshapes:\n", "blocks", "valid integer"),
    ("threshold: 1.10", "threshold: .inf", "gates[0].speedup.threshold", "finite number"),
    ("threshold: 1.10", "threshold: .nan", "gates[0].speedup.threshold", "finite number"),
    ("threshold: 1.10", "threshold: true", "gates[0].speedup.threshold", "valid number"),
    ("margin: 0.02", "margin: '0.02'", "gates[1].non_regression.margin", "valid number"),
    ("shapes:\n", "seed: 1e29\nshapes:\n", "seed", "valid integer"),
    ("shapes:\n", "seed: 1.0e+29\nshapes:\n", "seed", "valid integer"),
    ("shapes:\n", "seed: 100000000000000000000000000000\nshapes:\n", "seed", "less than or equal to 4294967295"),
    ("shapes:\n", "seed: -1\nshapes:\n", "seed", "greater than or equal to 0"),
    ("seqlens: [10, 0, 300]", "seqlens: [10, 0.5, 300]", "shapes[1].seqlens[1]", "valid integer"),
])
def test_numbers_must_be_integers_within_what_a_run_can_do_and_thresholds_finite(tmp_path, old, new, field, expected):
    assert old in GOOD
    msg = refused(tmp_path, GOOD.replace(old, new, 1))
    assert f": {field}: " in msg and expected in msg, msg


def test_env_value_with_a_nul_byte_is_refused(tmp_path):
    text = GOOD.replace("  ref: feature/x\n", '  ref: feature/x\n  env: {KNOB: "a\\0b"}\n')
    msg = refused(tmp_path, text)
    assert "exp.yaml:9: candidate.env: the value of KNOB holds a NUL byte" in msg


def test_inputs_outside_the_experiment_folder_and_repository_are_refused_before_running(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    evil = outside / "evil.py"
    evil.write_text(f"open({str(outside / 'ran')!r}, 'w').write('x')\ndef make_inputs(*a):\n    return {{}}\n")
    exp_dir = tmp_path / "repo" / "experiments"
    exp_dir.mkdir(parents=True)
    (tmp_path / "repo" / ".git").mkdir()  # the repository the experiment lives in
    rel = "../../elsewhere/evil.py"
    text = GOOD.replace("inputs: inputs.py:make_inputs", f"inputs: {rel}:make_inputs")
    msg = refused(exp_dir, text)
    assert f"exp.yaml:4: target.inputs: {rel} resolves to {evil}, outside the experiment's folder {exp_dir} and " \
           f"the target repository {tmp_path / 'repo'}; name a file elsewhere by its absolute path" in msg
    assert not (outside / "ran").exists()  # refused before the file was imported
    # named by its absolute path, the same file is the user's explicit choice
    (exp_dir / "exp.yaml").write_text(GOOD.replace("inputs: inputs.py:make_inputs", f"inputs: {evil}:make_inputs"))
    load_experiment(exp_dir / "exp.yaml")
    assert (outside / "ran").exists()


def test_training_model_outside_is_refused(tmp_path):
    text = GOOD + ("training:\n  - {name: tr, model: ../model.py:build, hidden: 8, heads: 1, head_dim: 8, vocab: 16, "
                   "B: 1, T: 8}\n")
    (tmp_path / "sub").mkdir()
    msg = refused(tmp_path / "sub", text)
    assert "training[0].model: ../model.py resolves to" in msg and "outside the experiment's folder" in msg


def test_cli_validate_exits_2_on_each_hostile_file(tmp_path, capsys):
    path = write(tmp_path, BOMB + GOOD)
    assert main(["validate", str(path)]) == 2
    assert "alias bomb" in capsys.readouterr().err


def test_a_number_with_an_exponent_and_no_dot_is_a_number(tmp_path):
    """YAML 1.1 (PyYAML) reads `1e-5` as a string; numbers are strict, so the loader reads it as YAML 1.2 does."""
    exp = load_experiment(write(tmp_path, GOOD.replace("margin: 0.02", "margin: 2e-2")
                                .replace("threshold: 1.10", "threshold: 11E-1"))).exp
    assert (exp.gates[0].threshold, exp.gates[1].margin) == (1.1, 0.02)
    assert "valid number" in refused(tmp_path, GOOD.replace("margin: 0.02", "margin: '2e-2'"))
