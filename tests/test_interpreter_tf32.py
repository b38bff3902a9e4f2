"""harness/interpreter_tf32.py: fp32 dots that a GPU runs as TF32 drop the same bits under the
interpreter; "ieee" and "tf32x3" dots, and every dot of a process that did not ask, are untouched."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from harness import interpreter_tf32
from harness.measure.sides import side_env
from harness.spec import load_experiment

ROOT = Path(__file__).resolve().parent.parent


@triton.jit
def _dot_kernel(x, y, out, N: tl.constexpr, PREC: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(x + r[:, None] * N + r[None, :])
    b = tl.load(y + r[:, None] * N + r[None, :])
    tl.store(out + r[:, None] * N + r[None, :], tl.dot(a, b, input_precision=PREC))


@triton.jit
def _default_dot_kernel(x, y, out, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(x + r[:, None] * N + r[None, :])
    b = tl.load(y + r[:, None] * N + r[None, :])
    tl.store(out + r[:, None] * N + r[None, :], tl.dot(a, b))  # Triton's default: TF32 on a GPU


@pytest.fixture
def emulating(monkeypatch):
    """The patch on for one test, and the interpreter's own dot back afterwards."""
    from triton.runtime import interpreter

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(interpreter_tf32.ENV, "1")
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", interpreter.InterpreterBuilder.create_dot)
    assert interpreter_tf32.emulate_tf32_dots()
    assert interpreter_tf32.emulate_tf32_dots()  # a second call keeps one patch
    yield


def _run(kernel, x, y, **kw):
    out = torch.empty_like(x)
    kernel[(1,)](x, y, out, N=x.shape[0], **kw)
    return out.numpy()


def test_tf32_truncation_keeps_ten_mantissa_bits_and_nans():
    x = np.array([1 + 2.0**-10, 1 + 2.0**-11, -(1 + 2.0**-10 + 2.0**-12), np.inf, np.nan], dtype=np.float32)
    got = interpreter_tf32.tf32_truncated(x)
    assert got[:4].tolist() == [1 + 2.0**-10, 1.0, -(1 + 2.0**-10), np.inf]
    assert np.isnan(got[4]) and got.dtype == np.float32
    payload_nan = np.array([0x7F800001], dtype=np.uint32).view(np.float32)  # a NaN whose payload is a low bit
    assert np.isnan(interpreter_tf32.tf32_truncated(payload_nan)[0])


def test_dots_that_run_as_tf32_drop_the_low_bits_of_both_operands(emulating):
    torch.manual_seed(0)
    n = 16
    x, y = torch.randn(n, n), torch.randn(n, n)
    xt = interpreter_tf32.tf32_truncated(x.numpy())
    yt = interpreter_tf32.tf32_truncated(y.numpy())
    assert np.array_equal(_run(_default_dot_kernel, x, y), np.matmul(xt, yt))
    assert np.array_equal(_run(_dot_kernel, x, y, PREC="tf32"), np.matmul(xt, yt))
    full = np.matmul(x.numpy(), y.numpy())
    for prec in ("ieee", "tf32x3"):
        assert np.array_equal(_run(_dot_kernel, x, y, PREC=prec), full), prec
    # the size of the effect: TF32's 2^-11 relative rounding per operand, far above fp32's
    rel = np.abs(_run(_default_dot_kernel, x, y) - full).max() / np.abs(full).max()
    assert 1e-5 < rel < 1e-2
    # 16-bit operands are left alone (fp16 here: the interpreter's bf16 is unreliable, docs say)
    xh, yh = x.half(), y.half()
    out = torch.empty(n, n)
    _dot_kernel[(1,)](xh, yh, out, N=n, PREC="tf32")
    assert np.array_equal(out.numpy(), np.matmul(xh.numpy(), yh.numpy(), dtype=np.float32))


def test_off_without_the_variable(monkeypatch):
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", interpreter.InterpreterBuilder.create_dot)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(interpreter_tf32.ENV, raising=False)
    assert not interpreter_tf32.emulate_tf32_dots()
    torch.manual_seed(1)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    assert np.array_equal(_run(_default_dot_kernel, x, y), np.matmul(x.numpy(), y.numpy()))


def test_a_cpu_run_asks_for_it_unless_the_experiment_says_no(tmp_path):
    loaded = load_experiment(ROOT / "experiments" / "power-aa.yaml")
    assert side_env(loaded, "baseline", tmp_path, cpu_mode=True).get(interpreter_tf32.ENV) == "1"
    assert interpreter_tf32.ENV not in side_env(loaded, "baseline", tmp_path, cpu_mode=False)
    text = (ROOT / "experiments" / "power-aa.yaml").read_text().replace("cpu:\n", "cpu:\n  emulate_tf32: false\n", 1)
    (tmp_path / "power-aa.yaml").write_text(text)
    shutil.copytree(ROOT / "experiments" / "inputs", tmp_path / "inputs")  # the file's inputs factory
    off = load_experiment(tmp_path / "power-aa.yaml")
    assert off.exp.cpu.emulate_tf32 is False
    assert interpreter_tf32.ENV not in side_env(off, "baseline", tmp_path, cpu_mode=True)
