"""Registers, spills and shared memory of every Triton kernel an op launches, from an offline
compile for Hopper (sm_90): no GPU, no ncu, before any device time is spent.

    python tools/kernel_resources.py EXPERIMENT.yaml [--shape NAME ...] [--mode fwd|fwd+bwd]
        [--dtype bfloat16] [--side baseline|candidate] [--env KEY=VALUE ...] [--worktree DIR]
        [--kernel REGEX] [--arch 90] [--jobs N] [--json OUT]

For each declared shape (default: every row of `shapes:`; `--shape` also takes fixture shapes),
it finds the kernels the experiment's op launches in one call (`--mode fwd+bwd`, the default,
runs the forward and the backward; `fwd` the forward under no_grad), compiles each kernel for
every config of its autotune space (a kernel without @triton.autotune: the launch's own
num_warps / num_stages, or Triton's defaults) and prints, per shape, one row a (kernel, launch,
config): registers a thread, stack frame and local bytes a thread, the spill instructions in
the SASS (STL / LDL), shared memory a block, the blocks a Hopper SM holds by registers and
warps, `SPILLS` where the kernel spills and `OVER SHARED` where a block needs more shared memory
than an sm_90 block may have (such a config cannot launch). `--json` writes the same records (with each
launch's signature, constexprs and 16-divisible arguments) and a header. Exit status: 0, 1 when
a shape or a kernel failed (its error is printed), 2 for a bad experiment, shape or option.

Environment: the side's declared `env` (`--side`, default baseline) and then each `--env
KEY=VALUE` are set in both child processes before the op is imported, so a knob read at import
(e.g. PKDA_BWD_INTRA_WARPS, which sets pkda_bwd_intra_kernel's autotune space) is screened as
the harness would run it. The kernels come from `--worktree` (default: the experiment's target
repository, i.e. this checkout as it is; the side's `ref` is NOT checked out) or, for a side
declared as an installed package, from that package.

How (two child processes of this file, so the caller's own TRITON_INTERPRET does not matter):
  1. discover (TRITON_INTERPRET=1): the op's inputs come from the experiment's factory
     (harness.measure.call.load_inputs / load_op / Call, as every harness worker does) on the CPU
     at the declared shape and dtype, and the op is called once. Triton's interpreter launch
     (InterpretedFunction.run) is replaced by a recorder: each launch is written down (the
     kernel's module, name and file; every argument as a descriptor: a tensor's dtype and
     whether its address is 16-byte aligned, ints, floats, bools, strings, constexprs, Triton
     dtypes) and the kernel body is NOT run, so a B4_T2048 bf16 row costs what its PyTorch glue
     costs (a few seconds), not an interpreted kernel. Outputs hold whatever the buffers held.
     An autotuner there launches its first config without benchmarking (step 2 has them all).
  2. compile (interpreter off): the kernel modules are imported again (the op first, from the
     same worktree) so every @triton.jit is a JITFunction and every @triton.autotune holds its
     whole space (PKDA's `_configs` keeps only the first config under the interpreter). Each
     recorded launch is bound by Triton's own launcher code for the CUDA backend of the target
     (create_function_from_signature + JITFunction._pack_args, what JITFunction.run does before
     it compiles), once per config, and compiled with triton.compile for GPUTarget("cuda", 90,
     32) (ptxas --gpu-name=sm_90a, Triton's bundled ptxas). Identical specialisations compile
     once; Triton's on-disk cache (TRITON_CACHE_DIR) is used as usual. The cubin is read with
     the bundled cuobjdump: `-res-usage` (REG, STACK, LOCAL, static SHARED) and `-sass` (STL and
     LDL instructions). Shared memory is Triton's dynamic allocation (metadata `shared`, what the
     launcher requests) plus the cubin's static SHARED.

Spills: on this toolchain (ptxas 12.8) register spills land in the stack frame: cuobjdump's STACK
grows and its LOCAL stays 0 (a Triton kernel has no local arrays), so a record is marked as
spilling when its SASS holds STL/LDL instructions (their count is static, not executed
requests) or LOCAL > 0. `stack_bytes` is the per-thread stack frame (spill slots included).

Exact: specialisation of every argument is what Triton's launcher computes from the recorded
values (ints: value 1 becomes a constexpr, multiples of 16 get tt.divisibility=16, i32 or i64 by
range, do_not_specialize honoured; floats fp32; pointers by dtype and 16-byte alignment);
constexprs and config kwargs as launched; a @triton.heuristics value is recomputed for each
config from the recorded arguments (the recorded value stands when it needs what a descriptor
lacks, e.g. a tensor's shape).
Approximated:
  * pointer alignment is read from the CPU tensors of the discovery run (PyTorch's CPU allocator
    aligns to 64 bytes, CUDA's to 512; views keep their offsets), so it matches a GPU run unless a
    tensor's address depends on the allocator;
  * the op's host code runs under TRITON_INTERPRET=1 with CPU tensors: where it branches on that
    (device capability guards, e.g. kernels/pkda/bwd.py's daqk_schedule), the launches are the
    interpreter's branch's;
  * the autotuner's pick is unknown offline: every config of the space is listed (an autotuner's
    early_config_prune / perf_model is not applied; the JSON says so);
  * the numbers are this Triton's and this ptxas's (see the header line); another Triton on the
    GPU machine may allocate differently. These are ptxas figures, not ncu measurements.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"fwd": "fwd", "fwd+bwd": "fwdbwd", "fwdbwd": "fwdbwd"}


# ------------------------------------------------------------------------ argument descriptors
def describe(value) -> dict:
    """A JSON-able stand-in for one kernel argument: all the launcher's specialisation reads."""
    import triton.language as tl

    if value is None:
        return {"kind": "none"}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value}
    if isinstance(value, str):
        return {"kind": "str", "value": value}
    if isinstance(value, tl.constexpr):
        return {"kind": "constexpr", "value": describe(value.value)}
    if isinstance(value, tl.dtype):
        return {"kind": "tl_dtype", "name": value.name}
    if isinstance(value, tuple):
        return {"kind": "tuple", "items": [describe(v) for v in value]}
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return {"kind": "tensor", "dtype": str(value.dtype).removeprefix("torch."),
                "aligned16": value.data_ptr() % 16 == 0}
    raise TypeError(f"kernel argument of type {type(value).__name__} cannot be recorded")


class _Pointer:
    """What Triton's specialisation reads of a tensor argument: its dtype and address."""

    def __init__(self, dtype, aligned16: bool):
        self.dtype = dtype
        self._ptr = 0 if aligned16 else 8

    def data_ptr(self) -> int:
        return self._ptr


def rebuild(desc: dict):
    """The argument a descriptor stands for, as the compile step hands it to Triton's binder."""
    import torch
    import triton.language as tl

    kind = desc["kind"]
    if kind == "none":
        return None
    if kind in ("bool", "int", "float", "str"):
        return desc["value"]
    if kind == "constexpr":
        return tl.constexpr(rebuild(desc["value"]))
    if kind == "tl_dtype":
        return tl.dtype(desc["name"])
    if kind == "tuple":
        return tuple(rebuild(d) for d in desc["items"])
    if kind == "tensor":
        return _Pointer(getattr(torch, desc["dtype"]), desc["aligned16"])
    raise ValueError(f"unknown argument descriptor {desc!r}")


def _shown(desc: dict) -> str:
    """A descriptor as a table shows a launch's constexpr value."""
    kind = desc["kind"]
    if kind == "constexpr":
        return _shown(desc["value"])
    if kind == "tl_dtype":
        return desc["name"]
    if kind == "tensor":
        return f"*{desc['dtype']}"
    if kind == "tuple":
        return "(" + ",".join(_shown(d) for d in desc["items"]) + ")"
    if kind == "none":
        return "None"
    return str(desc["value"])


# ------------------------------------------------------------------------ child process plumbing
def _child_env(env: dict[str, str], interpret: bool) -> dict[str, str]:
    out = dict(os.environ)
    out.update(env)
    out.pop("TRITON_INTERPRET", None)
    if interpret:
        out["TRITON_INTERPRET"] = "1"
    return out


def _run_child(step: str, job: dict, env: dict[str, str], interpret: bool) -> dict:
    """Run this file as `--worker STEP` on a job file; its result, or RuntimeError with its stderr."""
    with tempfile.TemporaryDirectory(prefix="kernel-resources-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", step,
                               str(job_path), str(out_path)], cwd=str(ROOT),
                              env=_child_env(env, interpret), capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"the {step} step failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-6000:]}{proc.stdout[-2000:]}")
        return json.loads(out_path.read_text())


def discover(job: dict, env: dict[str, str] | None = None) -> dict:
    """The launches of one op call per shape, from a TRITON_INTERPRET=1 child.

    job: worktree, op ('module:function'), package (None or {name, version}), inputs_file,
    inputs_fn, shapes (dicts as the harness hands them to the factory), mode ('fwd'|'fwdbwd'),
    dtype ('bfloat16', ...), seed. Returns {"shapes": [{"name", "launches": [...], "error"?}]};
    a launch: kernel, module, file, args, kwargs (descriptors), count."""
    return _run_child("discover", job, env or {}, interpret=True)


def compile_launches(launches: list[dict], env: dict[str, str] | None = None, *, arch: int = 90,
                     jobs: int | None = None, worktree: str | None = None, op: str | None = None,
                     package: dict | None = None) -> dict:
    """Compile each launch for every config of its kernel for sm_`arch`, in a child with the
    interpreter off. A launch is a discover() launch (kernel, module, file, args, kwargs); `op`
    (imported from `worktree` first) makes the kernel modules load as the op loads them.
    Returns {"results": [one per (launch, config), with `launch` its index], "versions": {...}}."""
    job = {"launches": launches, "arch": arch, "jobs": jobs or os.cpu_count() or 1,
           "worktree": worktree, "op": op, "package": package}
    return _run_child("compile", job, env or {}, interpret=False)


# ------------------------------------------------------------------------ step 1: discover
def _worker_discover(job: dict) -> dict:
    from triton import knobs
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction

    from harness.measure.call import DTYPES, Call, load_inputs, load_op

    if not knobs.runtime.interpret:
        raise RuntimeError("the discover step needs TRITON_INTERPRET=1")
    launches: dict[str, dict] = {}

    def record(self, *args, grid, warmup, **kwargs):
        if warmup:
            return None
        fn = self.fn
        launch = {"kernel": fn.__qualname__, "module": fn.__module__,
                  "file": inspect.getsourcefile(fn),
                  "args": [describe(a) for a in args],
                  "kwargs": {k: describe(v) for k, v in sorted(kwargs.items())}}
        key = json.dumps(launch, sort_keys=True)
        launches.setdefault(key, {**launch, "count": 0})["count"] += 1
        return None  # the kernel body is not run

    def first_config(self, *args, **kwargs):  # an autotuner never benchmarks here: nothing runs
        self.nargs = dict(zip(self.arg_names, args))
        try:
            return self.fn.run(*args, **kwargs, **self.configs[0].all_kwargs())
        finally:
            self.nargs = None

    InterpretedFunction.run = record
    Autotuner.run = first_config
    make_inputs = load_inputs(job["inputs_file"], job["inputs_fn"])
    op = load_op(job["worktree"], job["op"], job.get("package"))
    dtype = DTYPES[job["dtype"]]
    out = []
    for shape in job["shapes"]:
        launches.clear()
        row: dict = {"name": shape["name"]}
        try:
            Call(op, make_inputs(shape, job["mode"], dtype, "cpu", job["seed"]), job["mode"], job["seed"])()
        except Exception as e:  # noqa: BLE001 - one shape's failure is reported, the others go on
            row["error"] = f"{type(e).__name__}: {e}"
        row["launches"] = list(launches.values())
        out.append(row)
    return {"shapes": out}


# ------------------------------------------------------------------------ step 2: compile
def _kernel_object(launch: dict):
    """The module-level object a launch named: from its module when that is the recorded file,
    else loaded from the file under a private name (e.g. a test module)."""
    try:
        module = importlib.import_module(launch["module"])
        if launch.get("file") and Path(inspect.getsourcefile(module)).resolve() != Path(launch["file"]).resolve():
            module = None
    except ImportError:
        module = None
    if module is None:
        name = "_kernel_resources_" + re.sub(r"\W", "_", Path(launch["file"]).stem)
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, launch["file"])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    obj = module
    for part in launch["kernel"].split("."):
        obj = getattr(obj, part)
    return obj


def _unwrap(obj):
    """(JITFunction, autotune configs or None, note on pruning or None, Heuristics layers)."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    configs, note, heuristics = None, None, []
    while not isinstance(obj, JITFunction):
        if isinstance(obj, Autotuner):
            configs = list(obj.configs)
            if obj.early_config_prune or obj.perf_model:
                note = "autotune pruning (early_config_prune / perf_model) not applied: every config listed"
        elif isinstance(obj, Heuristics):
            heuristics.append(obj)
        elif not hasattr(obj, "fn"):
            raise TypeError(f"{obj!r} is not a Triton kernel (JITFunction, autotuner or heuristics)")
        obj = obj.fn
    return obj, configs, note, heuristics


def _config_record(options, config) -> dict:
    return {"num_warps": options.num_warps, "num_stages": options.num_stages, "num_ctas": options.num_ctas,
            "maxnreg": options.maxnreg,
            "kwargs": {k: _shown(describe(v)) for k, v in (config.kwargs if config is not None else {}).items()}}


def _bind(jf, backend, args, kwargs):
    """What JITFunction.run computes before it compiles: (ASTSource, options, constexprs, signature, attrs)."""
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jf.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(jf.signature, jf.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jf._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(jf, signature, constexprs, attrs), options, constexprs, signature, attrs


def _units(launch: dict, index: int, backend) -> list[dict]:
    """One compile unit per config of the launch's kernel (bound, not yet compiled)."""
    jf, configs, note, heuristics = _unwrap(_kernel_object(launch))
    args = [rebuild(d) for d in launch["args"]]
    recorded = {k: rebuild(d) for k, d in launch["kwargs"].items()}
    config_keys = {k for c in configs or () for k in c.all_kwargs()}
    base = {k: v for k, v in recorded.items() if k not in config_keys}
    units = []
    for config in configs or [None]:
        kwargs = {**base, **(config.all_kwargs() if config is not None else {})}
        for layer in heuristics:  # outermost first, as their run()s nest; a recorded value stands
                                  # where one cannot be recomputed
            for name, heur in layer.values.items():
                try:
                    kwargs[name] = heur({**dict(zip(layer.arg_names, args)), **kwargs})
                except Exception:  # noqa: BLE001 - e.g. it reads a tensor's shape: keep the recorded value
                    pass
        src, options, constexprs, signature, attrs = _bind(jf, backend, args, kwargs)
        names = jf.arg_names
        units.append({
            "launch": index, "kernel": launch["kernel"], "autotuned": configs is not None, "note": note,
            "config": _config_record(options, config),
            "constexprs": {names[p[0]]: _shown(describe(v)) for p, v in constexprs.items() if len(p) == 1},
            "signature": dict(signature),
            "divisible16": sorted(names[p[0]] for p, a in attrs.items()
                                  if len(p) == 1 and ["tt.divisibility", 16] in [list(x) for x in a]),
            "_src": src, "_options": options,
            "_key": src.hash() + json.dumps(options.__dict__, sort_keys=True, default=str)})
    return units


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} (Triton's bundled {name}) is missing")
    return str(path)


def cubin_resources(cubin: bytes, name: str) -> dict:
    """REG, STACK, LOCAL, static SHARED (cuobjdump -res-usage) and STL / LDL count (-sass) of
    kernel `name` in a cubin."""
    with tempfile.TemporaryDirectory(prefix="kernel-resources-") as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(path)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], capture_output=True,
                              text=True, check=True).stdout
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in usage.splitlines():
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            current = m.group(1)
        elif current is not None and "REG:" in line:
            found[current] = {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}
            current = None
    if not found:
        raise RuntimeError(f"cuobjdump -res-usage printed no function:\n{usage}")
    res = found.get(name) or next(iter(found.values()))
    return {"registers": res.get("REG", 0), "stack_bytes": res.get("STACK", 0),
            "local_bytes": res.get("LOCAL", 0), "static_shared_bytes": res.get("SHARED", 0),
            "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            "spill_loads": len(re.findall(r"\bLDL\b", sass))}


# sm_90's register file as the CUDA occupancy calculator counts it (H100 / H200 alike)
SM90_REGISTERS, SM90_REG_GRANULE, SM90_MAX_WARPS, SM90_MAX_BLOCKS = 65536, 256, 64, 32
# the shared memory one sm_90 block may opt into (227 KB, H100 / H200 alike): Triton's launcher
# raises OutOfResources before a launch that needs more, on the GPU only (the interpreter has no
# shared memory), so an autotune space needs a config under it at every shape and dtype it serves
SM90_MAX_SHARED_PER_BLOCK = 232448


def register_limits(registers: int, num_warps: int) -> dict:
    """Blocks a Hopper SM can hold by registers and by warps (ncu's launch__occupancy_limit_registers
    and _warps): each warp takes registers x 32 rounded up to 256. Shared memory is left out: its
    limit depends on the carveout the driver picks at launch."""
    per_warp = max(1, -(-registers * 32 // SM90_REG_GRANULE)) * SM90_REG_GRANULE
    return {"occupancy_limit_registers": min(SM90_MAX_BLOCKS, SM90_REGISTERS // per_warp // num_warps),
            "occupancy_limit_warps": min(SM90_MAX_BLOCKS, SM90_MAX_WARPS // num_warps)}


def _compile_unit(unit: dict, target) -> dict:
    import triton

    t0 = time.perf_counter()
    kernel = triton.compile(unit["_src"], target=target, options=unit["_options"].__dict__)
    res = cubin_resources(kernel.asm["cubin"], kernel.metadata.name)
    res["shared_bytes"] = kernel.metadata.shared + res["static_shared_bytes"]
    res["spills"] = res["spill_stores"] + res["spill_loads"] + res["local_bytes"] > 0
    res["over_shared"] = res["shared_bytes"] > SM90_MAX_SHARED_PER_BLOCK
    res.update(register_limits(res["registers"], kernel.metadata.num_warps))
    res["compile_s"] = round(time.perf_counter() - t0, 2)
    return res


def _worker_compile(job: dict) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler import make_backend

    from harness.measure.call import load_op

    if knobs.runtime.interpret:
        raise RuntimeError("the compile step needs TRITON_INTERPRET unset")
    if job.get("op"):
        load_op(job["worktree"], job["op"], job.get("package"))
    target = GPUTarget("cuda", int(job["arch"]), 32)
    backend = make_backend(target)
    units, results = [], []
    for i, launch in enumerate(job["launches"]):
        try:
            units += _units(launch, i, backend)
        except Exception as e:  # noqa: BLE001 - reported as this launch's record
            results.append({"launch": i, "kernel": launch["kernel"], "error": f"bind: {type(e).__name__}: {e}"})
    unique: dict[str, dict] = {}
    for unit in units:
        unique.setdefault(unit["_key"], unit)

    def run(unit):
        try:
            return _compile_unit(unit, target)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile is a result too
            return {"error": f"compile: {type(e).__name__}: {str(e)[-2000:]}"}

    with ThreadPoolExecutor(max_workers=max(1, int(job["jobs"]))) as pool:
        done = dict(zip(unique, pool.map(run, unique.values())))
    for unit in units:
        record = {k: v for k, v in unit.items() if not k.startswith("_")}
        results.append({**record, **done[unit["_key"]]})
    results.sort(key=lambda r: r["launch"])  # stable: a launch's configs keep their order
    ptxas = subprocess.run([_tool("ptxas"), "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release ([\d.]+), V([\d.]+)", ptxas)
    arch = int(job["arch"])
    return {"results": results, "unique_compiles": len(unique),
            "versions": {"triton": triton.__version__, "ptxas": release.group(2) if release else ptxas.strip(),
                         "target": f"{sm_arch_from_capability(arch)} (GPUTarget('cuda', {arch}, 32))"}}


# ------------------------------------------------------------------------ the whole run
def measure(experiment: str | Path, shapes: list[str] | None = None, mode: str = "fwd+bwd",
            dtype: str | None = None, side: str = "baseline", env: dict[str, str] | None = None,
            worktree: str | Path | None = None, kernel: str | None = None, arch: int = 90,
            jobs: int | None = None) -> dict:
    """Discover and compile; returns {"header": {...}, "records": [...], "errors": [...]}.
    A record: shape, mode, dtype, kernel, launches (calls of this launch in one op call), the
    launch's constexprs, config (num_warps, num_stages, num_ctas, maxnreg, kwargs), registers,
    stack_bytes, local_bytes, spill_stores, spill_loads, shared_bytes, spills, over_shared (or error)."""
    from harness.spec import load_experiment

    loaded = load_experiment(experiment)
    exp = loaded.exp
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {sorted(MODES)}, got {mode!r}")
    declared = getattr(exp, side)
    full_env = {**declared.env, **(env or {})}
    if "TRITON_INTERPRET" in full_env:
        raise ValueError("TRITON_INTERPRET is set by the tool itself (on to discover, off to compile)")
    rows = [exp.shape(n) for n in shapes] if shapes else list(exp.shapes)
    job = {"worktree": str(Path(worktree).resolve()) if worktree else str(loaded.target_repo),
           "op": declared.op or exp.target.op,
           "package": declared.package.model_dump() if declared.is_package else None,
           "inputs_file": str(loaded.inputs_file), "inputs_fn": exp.target.inputs.split(":")[1],
           "shapes": [s.model_dump(exclude_none=True) for s in rows], "mode": MODES[mode],
           "dtype": dtype or exp.dtype, "seed": exp.seed}
    t0 = time.perf_counter()
    found = discover(job, full_env)
    t_discover = time.perf_counter() - t0
    pick = re.compile(kernel) if kernel else None
    launches, owners, errors = [], [], []
    for row in found["shapes"]:
        if "error" in row:
            errors.append(f"{row['name']}: the op failed under the recorder: {row['error']}")
        for launch in row["launches"]:
            if pick is None or pick.search(launch["kernel"]):
                launches.append(launch)
                owners.append(row["name"])
    compiled = compile_launches(launches, full_env, arch=arch, jobs=jobs, worktree=job["worktree"],
                                op=job["op"], package=job["package"]) if launches else {"results": [], "versions": {}}
    records = []
    for res in compiled["results"]:
        launch = launches[res["launch"]]
        record = {"shape": owners[res["launch"]], "mode": mode, "dtype": job["dtype"], "module": launch["module"],
                  "launches": launch["count"], **{k: v for k, v in res.items() if k != "launch"}}
        records.append(record)
        if "error" in res:
            errors.append(f"{record['shape']} {res['kernel']}: {res['error']}")
    header = {"experiment": str(experiment), "side": side, "env": full_env, "worktree": job["worktree"],
              "op": job["op"], "mode": mode, "dtype": job["dtype"], "shapes": [s.name for s in rows],
              "arch": arch, "kernel_filter": kernel, **compiled.get("versions", {}),
              "unique_compiles": compiled.get("unique_compiles", 0),
              "discover_s": round(t_discover, 1), "total_s": round(time.perf_counter() - t0, 1)}
    return {"header": header, "records": records, "errors": errors}


# ------------------------------------------------------------------------ the table
def _launch_label(records: list[dict]) -> dict[int, str]:
    """Per record of one (shape, kernel): the constexprs (not from a config) that tell its
    launches apart, e.g. STORE_A=True for the backward's recompute."""
    config_keys = {k for r in records for k in r.get("config", {}).get("kwargs", {})}
    values: dict[str, set] = {}
    for r in records:
        for k, v in r.get("constexprs", {}).items():
            if k not in config_keys:
                values.setdefault(k, set()).add(v)
    varying = [k for k, vs in values.items() if len(vs) > 1]
    return {id(r): " ".join(f"{k}={r['constexprs'].get(k)}" for k in varying) for r in records}


def _config_label(config: dict) -> str:
    parts = [f"w{config['num_warps']}", f"s{config['num_stages']}"]
    if config.get("num_ctas", 1) != 1:
        parts.append(f"ctas{config['num_ctas']}")
    if config.get("maxnreg"):
        parts.append(f"maxnreg{config['maxnreg']}")
    parts += [f"{k}={v}" for k, v in config.get("kwargs", {}).items()]
    return " ".join(parts)


def format_table(result: dict, color: bool = False) -> str:
    h = result["header"]
    env = " ".join(f"{k}={v}" for k, v in h["env"].items()) or "(none)"
    lines = [f"{Path(h['experiment']).name}: {h['op']} from {h['worktree']}, {h['mode']}, {h['dtype']}, "
             f"side {h['side']}, env {env}",
             f"offline compile for {h.get('target', h['arch'])}: Triton {h.get('triton', '?')}, ptxas "
             f"{h.get('ptxas', '?')}; {h['unique_compiles']} distinct specialisations compiled in {h['total_s']} s "
             f"(ptxas figures, not ncu measurements)"]
    cols = ("kernel", "launch", "config", "regs", "stack B", "local B", "STL/LDL", "shared B", "blocks/SM", "")
    by_shape: dict[str, list[dict]] = {}
    for r in result["records"]:
        by_shape.setdefault(r["shape"], []).append(r)
    for shape, records in by_shape.items():
        labels: dict[int, str] = {}
        for name in dict.fromkeys(r["kernel"] for r in records):
            labels.update(_launch_label([r for r in records if r["kernel"] == name]))
        rows = []
        for r in records:
            launch = labels.get(id(r), "") + (f" x{r['launches']}" if r["launches"] > 1 else "")
            if "error" in r:
                rows.append((r["kernel"], launch.strip(), "", "", "", "", "", "", "", r["error"].splitlines()[0][:80]))
                continue
            rows.append((r["kernel"], launch.strip(), _config_label(r["config"]), str(r["registers"]),
                         str(r["stack_bytes"]), str(r["local_bytes"]), f"{r['spill_stores']}/{r['spill_loads']}",
                         str(r["shared_bytes"]),
                         str(min(r["occupancy_limit_registers"], r["occupancy_limit_warps"])),
                         ", ".join(flag for flag, on in (("SPILLS", r["spills"]),
                                                          ("OVER SHARED", r.get("over_shared")))
                                   if on)))
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        lines += ["", f"{shape}"]

        def fmt(row):  # names and labels to the left, numbers to the right
            return "  ".join(v.ljust(w) if i < 3 or i == 9 else v.rjust(w)
                             for i, (v, w) in enumerate(zip(row, widths))).rstrip()
        lines.append(fmt(cols))
        for row in rows:
            text = fmt(row)
            lines.append(f"\033[1;31m{text}\033[0m" if color and row[9] else text)
    lines += ["", "launch: the constexprs that tell a kernel's launches apart (xN: launched N times a call); "
              "config: num_warps, num_stages, the config's kwargs",
              "stack/local B: per thread; STL/LDL: local store/load instructions in the SASS (static count); "
              f"shared B: a block's (Triton's dynamic + static); OVER SHARED: above the "
              f"{SM90_MAX_SHARED_PER_BLOCK} B an sm_90 block may have (the config cannot launch)",
              "blocks/SM: how many blocks of this config a Hopper SM holds by registers and warps "
              "(shared memory's limit depends on the launch's carveout and is left out)"]
    for e in result["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        step, job_path, out_path = argv[1:4]
        sys.path.insert(0, str(ROOT))
        job = json.loads(Path(job_path).read_text())
        result = _worker_discover(job) if step == "discover" else _worker_compile(job)
        Path(out_path).write_text(json.dumps(result))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help="an experiment file (experiments/NAME.yaml)")
    p.add_argument("--shape", action="append", help="a shape name (repeatable; default: every row of shapes:)")
    p.add_argument("--mode", default="fwd+bwd", choices=sorted(MODES))
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="default: the experiment's")
    p.add_argument("--side", default="baseline", choices=("baseline", "candidate"),
                   help="whose declared env applies (kernels always come from --worktree)")
    p.add_argument("--env", action="append", type=_env_pair, default=[], metavar="KEY=VALUE",
                   help="an environment variable for the op (repeatable; wins over the side's env)")
    p.add_argument("--worktree", help="the checkout whose kernels are compiled (default: the experiment's target repo)")
    p.add_argument("--kernel", help="only kernels whose name matches this regex")
    p.add_argument("--arch", type=int, default=90,
                   help="CUDA compute capability to compile for (default 90; blocks/SM counts Hopper's SM)")
    p.add_argument("--jobs", type=int, help="parallel compiles (default: CPU count)")
    p.add_argument("--json", help="write the records (and a header) to this file")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from harness.spec import SpecError

    try:
        result = measure(a.experiment, a.shape, a.mode, a.dtype, a.side, dict(a.env), a.worktree, a.kernel,
                         a.arch, a.jobs)
    except (SpecError, KeyError, ValueError) as e:
        print(f"kernel_resources: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a child step failed: its stderr is in the message
        print(f"kernel_resources: {e}", file=sys.stderr)
        return 1
    print(format_table(result, color=sys.stdout.isatty()))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
