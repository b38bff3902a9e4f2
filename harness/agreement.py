"""Agreement phase: both sides on the same inputs, their outputs and gradients compared elementwise.

For an experiment whose sides are two implementations of one contract (this repository's op
against the installed public one), the frozen-fixture oracle needs a git baseline; agreement
needs none: each side runs in a fresh process (`python -m harness.agreement JOB`, the harness
imported first, then the side's op from its worktree or as the installed package) on inputs the
harness generates from the experiment's seed, writes what it computed, and the parent compares
every tensor with the baseline's: |cand - base| <= atol + rtol * |base| for every element. Writes
run_dir/agreement.json with a `gate` for the agreement gate(s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from harness import children
from harness.records import append_jsonl, declared_side, run_is_aa  # noqa: F401  (append_jsonl pins the harness package before any worktree)
from harness.spec import AgreementGate, LoadedExperiment

DEFAULT_TIMEOUT_S = 3600.0  # one side's worker, all rows: first calls compile and autotune (minutes each)
STACK_DUMP_S = 300.0


def _worker(job: dict) -> int:
    import faulthandler

    import torch

    # every STACK_DUMP_S the worker's Python stacks go to its log: a worker that never returns
    # (a first call that compiles and autotunes for many minutes, or a hang) shows where it is
    faulthandler.dump_traceback_later(float(os.environ.get("HARNESS_STACK_DUMP_S", STACK_DUMP_S)), repeat=True)
    from safetensors.torch import save_file

    from harness.measure.call import DTYPES, Call, load_inputs, load_op

    out: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    make_inputs = load_inputs(job["inputs_file"], job["inputs_fn"])
    op = load_op(job["worktree"], job["op"], job.get("package"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape, mode in job["rows"]:
        key = f"{shape['name']}.{mode}"
        t0 = time.time()
        print(f"{time.strftime('%H:%M:%S')} {key}: started", flush=True)
        try:
            call = Call(op, make_inputs(shape, mode, DTYPES[job["dtype"]], device, job["seed"]), mode, job["seed"])
            for i, t in enumerate(call()):
                out[f"{key}.{i}"] = t.detach().float().cpu().contiguous()
        except Exception as e:  # recorded: the parent makes the gate INCONCLUSIVE for this row
            errors[key] = f"{type(e).__name__}: {e}"
        print(f"{time.strftime('%H:%M:%S')} {key}: {errors.get(key, 'ok')} in {time.time() - t0:.1f} s", flush=True)
    save_file(out, job["out_path"])
    Path(job["out_path"] + ".errors.json").write_text(json.dumps(errors))
    return 0


def _compare(base, cand, rtol: float, atol: float) -> dict:
    import torch

    if base.shape != cand.shape:
        return {"status": "FAIL", "problem": f"shape {tuple(cand.shape)} != baseline {tuple(base.shape)}"}
    diff = (cand - base).abs()
    bound = atol + rtol * base.abs()
    nonfinite = int((~torch.isfinite(cand)).sum())
    ratio = torch.where(bound > 0, diff / bound, torch.where(diff > 0, torch.tensor(float("inf")), torch.tensor(0.0)))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    return {"status": "PASS" if worst <= 1 and nonfinite == 0 else "FAIL", "worst_ratio": worst,
            "max_abs_err": float(diff.max()) if diff.numel() else 0.0,
            "n_bad": int((diff > bound).sum()), "n_nonfinite": nonfinite}


def _timeout() -> float:
    try:
        return float(os.environ.get("HARNESS_AGREEMENT_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def run_worker(argv: list[str], log_path: Path, env: dict, cwd: Path, timeout: float) -> str | None:
    """Run one side's worker with its output going to log_path as it is written (a worker that
    hangs, or a run killed from outside, still leaves its log and stack dumps behind). Returns
    None on success, else the problem with the log's tail."""
    with log_path.open("w") as out:
        try:
            rc = children.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    tail = log_path.read_text(errors="replace")[-1500:]
    if rc is None:
        return f"worker timed out after {timeout:.0f} s (HARNESS_AGREEMENT_TIMEOUT); log {log_path}: {tail}"
    return None if rc == 0 else f"worker exited {rc}: {tail}"


def agreement_run(loaded: LoadedExperiment, revisions, run_dir: Path, profile_root: Path, cpu_mode: bool,
                  log: Callable[[str], None] = print) -> dict:
    from safetensors.torch import load_file

    from harness.measure.sides import BenchSettings, side_env, side_op

    exp = loaded.exp
    gates = [g for g in exp.gates if isinstance(g, AgreementGate)]
    settings = BenchSettings.for_machine(loaded, cpu_mode)
    shapes = {s.name: s for s in settings.shapes}
    work = run_dir / "agreement-work"
    work.mkdir(parents=True, exist_ok=True)
    wanted = sorted({(r, m) for g in gates for r in g.rows for m in g.modes if m in exp.modes})
    missing = sorted({r for r, _ in wanted if r not in shapes})
    rows = [(shapes[r].model_dump(exclude_none=True), m) for r, m in wanted if r in shapes]
    outputs, errors = {}, {}
    aa = run_is_aa(run_dir)
    for side in ("baseline", "candidate"):
        declared = declared_side(side, aa)
        job = {"rows": rows, "dtype": settings.dtype, "seed": exp.seed, "worktree": getattr(revisions, side).worktree,
               **side_op(exp, declared),
               "inputs_file": str(loaded.inputs_file), "inputs_fn": exp.target.inputs.split(":")[1],
               "out_path": str((work / f"{side}.safetensors").resolve())}
        job_path = work / f"{side}.json"
        job_path.write_text(json.dumps(job, indent=1))
        log(f"agreement: {side} on {len(rows)} rows ({settings.dtype})")
        problem = run_worker([sys.executable, "-m", "harness.agreement", str(job_path)], work / f"{side}.log",
                             side_env(loaded, declared, profile_root, cpu_mode), work, _timeout())
        if problem or not Path(job["out_path"]).exists():
            errors[side] = {"*": problem or "the worker wrote no outputs"}
            outputs[side] = {}
            continue
        outputs[side] = load_file(job["out_path"])
        errors[side] = json.loads(Path(job["out_path"] + ".errors.json").read_text())

    results, gate_numbers, statuses = [], {}, []
    for g in gates:
        checks = []
        for r, m in wanted:
            if r not in g.rows or m not in g.modes:
                continue
            key = f"{r}.{m}"
            problem = errors.get("baseline", {}).get(key) or errors.get("candidate", {}).get(key) \
                or errors.get("baseline", {}).get("*") or errors.get("candidate", {}).get("*")
            if r in missing:
                problem = f"row {r} is not measured on this machine"
            if problem:
                checks.append({"row": r, "mode": m, "status": None, "problem": problem})
                continue
            names = sorted(k for k in outputs["baseline"] if k.startswith(key + "."))
            cand_names = sorted(k for k in outputs["candidate"] if k.startswith(key + "."))
            if names != cand_names:
                checks.append({"row": r, "mode": m, "status": "FAIL",
                               "problem": f"baseline returned {len(names)} tensors, candidate {len(cand_names)}"})
                continue
            for n in names:
                c = _compare(outputs["baseline"][n], outputs["candidate"][n], g.rtol, g.atol)
                checks.append({"row": r, "mode": m, "tensor": n.rsplit(".", 1)[1], **c})
        results += [dict(c, gate=g.name) for c in checks]
        st = [c["status"] for c in checks]
        status = "FAIL" if "FAIL" in st else (None if None in st or not st else "PASS")
        statuses.append(status)
        worst = max((c.get("worst_ratio", 0) for c in checks if c.get("worst_ratio") is not None), default=None)
        gate_numbers[g.name] = {"status": status, "rtol": g.rtol, "atol": g.atol, "worst_ratio": worst,
                                "checks": len(checks)}
    status = "FAIL" if "FAIL" in statuses else (None if None in statuses or not statuses else "PASS")
    bad = [c for c in results if c["status"] != "PASS"]
    reason = ("every output and gradient agrees within atol + rtol*|baseline|" if status == "PASS" else
              "; ".join(f"{c['row']}/{c['mode']} {c.get('tensor', '')}: "
                        f"{c.get('problem') or 'worst ratio %.3g, %d elements out' % (c['worst_ratio'], c['n_bad'])}"
                        for c in bad[:6]))
    record = {"kind": "agreement", "dtype": settings.dtype, "cpu_mode": cpu_mode, "checks": results,
              "gate": {"status": status, "reason": reason, "numbers": gate_numbers}}
    (run_dir / "agreement.json").write_text(json.dumps(record, indent=2))
    if status == "PASS":
        # the compared outputs served their purpose (506 MB a side at B4_T2048_H16_D128 in bf16, which a
        # device call then had to pack); a disagreement or a missing side keeps them for a look
        for side in ("baseline", "candidate"):
            (work / f"{side}.safetensors").unlink(missing_ok=True)
    log(f"agreement: {status or 'INCONCLUSIVE'}: {reason[:200]}")
    return record


if __name__ == "__main__":
    raise SystemExit(_worker(json.loads(Path(sys.argv[1]).read_text())))
