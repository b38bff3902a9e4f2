"""TF32 dots under Triton's interpreter, as a GPU computes them.

On a GPU, `tl.dot` of two fp32 operands runs on the tensor cores as TF32 unless the kernel asks for
`input_precision="ieee"` (or "tf32x3"): each operand keeps 10 of its 23 mantissa bits (Triton passes
the fp32 bits unrounded and the tensor cores ignore the low 13), the products accumulate in fp32.
Triton's interpreter ignores `input_precision` and multiplies in full fp32, so a CPU freeze passes
tolerances the GPU cannot meet: fla's chunk_precond_kda baseline passed rtol 0.002 + atol 0.0002
on the CPU and read 1.77x of it on an H100 (docs/perf/fla.md). With this patch the interpreter drops
the same 13 bits of both operands of every dot that runs as TF32, so the CPU oracle meets the
GPU's arithmetic on that point (accumulation order and fp32 rounding elsewhere still differ).

A CPU run's side processes turn it on (`cpu.emulate_tf32`, default true: harness/measure/sides.py
sets HARNESS_EMULATE_TF32=1 beside TRITON_INTERPRET=1); the workers call `emulate_tf32_dots` before
the op is imported. Kernels whose dots declare "ieee" for fp32 (all of PKDA's) are unchanged.
"""
from __future__ import annotations

import os

import numpy as np

ENV = "HARNESS_EMULATE_TF32"
TF32_DROPPED_BITS = np.uint32(0xFFFFE000)  # sign, exponent and the top 10 mantissa bits kept


def tf32_truncated(x: np.ndarray) -> np.ndarray:
    """fp32 values with their low 13 mantissa bits cleared; NaNs stay NaN (a payload only in those
    bits would otherwise become an infinity)."""
    out = (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & TF32_DROPPED_BITS).view(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def emulate_tf32_dots() -> bool:
    """Patch the interpreter's dot when this process interprets Triton and HARNESS_EMULATE_TF32=1;
    True when the patch is (or already was) in place."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get(ENV) != "1":
        return False
    try:
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 - no Triton here: nothing to patch
        return False
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_harness_tf32", False):
        return True
    full_precision_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision == ir.INPUT_PRECISION.TF32 and a.data.dtype == np.float32 and b.data.dtype == np.float32:
            a = interpreter.TensorHandle(tf32_truncated(a.data), a.dtype.scalar)
            b = interpreter.TensorHandle(tf32_truncated(b.data), b.dtype.scalar)
        return full_precision_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._harness_tf32 = True
    builder.create_dot = create_dot
    return True
