"""GPU smoke check of the PKDA op on a CUDA machine: compiles every stage, compares output and
gradients with the naive recurrence (fp64 on the GPU) at small shapes in fp32 and bf16, and prints
the relative errors. Usage: python tools/gpu_check.py [--big]  (--big adds B4_T2048_H16_D128 bf16
against fla-core's chunk_precond_kda when fla is importable)."""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.pkda import chunk_precond_kda, naive_recurrent_precond_kda  # noqa: E402

_spec = importlib.util.spec_from_file_location("pkda_inputs", ROOT / "experiments/inputs/pkda.py")
inputs_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inputs_mod)

GRADS = ["q", "k", "v", "g", "g_atk", "beta_atk", "beta", "log_atk_scale"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(fn, kw, cot):
    kw = {n: (t.detach().clone().requires_grad_(n in GRADS) if torch.is_tensor(t) and t.is_floating_point() else t)
          for n, t in kw.items()}
    o = fn(**kw)[0]
    grads = torch.autograd.grad(o, [kw[n] for n in GRADS], cot.to(o.dtype))
    return o.detach(), dict(zip(GRADS, grads))


def check(shape: dict, dtype: torch.dtype) -> None:
    kw = inputs_mod.make_inputs(shape, "fwdbwd", dtype, "cuda", seed=0)["kwargs"]
    t0 = time.time()
    cot = torch.randn(kw["v"].shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    o, g = run(chunk_precond_kda, kw, cot)
    torch.cuda.synchronize()
    t_ours = time.time() - t0
    ref_kw = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()}

    def naive(**a):
        return naive_recurrent_precond_kda(**a, compute_dtype=torch.float64)

    ro, rg = run(naive, ref_kw, cot.double())
    errs = {"o": rel(o, ro), **{n: rel(g[n], rg[n]) for n in GRADS}}
    worst = max(errs.values())
    print(f"{shape['name']:<28} {str(dtype):<15} first call {t_ours:6.1f}s  worst rel err {worst:.2e}  "
          + " ".join(f"{n}={e:.1e}" for n, e in errs.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    shapes = [
        {"name": "dense_K64_V64_T100", "B": 2, "T": 100, "H": 2, "K": 64, "V": 64},
        {"name": "dense_K64_V128_T130", "B": 1, "T": 130, "H": 3, "K": 64, "V": 128},
        {"name": "dense_K128_V64_T64", "B": 2, "T": 64, "H": 2, "K": 128, "V": 64},
        {"name": "dense_K128_V128_T300", "B": 1, "T": 300, "H": 2, "K": 128, "V": 128},
        {"name": "varlen_K128_V64", "seqlens": [1, 63, 130, 0, 70], "H": 2, "K": 128, "V": 64},
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for s in shapes:
            try:
                check(s, dtype)
            except Exception as e:  # keep going: one broken stage should not hide the others
                print(f"{s['name']:<28} {str(dtype):<15} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
