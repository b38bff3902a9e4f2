"""Side-by-side benchmark of our PKDA op and fla-core's chunk_precond_kda on one CUDA device.

    python -m kernels.pkda.bench [--rows REGEX] [--modes fwd,fwdbwd] [--json OUT]
                                 [--rep MS] [--warmup MS] [--no-fla] [--no-profile] [--no-check]

Rows are the design note's registered shapes, bf16, inputs from experiments/inputs/pkda.py
(same seed for both sides). For each row and mode it prints as it goes: median / p20 / p80
wall time (triton.testing.do_bench) of ours and of fla-core (if importable), the ratio
fla/ours (> 1: ours faster), our per-stage share of device kernel time (torch.profiler),
and a bf16 cross-check of o and every gradient against fla-core (relative L2 error).
Rows our op refuses or that run out of memory are reported and skipped.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
ROWS = {
    "B1_T8192_H96_D128": dict(B=1, T=8192, H=96, K=128, V=128),
    "B2_T16384_H16_D128": dict(B=2, T=16384, H=16, K=128, V=128),
    "B4_T2048_H16_D128": dict(B=4, T=2048, H=16, K=128, V=128),
    "B4_T4096_H64_D128": dict(B=4, T=4096, H=64, K=128, V=128),
    "B8_T2048_H32_D256": dict(B=8, T=2048, H=32, K=256, V=256),
    "B8_T1024_H8_D64": dict(B=8, T=1024, H=8, K=64, V=64),
}
# kernel name -> stage (fwd kernels inside fwdbwd also include the backward's recompute)
STAGE_OF = [
    (r"pkda_fwd_l2norm", "fwd.l2norm"), (r"pkda_fwd_atk", "fwd.atk"),
    (r"pkda_fwd_intra|pkda_fwd_solve", "fwd.intra"), (r"pkda_fwd_wu", "fwd.wu"), (r"pkda_fwd_h", "fwd.h"),
    (r"pkda_fwd_o", "fwd.o"),
    (r"pkda_bwd_l2norm", "bwd.l2norm"), (r"pkda_bwd_dAv", "bwd.dAv"), (r"pkda_bwd_dhu", "bwd.dhu"),
    (r"pkda_bwd_wy_dqkg", "bwd.wy_dqkg"), (r"pkda_bwd_intra|pkda_bwd_beta_reduce", "bwd.intra"),
    (r"pkda_bwd_dg", "bwd.intra(dg)"), (r"pkda_bwd_atk", "bwd.atk"),
]


def log(*a):
    print(*a, flush=True)


def load_inputs_module():
    spec = importlib.util.spec_from_file_location("pkda_inputs", ROOT / "experiments/inputs/pkda.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def load_fla():
    try:
        from fla.ops.precond_kda import chunk_precond_kda as fla_op
        return fla_op
    except Exception as e:  # noqa: BLE001
        log(f"fla-core not importable ({type(e).__name__}: {e}); timing ours only")
        return None


def make_call(op, kw, mode, do):
    leaves = [t for t in kw.values() if torch.is_tensor(t) and t.requires_grad]
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return op(**kw)[0]
    else:
        def fn():
            for t in leaves:
                t.grad = None
            o = op(**kw)[0]
            o.backward(do)
            return o
    return fn


def timeit(fn, warmup, rep):
    import triton.testing
    fn()  # compile / autotune outside the timed part
    torch.cuda.synchronize()
    med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return dict(median_ms=med, p20_ms=p20, p80_ms=p80)


def stage_shares(fn, iters=3):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0)
        if t and t > 0:
            per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + t / iters
    total = sum(per_kernel.values())
    stages = {}
    for name, t in per_kernel.items():
        st = next((s for pat, s in STAGE_OF if re.search(pat, name)), "other")
        stages[st] = stages.get(st, 0.0) + t
    return dict(device_us=total, stages_us=stages,
                kernels_us=dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]))


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cross_check(ours, fla_op, inputs_mod, shape, seed=0):
    """bf16: o and every gradient of ours vs fla-core on identical inputs and do."""
    res = {}
    sides = {}
    for name, op in (("ours", ours), ("fla", fla_op)):
        d = inputs_mod.make_inputs(shape, "fwdbwd", torch.bfloat16, "cuda", seed)
        kw = d["kwargs"]
        o = op(**kw)[0]
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        do = torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device)
        o.backward(do)
        sides[name] = {"o": o.detach()} | {n: kw[n].grad.detach() for n in d["grad_inputs"]
                                           if kw[n].grad is not None}
    for n, ref in sides["fla"].items():
        if n in sides["ours"]:
            res[n] = rel(sides["ours"][n], ref)
    return res


def naive_check(device="cuda", cases=None):
    """Our op (o, finals and every gradient) vs the fp64 naive recurrence on small shapes:
    fp32 dense K != V, bf16 dense, bf16 varlen with an empty sequence. Returns records."""
    import torch.nn.functional as F
    from kernels.pkda import chunk_precond_kda, naive_recurrent_precond_kda
    cases = cases or [(torch.float32, 64, 128, 200, None), (torch.bfloat16, 128, 128, 300, None),
                      (torch.bfloat16, 128, 64, 300, [0, 37, 37, 300])]
    out = []
    for dt, K, V, T, cu in cases:
        B, H = (1 if cu else 2), 2
        N = len(cu) - 1 if cu else B
        gen = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=gen)
        d = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=F.logsigmoid(r(B, T, H, K)),
                 g_atk=F.logsigmoid(r(B, T, H)), beta_atk=torch.sigmoid(r(B, T, H)),
                 beta=torch.sigmoid(r(B, T, H)))
        d = {n: t.to(dt).to(device) for n, t in d.items()}
        d.update(log_atk_scale=r(H).to(device), initial_state=r(N, H, K, V).to(device),
                 initial_A_state=torch.rand(N, H, K, generator=gen).to(device))
        cs = torch.tensor(cu, dtype=torch.int32, device=device) if cu else None
        leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
        res = chunk_precond_kda(**leaves, output_final_state=True, cu_seqlens=cs)
        w = [torch.randn(t.shape, generator=gen).to(device) for t in res]
        sum((a * b).sum() for a, b in zip(res, w)).backward()
        ref = {n: t.double().requires_grad_(True) for n, t in d.items()}
        nres = naive_recurrent_precond_kda(**ref, output_final_state=True, cu_seqlens=cs,
                                           compute_dtype=torch.float64)
        sum((a.double() * b.double()).sum() for a, b in zip(nres, w)).backward()
        rec = dict(dtype=str(dt), K=K, V=V, T=T, cu_seqlens=cu)
        rec.update({n: rel(a, b) for n, a, b in zip(("o", "final_state", "final_A_state"), res, nres)})
        rec.update({f"d{n}": rel(leaves[n].grad, ref[n].grad) for n in d})
        out.append(rec)
    return out


def run_row(name, shape, mode, args, ours, fla_op, inputs_mod):
    rec = dict(row=name, mode=mode, shape=shape)
    problem = inputs_mod.shape_problem(shape)
    for side, op in (("ours", ours), ("fla", fla_op)):
        if op is None:
            continue
        if side == "ours" and problem:
            rec["ours"] = dict(skipped=problem)
            continue
        try:
            d = inputs_mod.make_inputs(shape, mode, torch.bfloat16, "cuda", args.seed) if not problem \
                else _raw_inputs(shape, mode)
            kw = d["kwargs"]
            do = torch.randn(shape["B"], shape["T"], shape["H"], shape["V"], device="cuda",
                             dtype=torch.bfloat16)
            fn = make_call(op, kw, mode, do)
            t0 = time.time()
            rec[side] = timeit(fn, args.warmup, args.rep)
            rec[side]["first_call_s"] = round(time.time() - t0, 1)
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            rec[side]["peak_alloc_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
            if side == "ours" and not args.no_profile:
                rec["ours"]["profile"] = stage_shares(fn)
            del d, kw, fn, do
        except torch.cuda.OutOfMemoryError as e:
            rec[side] = dict(error=f"OOM: {str(e).splitlines()[0]}")
        except Exception as e:  # noqa: BLE001
            rec[side] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=3))
        torch.cuda.empty_cache()
    o, f = rec.get("ours", {}), rec.get("fla", {})
    if "median_ms" in o and "median_ms" in f:
        rec["fla_over_ours"] = f["median_ms"] / o["median_ms"]
    if mode == "fwdbwd" and fla_op is not None and not problem and not args.no_check:
        try:
            rec["check_rel_err"] = cross_check(ours, fla_op, inputs_mod, shape)
        except Exception as e:  # noqa: BLE001
            rec["check_rel_err"] = dict(error=f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    return rec


def _raw_inputs(shape, mode):
    """Inputs for a shape our factory refuses (fla-only rows), same distributions."""
    import torch.nn.functional as F
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    need = mode == "fwdbwd"
    mk = lambda t: t.to(torch.bfloat16).cuda().requires_grad_(need)
    kw = dict(q=mk(r(B, T, H, K)), k=mk(r(B, T, H, K)), v=mk(r(B, T, H, V)),
              g=mk(F.logsigmoid(r(B, T, H, K))), g_atk=mk(F.logsigmoid(r(B, T, H))),
              beta_atk=mk(torch.sigmoid(r(B, T, H))), beta=mk(torch.sigmoid(r(B, T, H))),
              log_atk_scale=r(H).cuda().requires_grad_(need), x=1.5)
    return dict(args=(), kwargs=kw, grad_inputs=[])


def fmt(rec):
    def ms(side):
        s = rec.get(side)
        if not s:
            return "-"
        if "median_ms" in s:
            return f"{s['median_ms']:.3f} [{s['p20_ms']:.3f},{s['p80_ms']:.3f}]"
        return (s.get("skipped") or s.get("error", "?"))[:40]
    ratio = f"{rec['fla_over_ours']:.3f}x" if "fla_over_ours" in rec else "-"
    return f"{rec['row']:<20} {rec['mode']:<7} ours {ms('ours'):<30} fla {ms('fla'):<30} fla/ours {ratio}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=".*", help="regex on row names (e.g. 'T2048')")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--json", default=None, help="write all records to this file (rewritten per row)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition budget (ms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--naive-check", action="store_true",
                    help="first check o, finals and all grads vs the fp64 naive on small shapes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark")
        return 2
    from kernels.pkda import chunk_precond_kda as ours
    fla_op = None if args.no_fla else load_fla()
    inputs_mod = load_inputs_module()
    log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {__import__('triton').__version__}")
    records = []
    if args.naive_check:
        for rec in naive_check():
            log("naive check: " + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in rec.items()))
            records.append(dict(naive_check=rec))
    for name, shape in ROWS.items():
        if not re.search(args.rows, name):
            continue
        for mode in args.modes.split(","):
            rec = run_row(name, shape, mode, args, ours, fla_op, inputs_mod)
            records.append(rec)
            log(fmt(rec))
            prof = rec.get("ours", {}).get("profile")
            if prof:
                tot = prof["device_us"] or math.nan
                shares = ", ".join(f"{s} {100 * t / tot:.1f}%" for s, t in
                                   sorted(prof["stages_us"].items(), key=lambda kv: -kv[1]))
                log(f"    ours device {tot / 1000:.3f} ms/iter: {shares}")
            if "check_rel_err" in rec:
                log("    bf16 vs fla rel err: " + ", ".join(
                    f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in rec["check_rel_err"].items()))
            for side in ("ours", "fla"):
                if "trace" in rec.get(side, {}):
                    log(f"    {side} error:\n" + rec[side]["trace"])
            if args.json:
                Path(args.json).write_text(json.dumps(records, indent=1, default=str))
    ratios = [r["fla_over_ours"] for r in records if "fla_over_ours" in r]
    if ratios:
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        log(f"geomean fla/ours over {len(ratios)} rows: {gm:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
