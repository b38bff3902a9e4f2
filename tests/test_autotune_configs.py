"""tools/autotune_configs.py: each config of one autotuned kernel run alone in its own process
(CPU: Triton's interpreter), a failing config named with its error, the configs' outputs compared."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import git
import pytest
from tool_module import load_tool

ROOT = Path(__file__).resolve().parent.parent
PKDA_EXPERIMENT = ROOT / "experiments" / "pkda-fwd-ho-fused.yaml"
PKDA_SHAPE = "dense_K64_V128"  # a fixture shape: K != V, a partial chunk (the cpu: profile's dims)

tool = load_tool("autotune_configs")

# Three configs: BLOCK 32 fails at run time under the interpreter (static_assert raises there, as a
# faulting config would on the GPU); BUMP 1 computes 2.002 x instead of 2 x, a config whose answer
# is wrong by 1e-3 relative without raising (what only the output differences can show).
TOY_OP = '''\
import torch
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 16, "BUMP": 0}, num_warps=4),
                          triton.Config({"BLOCK": 32, "BUMP": 0}, num_warps=8),
                          triton.Config({"BLOCK": 64, "BUMP": 1}, num_warps=2)], key=["n"])
@triton.jit
def toy_double_kernel(x, y, n, BLOCK: tl.constexpr, BUMP: tl.constexpr):
    tl.static_assert(BLOCK != 32, "toy: BLOCK 32 is broken")
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y + o, tl.load(x + o, mask=m) * (2.0 + BUMP * 0.002), mask=m)


@triton.jit
def toy_plain_kernel(x, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x + o, tl.load(x + o, mask=o < n), mask=o < n)


def op(x):
    y = torch.empty_like(x)
    toy_double_kernel[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
    return y
'''

# the candidate side's op: the same kernel (re-exported: one autotuner found in two modules), then
# a process that never finishes (BLOCK 16) or dies by a signal (BLOCK 64), as a GPU fault can end one
TOY_DYING_OP = '''\
import os
import signal
import time

from toy_op import op as double, toy_double_kernel


def op(x):
    y = double(x)
    block = toy_double_kernel.best_config.kwargs["BLOCK"]
    if block == 64:
        os.kill(os.getpid(), signal.SIGSEGV)
    if block == 16:
        time.sleep(120)
    return y
'''

TOY_INPUTS = '''\
import torch


def make_inputs(shape, mode, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape["N"], generator=g, dtype=torch.float32).to(dtype).to(device)
    return {"args": (x,), "kwargs": {}, "grad_inputs": []}
'''


def toy_experiment(root: Path) -> Path:
    """A git repository with the toy op at one commit, and an experiment on it (git-ignored)."""
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "test")
        cw.set_value("user", "email", "test@example.invalid")
    (root / ".gitignore").write_text("experiments/\n")
    (root / "toy_op.py").write_text(TOY_OP)
    (root / "toy_dying_op.py").write_text(TOY_DYING_OP)
    repo.index.add(["toy_op.py", "toy_dying_op.py", ".gitignore"])
    sha = repo.index.commit("toy op").hexsha
    (root / "experiments").mkdir()
    (root / "experiments" / "inputs.py").write_text(TOY_INPUTS)
    path = root / "experiments" / "toy.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: toy
        description: one autotuned toy kernel with a broken config
        target:
          op: toy_op:op
          inputs: inputs.py:make_inputs
        baseline:
          ref: {sha}
        candidate:
          ref: main
          op: toy_dying_op:op
        modes: [fwd]
        dtype: float32
        shapes:
          - {{name: small, N: 200}}
        gates:
          - {{kind: speedup, name: endpoint, row: small, mode: fwd, threshold: 1.25}}
        """))
    return path


def run_tool(capsys, *args) -> tuple[int, str, str]:
    rc = tool.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def table_row(out: str, index: int) -> str:
    """The table's line of config `index` (lines start with the index, right-aligned)."""
    rows = [line for line in out.splitlines() if line.split()[:1] == [str(index)]]
    assert len(rows) == 1, out
    return rows[0]


# ------------------------------------------------------------------------ this project's kernel
def test_pkda_fused_walk_two_configs_agree_on_cpu(tmp_path, capsys):
    from kernels.pkda.fwd import HO_SPACE

    out_json = tmp_path / "records.json"
    rc, out, err = run_tool(capsys, PKDA_EXPERIMENT, "--kernel", "pkda_fwd_h_o_kernel", "--shape", PKDA_SHAPE,
                            "--mode", "fwd", "--device", "cpu", "--dtype", "float32", "--configs", "0,1",
                            "--json", out_json)
    assert rc == 0, out + err
    result = json.loads(out_json.read_text())
    # the whole space listed (interpreter off), not the interpreter's first config
    assert [(c["kwargs"]["BV"]["value"], c["num_warps"], c["num_stages"]) for c in result["space"]] == \
        [(meta["BV"], w, s) for meta, w, s in HO_SPACE]
    assert result["header"]["kernel"] == "kernels.pkda.fwd:pkda_fwd_h_o_kernel"
    first, second = result["records"]
    assert (first["status"], second["status"]) == ("ok", "ok")
    # each child launched the kernel with its own config only (BV 64 is not the interpreter's default)
    assert [c["kwargs"]["BV"]["value"] for c in first["launched"]] == [HO_SPACE[0][0]["BV"]]
    assert [c["kwargs"]["BV"]["value"] for c in second["launched"]] == [HO_SPACE[1][0]["BV"]]
    assert first["reference"] and second["diff"]["max_rel"] <= 1e-5
    assert len(second["diff"]["outputs"]) >= 1
    assert all(d["max_rel"] <= 1e-5 and d["nonfinite_mismatch"] == 0 for d in second["diff"]["outputs"])
    for index, (meta, warps, stages) in enumerate(HO_SPACE[:2]):
        row = table_row(out, index)
        assert f"w{warps} s{stages} BV={meta['BV']}" in row and " ok " in row
    assert "reference" in table_row(out, 0)


# ------------------------------------------------------------------------ a toy repository
@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return toy_experiment(tmp_path_factory.mktemp("toy") / "repo")


def test_interpreter_really_raises_on_the_broken_toy_config(toy, monkeypatch):
    """The premise of the next test: the toy's BLOCK 32 config raises under TRITON_INTERPRET=1."""
    import importlib.util

    import torch
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("_toy_op_premise", toy.parent.parent / "toy_op.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.toy_double_kernel
    assert isinstance(kernel, Autotuner) and len(kernel.configs) == 3
    broken = kernel.configs[1]
    kernel.configs = [broken]
    with pytest.raises(Exception, match="BLOCK 32 is broken"):
        module.op(torch.randn(40))


def test_toy_broken_config_is_failed_with_its_error_and_the_others_run(toy, tmp_path, capsys):
    out_json = tmp_path / "toy.json"
    rc, out, err = run_tool(capsys, toy, "--kernel", "toy_double_kernel", "--device", "cpu", "--mode", "fwd",
                            "--json", out_json)
    assert rc == 1, out + err
    records = json.loads(out_json.read_text())["records"]
    assert [r["status"] for r in records] == ["ok", "FAILED", "ok"]
    assert "BLOCK 32 is broken" in records[1]["error"]
    row = table_row(out, 1)
    assert "FAILED" in row and "BLOCK=32" in row and "w8" in row and "BLOCK 32 is broken" in row
    # the silently wrong config: 2.002 x against 2 x, 1e-3 of max |ref|
    diff = records[2]["diff"]
    assert diff["max_rel"] == pytest.approx(1e-3, rel=1e-3)
    assert diff["max_abs"] > 0 and diff["nonfinite_mismatch"] == 0
    assert " ok " in table_row(out, 2) and "worst out 0" in table_row(out, 2)


def test_toy_unknown_kernel_is_bad_input_naming_it(toy, capsys):
    rc, out, err = run_tool(capsys, toy, "--kernel", "no_such_kernel", "--device", "cpu")
    assert rc == 2, out + err
    assert "no_such_kernel" in err and "toy_op" in err  # the kernel and the modules searched


def test_toy_kernel_without_autotune_is_bad_input(toy, capsys):
    rc, out, err = run_tool(capsys, toy, "--kernel", "toy_plain_kernel", "--device", "cpu")
    assert rc == 2, out + err
    assert "toy_plain_kernel" in err and "not autotuned" in err


def test_bfloat16_on_cpu_is_refused_naming_dtype(toy, capsys):
    rc, out, err = run_tool(capsys, toy, "--kernel", "toy_double_kernel", "--device", "cpu", "--dtype", "bfloat16")
    assert rc == 2, out + err
    assert "--dtype bfloat16" in err and out == ""


def test_configs_outside_the_space_are_bad_input(toy, capsys):
    rc, out, err = run_tool(capsys, toy, "--kernel", "toy_double_kernel", "--device", "cpu", "--configs", "0,3")
    assert rc == 2, out + err
    assert "--configs 0,3" in err and "3 configs" in err


def test_toy_child_killed_by_a_signal_or_past_the_timeout_is_failed(toy, capsys):
    rc, out, err = run_tool(capsys, toy, "--kernel", "toy_double_kernel", "--device", "cpu", "--side", "candidate",
                            "--configs", "0,2", "--timeout", "20")
    assert rc == 1, out + err
    assert "FAILED" in table_row(out, 0) and "timed out after 20 s" in table_row(out, 0)
    row = table_row(out, 2)
    assert "FAILED" in row and "killed by SIGSEGV" in row and "Segmentation fault" in row
