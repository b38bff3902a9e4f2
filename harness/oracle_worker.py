"""The frozen oracle's subprocess: compute fixtures with the reference, check an op against them.

Started by harness/fixtures.py and harness/verify.py as `python -m harness.oracle_worker JOB.json`
with this checkout first on PYTHONPATH and cwd outside any worktree. Order matters:

1. the harness (this module, torch, safetensors) is imported from this checkout;
2. allocator NaN poisoning is installed (see below), before any code under test is imported, so a
   module that did `from torch import empty` still gets the poisoned function;
3. the harness checkout is dropped from sys.path and the side's worktree put first; the op (and,
   when freezing, the reference) are imported, and each module's file must lie in the worktree
   (an op found anywhere else is an error, never a silent fallback). A reference adapter (a file
   beside the experiment) is loaded by path after that, so what it imports of the repository
   comes from the worktree too.

NaN poisoning: `torch.empty`, `torch.empty_like`, `torch.empty_strided`, `Tensor.new_empty` and
`Tensor.new_empty_strided` are wrapped for the whole life of the process so that every buffer they
return is filled before the caller sees it: floating/complex tensors with NaN, integer tensors with
their dtype's maximum (bool is left alone). These are what kernel wrappers allocate outputs with,
so an element a kernel forgets to write reads back as NaN (or an absurd index) instead of whatever
the allocator -- on CUDA the caching allocator, which happily hands back the previous call's
correct output -- happened to leave there. The comparison then fails on that element: a NaN where
the reference is finite is never within tolerance. Allocations made inside ATen (matmul outputs,
autograd's own buffers) do not pass through these Python functions and are fully written by ATen.

Job JSON (written by the parent):
  action        "freeze" (reference -> fixture files, then check), "check" (op vs fixture files) or
                "setup" (`harness validate`: import the op, the reference, build one input; no call)
  worktree, op, reference, inputs_file, inputs_fn
  reference_file  the adapter file when `reference` names a function in it (else absent)
  package       {name, version} when the side is an installed package (setup only; no worktree)
  cases         [{name, shape, seed, cotangent_seed}]
  modes, dtype, device, rtol, atol
  fixture_dir   where <case>.safetensors are written (freeze) or read (check)
  out_dir       where the op's own outputs/gradients are saved (<case>.<mode>.safetensors)
  result        path of the result JSON this process writes

The result says where a whole-process error happened (`stage`: inputs, op or reference) and marks
a case whose reference or op raised (`raised`): the parent tells a setup error (nothing measured)
from a measured disagreement by them.
"""
from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import harness  # noqa: F401  (pins the harness package to this checkout before the worktree)

FORMAT = "harness-oracle-case/1"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
HARNESS_ROOT = Path(__file__).resolve().parents[1]


# --- NaN poisoning of fresh allocations ----------------------------------------------------------

def _poison(t):
    if isinstance(t, torch.Tensor) and t.numel() > 0:
        with torch.no_grad():
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            elif t.dtype != torch.bool:
                t.fill_(torch.iinfo(t.dtype).max)
    return t


def install_poison() -> None:
    """Wrap torch's uninitialised allocators so that what they return is filled with NaN."""
    if getattr(torch, "_harness_poisoned", False):
        return

    def wrap(fn):
        def poisoned(*args, **kwargs):
            return _poison(fn(*args, **kwargs))
        poisoned.__name__ = getattr(fn, "__name__", "empty")
        poisoned.__doc__ = f"NaN-poisoned by harness.oracle_worker: {poisoned.__name__}"
        poisoned.__wrapped__ = fn
        return poisoned

    for name in ("empty", "empty_like", "empty_strided"):
        setattr(torch, name, wrap(getattr(torch, name)))
    for name in ("new_empty", "new_empty_strided"):
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
    torch._harness_poisoned = True


# --- importing from the worktree only --------------------------------------------------------------

def _isolate(worktree: str) -> None:
    """Drop this checkout (and cwd) from sys.path, put the worktree first."""
    root = str(HARNESS_ROOT)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", root) and Path(p or ".").resolve() != HARNESS_ROOT]
    sys.path.insert(0, worktree)


def load_from_worktree(worktree: str, target: str):
    """`module:function` imported from `worktree`; the module file must be inside it."""
    import importlib

    from harness.interpreter_tf32 import emulate_tf32_dots
    from harness.triton_autotune_cache import make_autotune_cache_serialisable

    make_autotune_cache_serialisable()
    emulate_tf32_dots()

    module_name, fn = target.split(":")
    top = module_name.split(".")[0]
    wt = Path(worktree).resolve()
    if top == "harness":
        raise RuntimeError(f"{target}: the op/reference cannot live in the 'harness' package (it is the harness's own)")
    loaded = sys.modules.get(top)
    if loaded is not None:
        where = [Path(p).resolve() for p in (getattr(loaded, "__path__", None) or [getattr(loaded, "__file__", "") or ""])]
        if not any(wt in p.parents for p in where):
            # imported from elsewhere before isolation: drop it so the worktree's copy is used
            for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[name]
    module = importlib.import_module(module_name)
    origin = Path(getattr(module, "__file__", "") or "").resolve()
    if wt not in origin.parents:
        raise RuntimeError(f"{module_name} was imported from {origin}, not from the worktree {wt}")
    if not hasattr(module, fn):
        raise RuntimeError(f"{module_name} ({origin}) has no function {fn!r}")
    return getattr(module, fn), str(origin)


def load_file_fn(file: str, fn: str, module_name: str):
    """`fn` of a Python file loaded by path under a private module name (the inputs factory, a
    reference adapter: files of the experiment, never part of the op's package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, fn):
        raise RuntimeError(f"{file} has no function {fn!r}")
    return getattr(module, fn), str(Path(file).resolve())


def load_reference(job: dict):
    """The reference: a function of the adapter file, or `module:function` from the worktree."""
    if job.get("reference_file"):
        return load_file_fn(job["reference_file"], job["reference"].split(":")[1], "_harness_oracle_reference")
    return load_from_worktree(job["worktree"], job["reference"])


# --- call structure <-> flat tensors ---------------------------------------------------------------

def encode_call(inputs: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """The factory's {"args", "kwargs", "grad_inputs"} as (JSON structure, named tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    grad = set(inputs.get("grad_inputs") or [])

    def enc(value, name: str):
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach().cpu().contiguous()
            return {"tensor": name}
        if value is None or isinstance(value, (bool, int, float, str)):
            if isinstance(value, float) and not math.isfinite(value):
                raise TypeError(f"input {name} is a non-finite float")
            return {"value": value}
        if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
            return {"value": list(value), "tuple": isinstance(value, tuple)}
        raise TypeError(f"input {name} has type {type(value).__name__}; fixtures hold tensors, numbers, strings, None")

    args = [enc(v, f"in.args.{i}") for i, v in enumerate(inputs.get("args") or ())]
    kwargs = {k: enc(v, f"in.kwargs.{k}") for k, v in (inputs.get("kwargs") or {}).items()}
    grad_names = sorted({f"in.kwargs.{k}" for k in grad if k in kwargs and "tensor" in kwargs[k]}
                        | {n for n, t in tensors.items() if _requires_grad(inputs, n)})
    missing = [k for k in grad if k not in kwargs]
    if missing:
        raise TypeError(f"grad_inputs names {missing}, not keyword arguments of the call")
    return {"args": args, "kwargs": kwargs, "grad_inputs": grad_names}, tensors


def _requires_grad(inputs: dict, name: str) -> bool:
    _, where, key = name.split(".", 2)
    v = inputs["args"][int(key)] if where == "args" else inputs["kwargs"][key]
    return isinstance(v, torch.Tensor) and v.requires_grad


def build_call(structure: dict, tensors: dict[str, torch.Tensor], device: str, mode: str):
    """Fresh device copies of the stored inputs; returns (args, kwargs, {name: leaf needing grad})."""
    leaves: dict[str, torch.Tensor] = {}

    def dec(spec):
        if "tensor" in spec:
            name = spec["tensor"]
            t = tensors[name].to(device).clone()
            if mode == "fwdbwd" and name in structure["grad_inputs"]:
                t.requires_grad_(True)
                leaves[name] = t
            return t
        v = spec["value"]
        return tuple(v) if spec.get("tuple") else v

    args = tuple(dec(s) for s in structure["args"])
    kwargs = {k: dec(s) for k, s in structure["kwargs"].items()}
    return args, kwargs, leaves


def flatten_outputs(out) -> list[torch.Tensor | None]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        return list(out)
    raise TypeError(f"returned {type(out).__name__}; expected a tensor or a tuple of tensors/None")


def run_call(fn, structure, tensors, device: str, mode: str, cotangents: dict[str, torch.Tensor] | None, seed: int):
    """Call fn on the stored inputs; with cotangents (fwdbwd), also the gradients of sum(out_i * cot_i).

    Returns (outputs list, {grad name: tensor|None}, notes)."""
    args, kwargs, leaves = build_call(structure, tensors, device, mode)
    torch.manual_seed(seed)
    outs = flatten_outputs(fn(*args, **kwargs))
    grads: dict[str, torch.Tensor | None] = {}
    notes: list[str] = []
    if mode == "fwdbwd" and leaves:
        pairs = []
        for name, cot in (cotangents or {}).items():
            i = int(name.split(".")[1])
            o = outs[i] if i < len(outs) else None
            if o is None or not o.requires_grad:
                notes.append(f"out.{i} carries no gradient: its cotangent is dropped")
                continue
            pairs.append((o, cot.to(device=o.device, dtype=o.dtype)))
        grads = vjp(pairs, leaves)
    return outs, grads, notes


def vjp(pairs: list, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """Gradients of sum_i sum(out_i * cot_i) w.r.t. each leaf (None where unreachable).

    Through a scalar loss rather than autograd.grad(grad_outputs=...): the same gradients (the
    backward of the product and the sum hands each output exactly its cotangent) without the
    symbolic-shapes import that grad_outputs costs (seconds per process)."""
    names = list(leaves)
    if not pairs:
        return {"grad." + n.split(".", 1)[1]: None for n in names}
    loss = None
    for o, cot in pairs:
        term = (o * cot).sum()
        loss = term if loss is None else loss + term
    got = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {"grad." + n.split(".", 1)[1]: g for n, g in zip(names, got)}


# --- comparison ------------------------------------------------------------------------------------

def _presence(rec: dict, got, want) -> bool:
    """None/shape checks shared by both criteria; True when rec is already decided."""
    if want is None and got is None:
        rec["problem"] = "None on both sides"
        return True
    if want is None or got is None:
        rec.update(status="FAIL", problem=f"{'op' if got is None else 'reference'} gives None, "
                                          f"{'reference' if got is None else 'op'} a tensor")
        present = want if got is None else got
        if present.numel() == 0 or bool((present == 0).all()):  # an unreachable gradient given as zeros
            rec.update(status="PASS", problem=f"{'op' if got is None else 'reference'} gives None, the other all zeros")
        return True
    rec["shape"] = list(want.shape)
    if tuple(got.shape) != tuple(want.shape):
        rec.update(status="FAIL", problem=f"shape {list(got.shape)} != reference {list(want.shape)}")
        return True
    return False


def _finite_masks(g: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(both finite, non-finite where the reference differs): NaN/inf must match the reference."""
    both_finite = torch.isfinite(g) & torch.isfinite(w)
    same_special = (torch.isnan(g) & torch.isnan(w)) | (torch.isinf(g) & torch.isinf(w) & (g == w))
    return both_finite, ~both_finite & ~same_special


def compare_rel_l2(name: str, got, want, rel_l2: float) -> dict:
    """One tensor of a low-precision case: ||got - want||_2 / ||want||_2 <= rel_l2, and every
    non-finite element where the reference has the same (so NaN poisoning still catches an
    unwritten element). worst_ratio = the error over its bound: passes when <= 1."""
    rec = {"name": name, "criterion": "rel_l2", "rel_l2": rel_l2, "status": "PASS", "problem": None,
           "shape": None, "rel_l2_err": None, "max_abs_err": None, "worst_ratio": None, "n_nonfinite": 0}
    if _presence(rec, got, want):
        return rec
    g = got.detach().cpu().double()
    w = want.detach().cpu().double()
    both_finite, nonfinite_bad = _finite_masks(g, w)
    n_nonfinite = int(nonfinite_bad.sum())
    diff = torch.where(both_finite, g - w, torch.zeros_like(g))
    ref_norm = float(torch.where(both_finite, w, torch.zeros_like(w)).norm())
    err_norm = float(diff.norm())
    err = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    rec.update(rel_l2_err=err, max_abs_err=float(diff.abs().max()) if diff.numel() else 0.0,
               worst_ratio=err / rel_l2, n_nonfinite=n_nonfinite)
    if n_nonfinite:
        rec.update(status="FAIL", worst_ratio=float("inf"),
                   problem=f"{n_nonfinite} of {w.numel()} elements non-finite where the reference is finite "
                           "(unwritten output, NaN-poisoned)")
    elif err > rel_l2:
        rec.update(status="FAIL", problem=f"relative L2 error {err:.3g} > {rel_l2}")
    return rec


def compare(name: str, got, want, rtol: float, atol: float) -> dict:
    """One tensor against its reference: allclose semantics, with the numbers that decided it.

    worst_ratio = max |got - want| / (atol + rtol |want|): the element check passes when <= 1.
    max_rel_err = max |got - want| / |want| over elements with want != 0."""
    rec = {"name": name, "rtol": rtol, "atol": atol, "status": "PASS", "problem": None,
           "shape": None, "max_abs_err": None, "max_rel_err": None, "worst_ratio": None,
           "n_bad": 0, "n_nonfinite": 0, "worst_index": None}
    if _presence(rec, got, want):
        return rec
    g = got.detach().cpu()
    w = want.detach().cpu()
    if not (w.is_floating_point() or w.is_complex()):
        bad = g.to(w.dtype) != w
        n_bad = int(bad.sum())
        rec.update(n_bad=n_bad, max_abs_err=float((g.double() - w.double()).abs().max()) if g.numel() else 0.0)
        if n_bad:
            rec.update(status="FAIL", problem=f"{n_bad} of {w.numel()} integer elements differ")
        return rec
    g = g.double()
    w = w.double()
    both_finite, nonfinite_bad = _finite_masks(g, w)
    diff = torch.where(both_finite, (g - w).abs(), torch.zeros_like(g))
    tol = atol + rtol * w.abs()
    tol = torch.where(both_finite, tol, torch.ones_like(tol))
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / tol)
    bad = (ratio > 1) | nonfinite_bad
    n_nonfinite = int(nonfinite_bad.sum())
    n_bad = int(bad.sum())
    nz = both_finite & (w != 0)
    rec.update(
        n_bad=n_bad, n_nonfinite=n_nonfinite,
        max_abs_err=float(diff.max()) if diff.numel() else 0.0,
        max_rel_err=float((diff[nz] / w[nz].abs()).max()) if bool(nz.any()) else 0.0,
        worst_ratio=float(ratio.max()) if ratio.numel() else 0.0,
    )
    if n_nonfinite:
        rec["worst_ratio"] = float("inf")
    if n_bad:
        flat = torch.where(nonfinite_bad, torch.full_like(ratio, float("inf")), ratio).reshape(-1)
        idx = int(flat.argmax())
        rec["worst_index"] = list(torch.unravel_index(torch.tensor(idx), w.shape)) if w.dim() else []
        rec["worst_index"] = [int(i) for i in rec["worst_index"]]
        what = f"{n_bad} of {w.numel()} elements outside atol + rtol*|ref|"
        if n_nonfinite:
            what += f" ({n_nonfinite} non-finite where the reference is finite: unwritten output, NaN-poisoned)"
        rec.update(status="FAIL", problem=what)
    return rec


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def compare_case_tensor(name: str, got, want, rtol: float, atol: float, rel_l2: float | None = None) -> dict:
    """The criterion of the tensor's case: relative L2 for a low-precision case, else elementwise."""
    return compare(name, got, want, rtol, atol) if rel_l2 is None else compare_rel_l2(name, got, want, rel_l2)


# --- one case -------------------------------------------------------------------------------------

def read_case(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    structure = json.loads(meta["case"])
    return structure, load_file(str(path))


def freeze_case(reference, inputs_fn, case: dict, job: dict) -> Path:
    """Inputs from the factory, reference outputs, a seeded cotangent, reference gradients: one file."""
    ref_dtype = DTYPES[job["dtype"]]
    low = case.get("input_dtype")  # a low-precision case: inputs in that dtype, reference on them upcast
    grad_mode = "fwdbwd" if "fwdbwd" in job["modes"] else "fwd"
    inputs = inputs_fn(dict(case["shape"]), grad_mode, DTYPES[low] if low else ref_dtype, job["device"],
                       int(case["seed"]))
    structure, tensors = encode_call(inputs)
    ref_tensors = {k: (t.to(ref_dtype) if low and t.is_floating_point() else t) for k, t in tensors.items()}
    args, kwargs, leaves = build_call(structure, ref_tensors, job["device"], grad_mode)
    torch.manual_seed(int(case["seed"]))
    outs = flatten_outputs(reference(*args, **kwargs))
    out_names = []
    cotangents: dict[str, torch.Tensor] = {}
    pairs = []
    gen = torch.Generator(device="cpu").manual_seed(int(case["cotangent_seed"]))
    for i, o in enumerate(outs):
        if o is None:
            out_names.append(None)
            continue
        out_names.append(f"out.{i}")
        tensors[f"out.{i}"] = o.detach().cpu().contiguous()
        if grad_mode == "fwdbwd" and o.requires_grad and o.is_floating_point():
            cot = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            if low:  # the op will receive it rounded to its own output dtype: give the reference the same
                cot = cot.to(DTYPES[low])
            cot = cot.to(o.dtype)
            cotangents[f"cot.{i}"] = cot
            tensors[f"cot.{i}"] = cot.contiguous()
            pairs.append((o, cot.to(o.device)))
    grads: dict[str, torch.Tensor | None] = {}
    if grad_mode == "fwdbwd" and leaves:
        grads = vjp(pairs, leaves)
    for name, g in grads.items():
        if g is not None:
            tensors[name] = g.detach().cpu().contiguous()
    structure.update(format=FORMAT, case=case["name"], shape=case["shape"], seed=case["seed"],
                     cotangent_seed=case["cotangent_seed"], dtype=job["dtype"], input_dtype=low, outputs=out_names,
                     cotangents=sorted(cotangents), grads={k: (k if v is not None else None) for k, v in grads.items()})
    path = Path(job["fixture_dir"]) / f"{case['name']}.safetensors"
    save_file(tensors, str(path), metadata={"case": json.dumps(structure, sort_keys=True)})
    return path


def check_case(op, path: Path, job: dict, case: dict | None = None) -> list[dict]:
    """The op against one fixture file, in every mode; its outputs are saved for reproducibility.
    A low-precision case (case["rel_l2"], from the frozen manifest) is compared by relative L2."""
    structure, tensors = read_case(path)
    rtol, atol = float(job["rtol"]), float(job["atol"])
    bound = (case or {}).get("rel_l2")
    bound = None if bound is None else float(bound)
    results = []
    problems = [f"reference {k} is non-finite" for k, t in tensors.items()
                if (k.startswith(("out.", "grad."))) and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    for mode in job["modes"]:
        rec = {"case": structure["case"], "mode": mode, "status": "PASS", "error": None, "notes": [], "tensors": []}
        results.append(rec)
        if problems:
            rec.update(status="FAIL", error="; ".join(problems))
            continue
        cots = {k: tensors[k] for k in structure.get("cotangents", [])} if mode == "fwdbwd" else None
        try:
            outs, grads, notes = run_call(op, structure, tensors, job["device"], mode, cots, int(structure["seed"]))
        except Exception as e:  # noqa: BLE001 - the op's failure is a result, not a crash
            rec.update(status="FAIL", error=f"{type(e).__name__}: {e}", raised="op",
                       traceback=traceback.format_exc(limit=8)[-4000:])
            continue
        rec["notes"] = notes
        ref_outs = structure["outputs"]
        if len(outs) != len(ref_outs):
            rec["tensors"].append({"name": "outputs", "status": "FAIL",
                                   "problem": f"op returns {len(outs)} outputs, reference {len(ref_outs)}"})
        saved = {}
        for i in range(max(len(outs), len(ref_outs))):
            got = outs[i] if i < len(outs) else None
            want = tensors.get(ref_outs[i]) if i < len(ref_outs) and ref_outs[i] else None
            rec["tensors"].append(compare_case_tensor(f"out.{i}", got, want, rtol, atol, bound))
            if got is not None:
                saved[f"out.{i}"] = got.detach().cpu().contiguous()
        if mode == "fwdbwd":
            for name in sorted(set(structure.get("grads", {})) | set(grads)):
                got = grads.get(name)
                want = tensors.get(name) if structure.get("grads", {}).get(name) else None
                rec["tensors"].append(compare_case_tensor(name, got, want, rtol, atol, bound))
                if got is not None:
                    saved[name] = got.detach().cpu().contiguous()
        if any(t["status"] == "FAIL" for t in rec["tensors"]):
            rec["status"] = "FAIL"
            rec["error"] = "; ".join(f"{t['name']}: {t['problem']}" for t in rec["tensors"] if t["status"] == "FAIL")
        if job.get("out_dir") and saved:
            save_file(saved, str(Path(job["out_dir"]) / f"{structure['case']}.{mode}.safetensors"))
    return results


def setup_check(job: dict, result: dict) -> None:
    """`harness validate`'s look at one side: the op (and on the baseline the reference) import,
    the inputs factory builds one small input on the CPU. Nothing is called: an op may take
    minutes to compile, which a run finds out soon enough."""
    if job.get("package"):  # an installed distribution at its declared version, as a block imports it
        from harness.measure.call import load_op

        result["stage"] = "op"
        load_op("", job["op"], job["package"])
        result["imported"]["op"] = sys.modules[job["op"].split(":")[0]].__file__
        return
    result["stage"] = "inputs"
    inputs_fn, result["imported"]["inputs"] = load_file_fn(job["inputs_file"], job["inputs_fn"],
                                                          "_harness_oracle_inputs")
    result["stage"] = "op"
    _isolate(job["worktree"])
    _, result["imported"]["op"] = load_from_worktree(job["worktree"], job["op"])
    if job.get("reference"):
        result["stage"] = "reference"
        _, result["imported"]["reference"] = load_reference(job)
    result["stage"] = "inputs"
    case = job["cases"][0]
    mode = "fwdbwd" if "fwdbwd" in job["modes"] else "fwd"
    inputs = inputs_fn(dict(case["shape"]), mode, DTYPES[job["dtype"]], "cpu", int(case["seed"]))
    structure, tensors = encode_call(inputs)
    result["inputs"] = {"case": case["name"], "tensors": {k: list(t.shape) for k, t in tensors.items()},
                        "grad_inputs": structure["grad_inputs"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    result: dict = {"action": job["action"], "cases": [], "error": None, "imported": {}, "poisoned": True,
                    "torch": torch.__version__, "device": job["device"], "pid": os.getpid(), "stage": None}
    try:
        if job["action"] == "setup":
            setup_check(job, result)
        else:
            freeze_or_check(job, result)
        result["stage"] = None
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc(limit=8)[-4000:]
    Path(job["result"]).write_text(json.dumps(_json_safe(result), indent=1, sort_keys=True))
    return 0 if result["error"] is None else 1


def freeze_or_check(job: dict, result: dict) -> None:
    install_poison()
    inputs_fn = None
    if job["action"] == "freeze":
        result["stage"] = "inputs"
        inputs_fn, _ = load_file_fn(job["inputs_file"], job["inputs_fn"], "_harness_oracle_inputs")
    result["stage"] = "op"
    _isolate(job["worktree"])
    op, result["imported"]["op"] = load_from_worktree(job["worktree"], job["op"])
    reference = None
    if job["action"] == "freeze":
        result["stage"] = "reference"
        reference, result["imported"]["reference"] = load_reference(job)
    result["stage"] = None
    Path(job["fixture_dir"]).mkdir(parents=True, exist_ok=True)
    if job.get("out_dir"):
        Path(job["out_dir"]).mkdir(parents=True, exist_ok=True)
    for case in job["cases"]:
        path = Path(job["fixture_dir"]) / f"{case['name']}.safetensors"
        if job["action"] == "freeze":
            try:
                path = freeze_case(reference, inputs_fn, case, job)
            except Exception as e:  # noqa: BLE001
                result["cases"].append({"case": case["name"], "mode": None, "status": "FAIL", "tensors": [],
                                        "error": f"reference failed: {type(e).__name__}: {e}", "raised": "reference",
                                        "traceback": traceback.format_exc(limit=8)[-4000:]})
                continue
        result["cases"].extend(check_case(op, path, job, case))


if __name__ == "__main__":
    raise SystemExit(main())
