"""Run one autotuned Triton kernel under each config of its autotune space alone, each config in
its own process: which config faults, and whether the configs agree on the op's outputs.

    python tools/autotune_configs.py EXPERIMENT.yaml --kernel NAME [--shape NAME] [--mode fwd|fwd+bwd]
        [--dtype float32|float16|bfloat16] [--side baseline|candidate] [--env KEY=VALUE ...]
        [--worktree DIR] [--configs 0,2] [--device cuda|cpu] [--timeout S] [--json OUT]

Why: an autotuner benchmarks every config of its space in one process, so a single config that
faults (on an H100 one config of a kernel's space, BV 32 with 8 warps, raised "CUDA error: an
illegal memory access" in bf16 only) kills the whole process, and the traceback cannot say which
config it was. Here each config runs alone in a fresh child process with CUDA_LAUNCH_BLOCKING=1,
so a fault is reported at the launch that made it, against the config that made it, and the other
configs still run.

How (children of this file, `--worker STEP job.json out.json`, as tools/kernel_resources.py's):
  1. list (TRITON_INTERPRET unset, nothing runs): the side's op is imported (from `--worktree`,
     default the experiment's target repository as it is checked out, or the side's installed
     package) and the autotuner named NAME is looked up among the modules the import loaded from
     there (then, if absent, the op package's other submodules); its configs are written as JSON
     (kwargs, num_warps, num_stages, num_ctas, maxnreg). The interpreter stays off because this
     project's kernels keep only their first config under it (kernels/pkda `_configs` returns
     `cands[:1] if INTERPRET`). NAME may be written MODULE:NAME where two modules define one name.
  2. run, one child per selected config (`--configs`, default all): CUDA_LAUNCH_BLOCKING=1 on cuda,
     TRITON_INTERPRET=1 on cpu; the op is imported, the autotuner's `configs` becomes that one
     config (rebuilt from the JSON; with a single config Triton's autotuner benchmarks nothing and
     launches it), the experiment's input factory builds the inputs on the device at the shape,
     mode, dtype and seed (harness.measure.call: load_inputs, load_op, Call, as every harness
     worker does), the op is called once (fwd: the forward under no_grad; fwd+bwd: the forward
     and the backward, outputs then gradients), the device is synchronized and the outputs are
     saved (CPU copies, torch.save). Each launch of the kernel is recorded with the config it
     took: a child whose kernel ran another config is FAILED, one whose op never launched the
     kernel is 'not launched'. A child that raises, exits nonzero, dies by a signal or runs past
     `--timeout` (default 600 s) is FAILED, with the last meaningful line of its error.
  The parent prints one row a config: its index and label (warps, stages, kwargs), ok or FAILED,
  the call's seconds (compile included) and the child's, and for ok configs the largest
  difference of any output against the first ok config's outputs: max |x - ref| and that divided
  by max |ref| of the same output (a normwise relative difference: an elementwise one explodes
  where ref is 0). `--json` writes every record, each output's differences included.
Exit status: 0 every selected config ran, 1 one or more FAILED, 2 bad input (experiment, shape,
kernel, option) or a setup that never reached a config (the op not importing in the list step, the
kernel never launched by the op at this shape and mode).

Environment: the side's declared `env` (`--side`, default baseline), then each `--env KEY=VALUE`,
is set in every child before the op is imported (a knob read at import can set the space, e.g.
PKDA_BWD_INTRA_WARPS). On cpu, as `harness run --cpu`: the experiment's `cpu:` dims for a shape
it declares there (no --shape: its first `cpu.shapes` row), dtype float32, its `cpu.python_path`
on PYTHONPATH, and TF32 dot emulation unless `cpu.emulate_tf32: false`. On cuda the declared dims
and dtype (--shape default: the first row of `shapes:`).

Limits:
  * a config that corrupts memory without faulting is seen only through the output differences
    (and then only where the corruption reaches an output); the tool draws no line between a
    rounding difference and a wrong answer: read the numbers against the dtype;
  * `--device cpu` runs Triton's interpreter: it does not reproduce GPU faults (no registers,
    shared memory or launch limits); it is for checking the tool and the configs' numerics, and
    float32 only (the interpreter computes bf16 / fp16 wrong without a word on CPU);
  * a config is rebuilt from its JSON record: a config's `pre_hook` survives only where the
    child's space holds an equal config (on cuda, where the whole space is imported);
    early_config_prune / perf_model are bypassed (one config is never pruned);
  * the kernel is forced for every launch of it in the call (all its launches take the config);
    other autotuned kernels of the op tune as usual: on cuda each child benchmarks their whole
    spaces, so a faulting config of another kernel fails every row alike (a failure all configs
    share is probably not this kernel's: run the tool on the op's other autotuned kernels).
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_resources as kr  # noqa: E402  (a sibling script: its argument descriptors and helpers)

MODES = kr.MODES
DEVICES = ("cuda", "cpu")
DEFAULT_TIMEOUT_S = 600.0


class BadInput(ValueError):
    """An experiment, shape, kernel or option the tool cannot run with (exit 2)."""


# ------------------------------------------------------------------------ the kernel (in a child)
def _module_origin(module) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def _installed(origin: Path) -> bool:
    """A module of the Python environment (a virtual environment may sit inside the worktree, as
    this checkout's .venv does), not of the side's code."""
    prefix = Path(sys.prefix).resolve()
    return origin.is_relative_to(prefix) or bool({"site-packages", "dist-packages"} & set(origin.parts))


def modules_from(worktree: str, package: dict | None, op: str, skip: set[str]) -> list:
    """The modules loaded from the side's code (its worktree, or its installed package), leaving
    out those in `skip` (the harness and this tool, loaded before the op: under our own
    experiments the worktree is this checkout)."""
    top = op.split(":")[0].split(".")[0]
    root = Path(worktree).resolve()
    found = []
    for name, module in sorted(sys.modules.items()):
        if name in skip or module is None:
            continue
        if package:
            if name == top or name.startswith(top + "."):
                found.append(module)
            continue
        origin = _module_origin(module)
        if origin is not None and origin.is_relative_to(root) and not _installed(origin):
            found.append(module)
    return found


def _import_op_package_submodules(op: str) -> list[str]:
    """Import every submodule of the op module's package (a kernel its import does not load, e.g.
    one imported inside a function); the failures, as 'module: error'."""
    module_name = op.split(":")[0]
    package = importlib.import_module(module_name)
    if not hasattr(package, "__path__"):  # the op sits in a module: search its package's
        package = importlib.import_module(module_name.rpartition(".")[0] or module_name)
    package_name = package.__name__
    failures = []
    for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
        name = f"{package_name}.{info.name}"
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - one module that cannot import is named, the search goes on
            failures.append(f"{name}: {type(e).__name__}: {e}")
    return failures


def autotuner_inside(obj):
    """The Autotuner in a kernel object's wrapper chain (heuristics over autotune, ...), or None."""
    from triton.runtime.autotuner import Autotuner

    seen = 0
    while obj is not None and seen < 16:  # a wrapper chain is a few layers; never loop forever
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
        seen += 1
    return None


def _is_triton_kernel(obj) -> bool:
    from triton.runtime.jit import KernelInterface

    return isinstance(obj, KernelInterface)


def find_autotuner(kernel: str, worktree: str, package: dict | None, op: str, skip: set[str]):
    """(the Autotuner named `kernel`, 'module:name'); BadInput naming the kernel and the modules
    searched when it is nowhere, defined twice, or not autotuned."""
    if ":" in kernel:  # MODULE:NAME, for a name two modules define
        module_name, name = kernel.split(":", 1)
        try:
            candidates = {module_name: getattr(importlib.import_module(module_name), name)}
        except (ImportError, AttributeError) as e:
            raise BadInput(f"--kernel {kernel}: {type(e).__name__}: {e}") from e
        searched = [module_name]
    else:
        name = kernel
        candidates, searched, failures = _candidates(name, worktree, package, op, skip), [], []
        if not candidates:  # not loaded by the op's import: try the rest of the op's package
            failures = _import_op_package_submodules(op)
            candidates = _candidates(name, worktree, package, op, skip)
        searched = [m.__name__ for m in modules_from(worktree, package, op, skip)]
        if not candidates:
            where = ", ".join(searched) or "(none)"
            extra = f"; these did not import: {'; '.join(failures)}" if failures else ""
            raise BadInput(f"--kernel {name}: no module-level object of that name in the modules "
                           f"loaded from {package['name'] if package else worktree}: {where}{extra}")
    tuners = {}
    for module_name, obj in candidates.items():
        tuner = autotuner_inside(obj)
        if tuner is None:
            what = "a @triton.jit function without @triton.autotune" if _is_triton_kernel(obj) else type(obj).__name__
            raise BadInput(f"--kernel {kernel}: {module_name}.{name} is {what}, not autotuned "
                           f"(modules searched: {', '.join(searched)})")
        tuners.setdefault(id(tuner), (tuner, f"{module_name}:{name}"))
    if len(tuners) > 1:
        names = ", ".join(where for _, where in tuners.values())
        raise BadInput(f"--kernel {kernel}: {len(tuners)} different autotuned kernels of that name "
                       f"({names}): pass --kernel MODULE:NAME")
    return next(iter(tuners.values()))


def _candidates(name: str, worktree: str, package: dict | None, op: str, skip: set[str]) -> dict:
    """{module name: object} for every searched module that holds a module-level `name`; a name
    re-exported by a package is the same object, which find_autotuner folds into one."""
    return {m.__name__: vars(m)[name] for m in modules_from(worktree, package, op, skip) if name in vars(m)}


# ------------------------------------------------------------------------ configs as JSON
def config_record(config) -> dict:
    """A triton.Config as JSON: its kwargs as kernel_resources descriptors, its launch options."""
    return {"kwargs": {k: kr.describe(v) for k, v in config.kwargs.items()},
            "num_warps": config.num_warps, "num_stages": config.num_stages, "num_ctas": config.num_ctas,
            "maxnreg": config.maxnreg, "has_pre_hook": config.pre_hook is not None,
            "ir_override": config.ir_override}


def config_from_record(record: dict):
    import triton

    return triton.Config({k: kr.rebuild(d) for k, d in record["kwargs"].items()},
                         num_warps=record["num_warps"], num_stages=record["num_stages"],
                         num_ctas=record["num_ctas"], maxnreg=record["maxnreg"],
                         ir_override=record.get("ir_override"))


def config_label(record: dict) -> str:
    """'w8 s2 BV=32': kernel_resources' label of a config (warps, stages, kwargs)."""
    return kr._config_label({**record, "kwargs": {k: kr._shown(d) for k, d in record["kwargs"].items()}})


def _same_config_in_space(tuner, config):
    """The space's own Config equal to the rebuilt one (it keeps a pre_hook JSON cannot carry),
    else the rebuilt one."""
    wanted = config.all_kwargs()
    return next((c for c in tuner.configs if c.all_kwargs() == wanted), config)


# ------------------------------------------------------------------------ step 1: list (child)
def _load_side(job: dict):
    """The op as the harness loads it; the module names loaded before it (the harness, this tool)."""
    import harness.interpreter_tf32  # noqa: F401  (load_op imports these: loaded first, they are
    import harness.triton_autotune_cache  # noqa: F401  not searched when the worktree is this checkout)
    from harness.measure.call import load_op

    before = set(sys.modules)
    op = load_op(job["worktree"], job["op"], job.get("package"))
    return op, before


def _worker_list(job: dict) -> dict:
    from triton import knobs

    if knobs.runtime.interpret:
        raise RuntimeError("the list step needs TRITON_INTERPRET unset (the interpreter keeps one config)")
    _, before = _load_side(job)
    tuner, where = find_autotuner(job["kernel"], job["worktree"], job.get("package"), job["op"], before)
    return {"kernel": where, "key": list(tuner.keys),
            "pruned": bool(tuner.early_config_prune or tuner.perf_model),
            "configs": [config_record(c) for c in tuner.configs]}


# ------------------------------------------------------------------------ step 2: run (child)
def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _worker_run(job: dict) -> dict:
    import torch

    from harness.measure.call import DTYPES, Call, load_inputs

    faulthandler.enable()  # a segfault in a launch still leaves a line on stderr for the parent
    make_inputs = load_inputs(job["inputs_file"], job["inputs_fn"])
    op, before = _load_side(job)
    tuner, _ = find_autotuner(job["kernel"], job["worktree"], job.get("package"), job["op"], before)
    config = _same_config_in_space(tuner, config_from_record(job["config"]))
    # one config: Triton's Autotuner.run skips benchmarking and launches configs[0]
    tuner.configs, tuner.cache = [config], {}
    launched = _record_launches(tuner)
    inputs = make_inputs(job["shape"], job["mode"], DTYPES[job["dtype"]], job["device"], job["seed"])
    call = Call(op, inputs, job["mode"], job["seed"])
    t0 = time.perf_counter()
    outs = call()
    _synchronize(job["device"])
    call_s = time.perf_counter() - t0
    if not launched:
        return {"not_launched": True, "call_s": call_s}
    torch.save([t.detach().cpu() for t in outs], job["outputs_file"])
    return {"call_s": call_s, "outputs_file": job["outputs_file"], "launches": len(launched),
            "launched": [dict(c) for c in {json.dumps(c, sort_keys=True): c for c in launched}.values()]}


def _record_launches(tuner) -> list[dict]:
    """The config of each launch of the kernel, as Autotuner.run picked it (a launch goes through
    the instance's `run`: kernel[grid](...) and a heuristics layer above both call it)."""
    launched: list[dict] = []
    run = tuner.run

    def recording_run(*args, **kwargs):
        out = run(*args, **kwargs)
        launched.append(config_record(tuner.best_config))
        return out

    tuner.run = recording_run
    return launched


# ------------------------------------------------------------------------ child plumbing
# lines after an error that say nothing about it: CUDA's and PyTorch's hints, faulthandler's
# thread dump (indented frames included), Python's warnings machinery
_NOISE = re.compile(r"^\s*$|^\s|^CUDA kernel errors might be|^For debugging consider passing|"
                    r"^Compile with `TORCH_USE_CUDA_DSA`|^Search for `cuda|^Current thread|^Thread 0x|"
                    r"^Extension modules:|^\(total: \d+\)|^Traceback \(most recent call last\)|"
                    r"warnings\.warn\(|Warning: ")


def last_meaningful_line(text: str) -> str:
    lines = [line for line in text.splitlines() if not _NOISE.search(line)]
    return lines[-1].strip() if lines else ""


def _error_line(e: BaseException) -> str:
    """'Type: message' on one line: the message's first line, or its last where the first is only
    Triton's source pointer ('at 5:4:', a CompilationError's)."""
    lines = [line for line in str(e).splitlines() if not _NOISE.search(line)]
    line = lines[0].strip() if lines else ""
    if re.fullmatch(r"at \d+:\d+:", line) and len(lines) > 1:
        line = lines[-1].strip()
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _child_env(env: dict[str, str], device: str | None) -> dict[str, str]:
    """kernel_resources' child environment (the caller's TRITON_INTERPRET never leaks in): the
    interpreter on for cpu runs; blocking launches for cuda runs, so a fault raises at its launch."""
    out = kr._child_env(env, interpret=device == "cpu")
    if device == "cuda":
        out["CUDA_LAUNCH_BLOCKING"] = "1"
    return out


def run_child(step: str, job: dict, env: dict[str, str], device: str | None, timeout_s: float,
              workdir: Path) -> dict:
    """This file as `--worker STEP` in its own process group: {"ok", "wall_s", "result" | "error"}."""
    job_path, out_path = workdir / f"{step}-job.json", workdir / f"{step}-out.json"
    out_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", step, str(job_path),
                             str(out_path)], cwd=str(ROOT), env=_child_env(env, device),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {"ok": False, "wall_s": time.perf_counter() - t0, "error": f"timed out after {timeout_s:g} s"}
    except BaseException:  # Ctrl-C or SIGTERM of the parent: its own session would keep the child alive
        _kill_group(proc)
        raise
    wall_s = time.perf_counter() - t0
    written = _read_json(out_path)
    if proc.returncode == 0 and "result" in written:
        return {"ok": True, "wall_s": wall_s, "result": written["result"]}
    if "bad_input" in written:
        return {"ok": False, "wall_s": wall_s, "bad_input": written["bad_input"]}
    error = written.get("error") or last_meaningful_line(stderr) or last_meaningful_line(stdout)
    if proc.returncode < 0:  # died by a signal: say which, beside whatever it printed last
        error = f"killed by {_signal_name(-proc.returncode)}" + (f": {error}" if error else "")
    elif not error:
        error = f"exit {proc.returncode} with nothing on stderr"
    return {"ok": False, "wall_s": wall_s, "error": error, "stderr_tail": stderr[-4000:]}


def _kill_group(proc: subprocess.Popen) -> None:
    """The child and whatever it started (e.g. ptxas): it runs in a process group of its own."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def _read_json(path: Path) -> dict:
    """A child's out.json; {} when it never wrote one, or died while writing it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _worker_main(step: str, job_path: str, out_path: str) -> int:
    """A child's body: its result, or its error, in out.json; the traceback on stderr."""
    sys.path.insert(0, str(ROOT))
    job = json.loads(Path(job_path).read_text())
    try:
        result = {"list": _worker_list, "run": _worker_run}[step](job)
    except BadInput as e:
        Path(out_path).write_text(json.dumps({"bad_input": str(e)}))
        return 2
    except Exception as e:  # noqa: BLE001 - the config's failure is the result the parent wants
        traceback.print_exc()
        Path(out_path).write_text(json.dumps({"error": _error_line(e)}))
        return 1
    Path(out_path).write_text(json.dumps({"result": result}))
    return 0


# ------------------------------------------------------------------------ output differences
def difference(out, ref) -> dict:
    """max |out - ref| and that over max |ref| (finite entries), and the entries finite in one but
    not the other (a NaN where the reference has a number is a wrong answer, not a rounding)."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return {"shape": list(out.shape), "ref_shape": list(ref.shape)}
    a, b = out.to(torch.float64), ref.to(torch.float64)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    same_nonfinite = (a == b) | (torch.isnan(a) & torch.isnan(b))
    mismatched = int(((fa != fb) | (~fa & ~fb & ~same_nonfinite)).sum())
    both = fa & fb
    max_abs = float((a[both] - b[both]).abs().max()) if both.any() else 0.0
    scale = float(b[both].abs().max()) if both.any() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return {"shape": list(out.shape), "max_abs": max_abs, "max_rel": max_rel, "nonfinite_mismatch": mismatched}


def compare(outs: list, ref: list) -> dict:
    """Every output against the reference config's; the worst of them for the table."""
    per = [difference(o, r) for o, r in zip(outs, ref)]
    summary = {"outputs": per}
    if len(outs) != len(ref):
        summary["count_differs"] = f"{len(outs)} outputs, the reference has {len(ref)}"
    shapes = [i for i, d in enumerate(per) if "max_abs" not in d]
    if shapes:
        summary["shapes_differ"] = [f"out {i} {tuple(per[i]['shape'])} vs {tuple(per[i]['ref_shape'])}" for i in shapes]
    numeric = [(i, d) for i, d in enumerate(per) if "max_abs" in d]
    if numeric:
        worst_abs = max(numeric, key=lambda p: p[1]["max_abs"])
        worst_rel = max(numeric, key=lambda p: p[1]["max_rel"])
        summary.update(max_abs=worst_abs[1]["max_abs"], max_rel=worst_rel[1]["max_rel"], worst_output=worst_rel[0],
                       nonfinite_mismatch=sum(d["nonfinite_mismatch"] for _, d in numeric))
    return summary


def _nonfinite_outputs(outs: list) -> list[int]:
    import torch

    return [i for i, t in enumerate(outs) if t.is_floating_point() and not torch.isfinite(t).all()]


# ------------------------------------------------------------------------ options -> job
def parse_configs(text: str | None, count: int) -> list[int]:
    if text is None:
        return list(range(count))
    try:
        picked = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BadInput(f"--configs must be comma-separated config indices, got {text!r}") from None
    outside = [i for i in picked if not 0 <= i < count]
    if not picked or outside:
        raise BadInput(f"--configs {text}: the space has {count} configs (indices 0..{count - 1})")
    return list(dict.fromkeys(picked))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_shape(exp, name: str | None, device: str):
    """(the shape, where its dims came from): on cpu a name the experiment's `cpu:` profile
    declares takes its stand-in dims, as `harness run --cpu` does (the interpreter is slow)."""
    cpu_rows = [*exp.cpu.shapes, *exp.cpu.fixture_shapes] if (device == "cpu" and exp.cpu is not None) else []
    if name is None:
        return (cpu_rows[0], "cpu.shapes") if cpu_rows else (exp.shapes[0], "shapes")
    for row in cpu_rows:
        if row.name == name:
            return row, "the experiment's cpu: profile"
    try:
        return exp.shape(name), "shapes" if name in {s.name for s in exp.shapes} else "fixture_shapes"
    except KeyError:
        known = [s.name for s in [*exp.shapes, *exp.fixture_shapes]]
        raise BadInput(f"--shape {name}: experiment {exp.name!r} has no such row or fixture shape "
                       f"(it has {', '.join(known)})") from None


def pick_dtype(exp, dtype: str | None, device: str) -> str:
    """The experiment's dtype on cuda; float32 on cpu (a CPU run's dtype, cpu.dtype), where no other
    is allowed: the interpreter runs bf16 / fp16 wrong without raising."""
    if device != "cpu":
        return dtype or exp.dtype
    if dtype not in (None, "float32"):
        raise BadInput(f"--dtype {dtype} with --device cpu: Triton's interpreter computes {dtype} wrong "
                       f"on CPU without an error; use --dtype float32 there, or run on cuda")
    return "float32"


def build_job(experiment, kernel: str, shape: str | None, mode: str, dtype: str | None, side: str,
              env: dict[str, str] | None, worktree, device: str) -> tuple[dict, dict[str, str], dict]:
    """(the job every child reads, the children's env, the header), BadInput for bad options."""
    from harness.measure.sides import emulates_tf32, side_op
    from harness.spec import load_experiment

    if mode not in MODES:
        raise BadInput(f"--mode must be one of {sorted(MODES)}, got {mode!r}")
    if device not in DEVICES:
        raise BadInput(f"--device must be one of {DEVICES}, got {device!r}")
    if device == "cuda" and default_device() != "cuda":
        raise BadInput("--device cuda: torch.cuda.is_available() is False here (use --device cpu)")
    loaded = load_experiment(experiment)
    exp = loaded.exp
    row, dims_from = pick_shape(exp, shape, device)
    dtype = pick_dtype(exp, dtype, device)
    full_env = {**getattr(exp, side).env, **(env or {})}
    for owned in ("TRITON_INTERPRET", "CUDA_LAUNCH_BLOCKING"):
        if owned in full_env:
            raise BadInput(f"{owned} is set by the tool itself (--device picks it), not by --env or the side's env")
    if device == "cpu":
        full_env["HARNESS_EMULATE_TF32"] = "1" if emulates_tf32(loaded) else "0"
        extra = [str(p) for p in loaded.cpu_python_path]
        if extra:
            full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *extra, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if worktree is not None and not Path(worktree).is_dir():
        raise BadInput(f"--worktree {worktree}: no such directory")
    job = {"worktree": str(Path(worktree).resolve()) if worktree else str(loaded.target_repo),
           **side_op(exp, side), "kernel": kernel,
           "inputs_file": str(loaded.inputs_file), "inputs_fn": exp.target.inputs.split(":")[1],
           "shape": row.model_dump(exclude_none=True), "mode": MODES[mode], "dtype": dtype,
           "device": device, "seed": exp.seed}
    header = {"experiment": str(experiment), "side": side, "env": full_env, "worktree": job["worktree"],
              "op": job["op"], "kernel": kernel, "shape": job["shape"], "shape_from": dims_from,
              "mode": mode, "dtype": dtype, "device": device, "seed": exp.seed}
    return job, full_env, header


# ------------------------------------------------------------------------ the whole run
def autotune_configs(experiment, kernel: str, shape: str | None = None, mode: str = "fwd+bwd",
                     dtype: str | None = None, side: str = "baseline", env: dict[str, str] | None = None,
                     worktree=None, configs: str | None = None, device: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S, progress=None) -> dict:
    """List the kernel's space, run the selected configs one child each, compare their outputs.
    Returns {"header", "space": [config records], "records": [one per run config]}; a record:
    index, config, label, status ('ok' | 'FAILED' | 'not launched'), call_s, wall_s, and error
    (FAILED) or the differences against the reference config (ok)."""
    import torch

    if not timeout_s > 0:
        raise BadInput(f"--timeout must be positive, got {timeout_s}")
    device = device or default_device()
    job, env, header = build_job(experiment, kernel, shape, mode, dtype, side, env, worktree, device)
    with tempfile.TemporaryDirectory(prefix="autotune-configs-") as tmp:
        listed = run_child("list", job, env, None, timeout_s, Path(tmp))
        if not listed["ok"]:
            raise BadInput(listed.get("bad_input") or f"the list step failed (nothing was run): {listed['error']}"
                           + (f"\n{listed['stderr_tail']}" if listed.get("stderr_tail") else ""))
        space = listed["result"]["configs"]
        header.update(kernel=listed["result"]["kernel"], key=listed["result"]["key"],
                      pruned=listed["result"]["pruned"], space_size=len(space))
        picked = parse_configs(configs, len(space))
        records, reference = [], None
        for index in picked:
            record = _run_config(job, env, device, timeout_s, Path(tmp), index, space[index])
            if record["status"] == "ok":
                outs = torch.load(record.pop("outputs_file"))
                record["nonfinite_outputs"] = _nonfinite_outputs(outs)
                if reference is None:
                    reference, record["reference"] = outs, True
                    header["reference"] = index
                else:
                    record["diff"] = compare(outs, reference)
                del outs
            records.append(record)
            if progress:
                progress(record, len(records), len(picked))
    return {"header": header, "space": space, "records": records}


def _run_config(job: dict, env: dict[str, str], device: str, timeout_s: float, workdir: Path, index: int,
                config: dict) -> dict:
    outputs_file = workdir / f"outputs-{index}.pt"
    done = run_child("run", {**job, "config": config, "outputs_file": str(outputs_file)}, env, device,
                     timeout_s, workdir)
    record = {"index": index, "config": config, "label": config_label(config), "wall_s": round(done["wall_s"], 2)}
    if done.get("bad_input"):  # the child could not find the kernel the list step found
        return {**record, "status": "FAILED", "error": done["bad_input"]}
    if not done["ok"]:
        return {**record, "status": "FAILED", "error": done["error"], "stderr_tail": done.get("stderr_tail", "")}
    result = done["result"]
    record["call_s"] = round(result["call_s"], 3)
    if result.get("not_launched"):
        return {**record, "status": "not launched"}
    record.update(launches=result["launches"], launched=result["launched"])
    if [_launch_key(c) for c in result["launched"]] != [_launch_key(config)]:  # the override did not hold
        others = ", ".join(config_label(c) for c in result["launched"])
        return {**record, "status": "FAILED", "error": f"the kernel launched with {others}, not {record['label']}"}
    return {**record, "status": "ok", "outputs_file": result["outputs_file"]}


def _launch_key(record: dict) -> dict:
    """What a launch takes from a config (a pre_hook JSON cannot carry is left out)."""
    return {k: v for k, v in record.items() if k != "has_pre_hook"}


def exit_status(result: dict) -> int:
    statuses = {r["status"] for r in result["records"]}
    if "not launched" in statuses:
        return 2  # nothing about this kernel was tested at this shape and mode
    return 1 if "FAILED" in statuses else 0


# ------------------------------------------------------------------------ the table
def _g(x: float) -> str:
    return f"{x:.3g}" if x else "0"


def _row(r: dict) -> tuple[str, ...]:
    call = f"{r['call_s']:.2f}" if "call_s" in r else ""
    head = (str(r["index"]), r["label"], r["status"], call, f"{r['wall_s']:.1f}")
    if r["status"] != "ok":
        why = r.get("error") or "the op did not launch this kernel at this shape and mode"
        return (*head, "", "", why)
    notes = []
    if r.get("reference"):
        notes.append("reference")
    if r.get("nonfinite_outputs"):
        notes.append(f"non-finite in out {','.join(map(str, r['nonfinite_outputs']))}")
    diff = r.get("diff", {})
    notes += diff.get("shapes_differ", [])
    if diff.get("count_differs"):
        notes.append(diff["count_differs"])
    if diff.get("nonfinite_mismatch"):
        notes.append(f"{diff['nonfinite_mismatch']} entries finite in one config only")
    if "max_abs" in diff:
        if diff["max_abs"]:  # which output differs most; nothing to point at when none differs
            notes.insert(0, f"worst out {diff['worst_output']}")
        return (*head, _g(diff["max_abs"]), _g(diff["max_rel"]), "; ".join(notes))
    return (*head, "", "", "; ".join(notes))


def format_table(result: dict, color: bool = False) -> str:
    h = result["header"]
    env = " ".join(f"{k}={v}" for k, v in h["env"].items()) or "(none)"
    dims = " ".join(f"{k}={v}" for k, v in h["shape"].items() if k != "name")
    runner = "TRITON_INTERPRET=1: no GPU fault reproduces there" if h["device"] == "cpu" else "CUDA_LAUNCH_BLOCKING=1"
    lines = [f"{Path(h['experiment']).name}: {h['op']} from {h['worktree']}, side {h['side']}, env {env}",
             f"{h['kernel']}: {h['space_size']} configs (key {h['key']}), "
             f"{len(result['records'])} run one a process on {h['device']} ({runner})",
             f"shape {h['shape']['name']} ({dims}, from {h['shape_from']}), {h['mode']}, {h['dtype']}, seed {h['seed']}",
             ""]
    cols = ("#", "config", "status", "call s", "total s", "max abs", "max rel", "")
    rows = [_row(r) for r in result["records"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]

    def fmt(row):  # labels to the left, numbers to the right
        return "  ".join(v.ljust(w) if i in (1, 2, 7) else v.rjust(w)
                         for i, (v, w) in enumerate(zip(row, widths))).rstrip()
    lines.append(fmt(cols))
    for row in rows:
        text = fmt(row)
        lines.append(f"\033[1;31m{text}\033[0m" if color and row[2] != "ok" else text)
    ref = h.get("reference")
    lines += ["", "call s: the op's one call in the child (compiles included), synchronized; total s: the child process",
              f"max abs / max rel: the worst output (worst out N: the op's outputs, then on fwd+bwd the gradients) "
              f"against config {ref if ref is not None else '-'}'s, the first ok one; rel = max |x - ref| / max |ref| "
              f"of that output"]
    if h.get("pruned"):
        lines.append("the autotuner prunes its space (early_config_prune / perf_model): each config here runs unpruned")
    return "\n".join(lines)


# ------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker_main(*argv[1:4])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help="an experiment file (experiments/NAME.yaml)")
    p.add_argument("--kernel", required=True, help="the autotuned kernel's name (or MODULE:NAME)")
    p.add_argument("--shape", help="a row or fixture shape name (default: the first row of shapes:)")
    p.add_argument("--mode", default="fwd+bwd", choices=sorted(MODES))
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="default: the experiment's (float32 on cpu, the only dtype allowed there)")
    p.add_argument("--side", default="baseline", choices=("baseline", "candidate"),
                   help="whose op and declared env (kernels come from --worktree)")
    p.add_argument("--env", action="append", type=kr._env_pair, default=[], metavar="KEY=VALUE",
                   help="an environment variable for the op (repeatable; wins over the side's env)")
    p.add_argument("--worktree", help="the checkout whose kernels run (default: the experiment's target repo)")
    p.add_argument("--configs", help="comma-separated config indices (default: every config of the space)")
    p.add_argument("--device", choices=DEVICES, help="default: cuda when torch sees a GPU, else cpu")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a child may run (default 600)")
    p.add_argument("--json", help="write the records (and a header) to this file")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from harness.spec import SpecError

    def progress(record, done, total):
        print(f"[{done}/{total}] config {record['index']} {record['label']}: {record['status']}", file=sys.stderr)

    try:
        result = autotune_configs(a.experiment, a.kernel, a.shape, a.mode, a.dtype, a.side, dict(a.env),
                                  a.worktree, a.configs, a.device, a.timeout, progress)
    except (SpecError, BadInput) as e:
        print(f"autotune_configs: {e}", file=sys.stderr)
        return 2
    print(format_table(result, color=sys.stdout.isatty()))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return exit_status(result)


if __name__ == "__main__":
    sys.exit(main())
