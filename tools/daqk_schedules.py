"""Diagnostic on a CUDA machine: the two dAqk schedules of the PKDA backward in one process.

    python tools/daqk_schedules.py [--rows B4_T2048_H16_D128,...] [--rep MS]

For each row (bf16, inputs from experiments/inputs/pkda.py): the gradients of the on-chip
schedule (PKDA_DAQK_ONCHIP=1) against the materialised one (relative L2 per tensor), then
the fwd+bwd median of each (triton.testing.do_bench) and the device time of the replaced
kernels (torch.profiler). Small shapes are also checked against the fp64 naive recurrence.
This is a quick look before a harness run, not a verdict: the experiment's interleaved
blocks in fresh processes are what decide.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.pkda import chunk_precond_kda, naive_recurrent_precond_kda  # noqa: E402
from kernels.pkda.bench import ROWS  # noqa: E402
from tools.gpu_check import GRADS, inputs_mod, rel, run  # noqa: E402  (the same inputs, leaves and error)

REPLACED = ("pkda_bwd_dAv", "pkda_bwd_intra", "pkda_bwd_beta_reduce", "pkda_bwd_dv_only")
SMALL = [
    {"name": "dense_K64_V128_T130", "B": 1, "T": 130, "H": 3, "K": 64, "V": 128},
    {"name": "dense_K128_V64_T200", "B": 2, "T": 200, "H": 2, "K": 128, "V": 64},
    {"name": "varlen_K128_V128", "seqlens": [1, 63, 130, 0, 70], "H": 2, "K": 128, "V": 128},
]


def set_schedule(onchip: bool) -> None:
    os.environ["PKDA_DAQK_ONCHIP"] = "1" if onchip else "0"


def grads_of(fn, kw, cot):
    o, grads = run(fn, kw, cot)
    return {"o": o, **grads}


def compare(shape, with_naive: bool) -> None:
    kw = inputs_mod.make_inputs(shape, "fwdbwd", torch.bfloat16, "cuda", seed=0)["kwargs"]
    cot = torch.randn(kw["v"].shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    set_schedule(False)
    mat = grads_of(chunk_precond_kda, kw, cot)
    set_schedule(True)
    onc = grads_of(chunk_precond_kda, kw, cot)
    line = " ".join(f"{n}={rel(onc[n], mat[n]):.1e}" for n in mat)
    print(f"{shape['name']:<26} onchip vs materialised: {line}", flush=True)
    if with_naive:
        ref_kw = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()}
        ref = grads_of(lambda **a: naive_recurrent_precond_kda(**a, compute_dtype=torch.float64), ref_kw, cot.double())
        for name, got in (("materialised", mat), ("onchip", onc)):
            worst = max(rel(got[n], ref[n]) for n in ref)
            print(f"{'':<26} {name:<12} vs fp64 naive: worst rel {worst:.2e}", flush=True)


def timing(name: str, rep: int) -> None:
    from triton.testing import do_bench
    shape = {"name": name, **ROWS[name]}
    kw = inputs_mod.make_inputs(shape, "fwdbwd", torch.bfloat16, "cuda", seed=0)["kwargs"]
    kw = {n: (t.detach().requires_grad_(n in GRADS) if torch.is_tensor(t) and t.is_floating_point() else t)
          for n, t in kw.items()}
    do = torch.randn_like(kw["v"])
    leaves = [kw[n] for n in GRADS]

    def step():
        for t in leaves:
            t.grad = None
        chunk_precond_kda(**kw)[0].backward(do)

    out = {}
    for onchip in (False, True, False, True):  # ABAB in one process
        set_schedule(onchip)
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = do_bench(step, rep=rep, return_mode="median")
        peak = torch.cuda.max_memory_allocated()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        dev = sum(e.self_device_time_total for e in prof.key_averages()) / 3e3
        repl = sum(e.self_device_time_total for e in prof.key_averages() if e.key.startswith(REPLACED)) / 3e3
        key = "onchip" if onchip else "materialised"
        out.setdefault(key, []).append((ms, dev, repl, peak))
        print(f"{name:<22} {key:<12} fwdbwd median {ms:7.3f} ms  device {dev:7.3f} ms  "
              f"replaced kernels {repl:6.3f} ms  peak {peak / 2**20:8.1f} MiB", flush=True)
    kernels = sorted(((e.key, e.self_device_time_total / 3e3) for e in prof.key_averages()
                      if e.self_device_time_total > 0), key=lambda x: -x[1])
    print("  on-chip kernels:", ", ".join(f"{k}={t:.3f}" for k, t in kernels[:12]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="B4_T2048_H16_D128,B8_T1024_H8_D64")
    ap.add_argument("--rep", type=int, default=300)
    ap.add_argument("--no-small", action="store_true")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), torch.__version__, flush=True)
    if not a.no_small:
        for s in SMALL:
            compare(s, with_naive=True)
    for name in filter(None, a.rows.split(",")):
        compare({"name": name, **ROWS[name]}, with_naive=False)
        timing(name, a.rep)


if __name__ == "__main__":
    main()
