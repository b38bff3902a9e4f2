"""`harness run`: the whole protocol for one experiment, resumable after any crash.

Phases, each writing its own record under <results>/profile/<name>/runs/<run-id>/ and skipped
when that record exists (so `--resume` re-runs only what is missing):
    resolve -> freeze + verify (when `fixtures:`; a candidate that fails it ends the run, NO-GO) -> the
    repository's own tests (pytest gates)
    -> profile (when an amdahl gate) -> bench -> ncu (GPU, when `ncu:`) -> analyse + report
    -> attempt log
The report goes to <results>/reports/<name>/<run-id>/; putting it into this repository's tracked
reports/ is `harness publish`, never a side effect of a run. The whole run holds the run folder's
lock (harness/runlock.py): a second `harness run --resume` of the same run, local or in a Slurm
job, is refused naming the holder.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness import revisions as rev
from harness.errors import BadInput, in_run
from harness.measure.blocks import block_plan, run_blocks
from harness.measure.sides import BenchSettings
from harness.progress import Progress, as_progress
from harness.records import read_jsonl
from harness.results import HARNESS_ROOT, results_root
from harness.runlock import run_lock
from harness.spec import SAFE_NAME, LoadedExperiment
from harness.verify import CANDIDATE_FAILED


class RunError(BadInput):
    """The run cannot proceed as asked (bad resume, missing run, experiment changed, a live job)."""


@dataclass
class RunOptions:
    resume: bool = False
    run_id: str | None = None
    note: str = ""
    reopen: str | None = None
    # the one place the roots live (every phase and engine takes its paths from here); the
    # defaults hold for an experiment in this checkout's experiments/: see `results_root`
    profile_root: Path = field(default_factory=lambda: results_root() / "profile")
    reports_root: Path = field(default_factory=lambda: results_root() / "reports")
    force_cpu: bool = False
    aa: bool = False  # baseline against itself: the noise floor
    bench_only: bool = False  # `harness bench`: the interleaved blocks alone (no oracle, profile or ncu)
    # after a failed Amdahl pre-gate, still measure (blocks, ncu, training) with this logged reason;
    # the verdict stays NO-GO. For a candidate that exists already and whose cost the team wants on record.
    measure_anyway: str | None = None


def invoked_command() -> str:
    """This process's command line as a user would type it again: `python -m harness ...` reads
    as `harness ...` (argv[0] is then .../harness/__main__.py), an entry point by its name."""
    prog = Path(sys.argv[0]).name
    return shlex.join(["harness" if prog == "__main__.py" else prog, *sys.argv[1:]])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + os.urandom(2).hex()


def pick_run_dir(loaded: LoadedExperiment, opts: RunOptions) -> tuple[str, Path, bool]:
    """(run id, run dir, whether it already existed)."""
    exp_dir = opts.profile_root / loaded.exp.name / "runs"
    if opts.run_id is not None and not SAFE_NAME.match(opts.run_id):
        raise RunError(f"--run-id {opts.run_id!r}: a run id is a name, not a path "
                       f"(it must match {SAFE_NAME.pattern})")
    if opts.run_id:
        run_dir = exp_dir / opts.run_id
        if opts.resume and not run_dir.exists():
            raise RunError(f"--resume --run-id {opts.run_id}: no such run under {exp_dir}")
        return opts.run_id, run_dir, run_dir.exists()
    if opts.resume:
        runs = sorted(p for p in exp_dir.glob("*") if (p / "run.json").exists()) if exp_dir.exists() else []
        if not runs:
            raise RunError(f"--resume: no earlier run of {loaded.exp.name!r} under {exp_dir}")
        return runs[-1].name, runs[-1], True
    run_id = new_run_id()
    return run_id, exp_dir / run_id, False


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e  # a failed write names no file: say which
    tmp.replace(path)  # atomic: a crash never leaves half a record


def _harness_sha() -> str | None:
    try:
        import git

        return git.Repo(HARNESS_ROOT).head.commit.hexsha
    except Exception:
        return None


def _manifest(loaded, run_id, revisions, settings, plan, cpu_mode, opts) -> dict:
    from harness.device import device_info, versions

    return {
        "run_id": run_id, "experiment": loaded.exp.name, "experiment_file": str(loaded.path),
        "experiment_yaml": loaded.path.read_text(), "cpu_mode": cpu_mode, "aa": opts.aa,
        "device": device_info(), "versions": {**versions(), "harness_sha": _harness_sha()},
        "host": socket.gethostname(), "commands": [invoked_command()],
        "started": _now(), "finished": None, "note": opts.note,
        "revisions": revisions.to_json(), "plan": [{"block": i, "side": s} for i, s in enumerate(plan)],
        "timing": ({"method": settings.timing, "l2_flush": settings.l2_flush,
                    "samples_per_block": settings.samples_per_block, "warmup": settings.warmup,
                    "quantiles": "numpy linear (type 7)"} if settings.measure.engine == "blocks" else
                   {"method": "lockstep rounds: CUDA-graph replay where every worker captures the call, "
                              "eager CUDA events otherwise and beside it" + (" (perf_counter on a CPU)" if cpu_mode else ""),
                    "l2_flush": settings.l2_flush, "calls_per_burst": settings.measure.calls_per_burst,
                    "warmup": settings.warmup, "quantiles": "numpy linear (type 7)"}),
        "dtype": settings.dtype, "settings": settings.to_json(), "slurm": _slurm_env(),
    }


def _slurm_env() -> dict | None:
    if "SLURM_JOB_ID" not in os.environ:
        return None
    keys = ["SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURMD_NODENAME", "SLURM_JOB_PARTITION",
            "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS"]
    return {k.lower(): os.environ.get(k) for k in keys}


def run_experiment(loaded: LoadedExperiment, opts: RunOptions,
                   log: Progress | Callable[[str], None] = print) -> tuple[str, Path, dict]:
    """Run (or resume) the protocol; returns (verdict, report dir, report dict). `log`: a Progress
    (harness/progress.py; the caller closes it), or a plain callable that gets quiet progress lines."""
    progress = as_progress(log)
    try:
        return _run(loaded, opts, progress)
    finally:
        if progress is not log:
            progress.close()


def resume_command(loaded: LoadedExperiment, opts: RunOptions, run_id: str) -> str:
    """The command that continues this run where it stopped."""
    argv = ["harness", "bench" if opts.bench_only else "run", str(loaded.path), "--resume", "--run-id", run_id]
    root = results_root(loaded.path)  # where this experiment's runs go by default
    for flag, value, default in (("--profile-root", opts.profile_root, root / "profile"),
                                 ("--reports-root", opts.reports_root, root / "reports")):
        if Path(value).resolve() != default.resolve():
            argv += [flag, str(value)]
    return shlex.join(argv + (["--cpu"] if opts.force_cpu else []))


def _refuse_live_slurm_job(run_dir: Path) -> None:
    """A run submitted to Slurm is its job's while the job is queued or running (the job takes the
    run lock only once it starts)."""
    from harness.executors import slurm

    job = slurm.live_job_elsewhere(run_dir)
    if job is not None:
        raise RunError(f"run {run_dir.name} belongs to Slurm job {job['job_ref']} ({job['state']}); wait for it "
                       f"or `harness cancel {run_dir}` first")


def _run(loaded: LoadedExperiment, opts: RunOptions, log: Progress) -> tuple[str, Path, dict]:
    log.phase("resolve")
    run_id, run_dir, existed = pick_run_dir(loaded, opts)
    if existed:
        _refuse_live_slurm_job(run_dir)
    with run_lock(run_dir, command=invoked_command()) as lock, \
            in_run(run_dir, resume_command(loaded, opts, run_id)):
        if lock.took_over:
            log(f"took over the lock of a holder that died: {lock.took_over}")
        return _run_locked(loaded, opts, log, run_id, run_dir, existed)


def device_change(started: dict | None, now: dict) -> str | None:
    """How the machine resuming a GPU run differs from the one that started it, or None. A pool
    that lends H100s and H200s alike can hand a resumed run the other card: its rounds would then
    mix two cards' timings in one interval."""
    if not isinstance(started, dict) or started.get("kind") != "cuda":
        return None  # an older manifest without the card: nothing to hold it to
    if now.get("kind") != "cuda":
        return f"started on {started.get('name')}; this machine has no GPU"
    if now.get("name") != started.get("name") or now.get("sm_count") != started.get("sm_count"):
        return (f"started on {started.get('name')} ({started.get('sm_count')} SMs); this machine has "
                f"{now.get('name')} ({now.get('sm_count')} SMs)")
    return None


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunError(f"{path} is damaged ({e}); this run cannot be resumed: start a new run") from e
    missing = [k for k in ("experiment_yaml", "revisions", "cpu_mode", "plan", "commands") if k not in manifest] \
        if isinstance(manifest, dict) else ["all fields (not a JSON object)"]
    if missing:
        raise RunError(f"{path} lacks {', '.join(missing)} (damaged); this run cannot be resumed: start a new run")
    return manifest


def _run_locked(loaded: LoadedExperiment, opts: RunOptions, log: Progress, run_id: str, run_dir: Path,
                existed: bool) -> tuple[str, Path, dict]:
    from harness.device import cuda_available

    exp = loaded.exp
    cpu_mode = opts.force_cpu or not cuda_available()
    manifest_path = run_dir / "run.json"

    if existed and manifest_path.exists():
        manifest = _read_manifest(manifest_path)
        if manifest.get("experiment_yaml") != loaded.path.read_text():
            raise RunError(f"{loaded.path} changed since run {run_id} started; resume needs the same experiment "
                           "(start a new run instead)")
        if not manifest["cpu_mode"]:
            from harness.device import device_info

            changed = device_change(manifest.get("device"), device_info())
            if changed:
                raise RunError(f"run {run_id} {changed}: one run's rounds and its ncu passes come from one card "
                               f"model; resume it on such a card, or start a new run (another --run-id)")
        revisions = rev.Revisions.from_json(manifest["revisions"])
        rev.check_unmoved(revisions)
        rev.ensure_worktrees(revisions)
        cpu_mode = manifest["cpu_mode"]
        settings = replace(BenchSettings.for_machine(loaded, cpu_mode), aa=manifest.get("aa", False))
        plan = [p["side"] for p in manifest["plan"]]
        manifest["commands"].append(invoked_command())
        damage: list = []
        records = read_jsonl(run_dir / "samples.jsonl", damage)
        log(f"resuming run {run_id} ({len(records)} records so far)")
        for d in damage:
            log(f"warning: {d} (not read as data)")
    else:
        revisions = rev.resolve(loaded, opts.profile_root)
        if opts.aa:
            revisions = rev.Revisions(repo=revisions.repo, baseline=revisions.baseline, candidate=rev.ResolvedSide(
                **{**revisions.baseline.__dict__, "side": "candidate"}))
        settings = replace(BenchSettings.for_machine(loaded, cpu_mode), aa=opts.aa)
        plan = block_plan(settings.blocks_per_side, exp.order, exp.seed) if settings.measure.engine == "blocks" else []
        manifest = _manifest(loaded, run_id, revisions, settings, plan, cpu_mode, opts)
        log(f"run {run_id}: baseline {revisions.baseline.sha[:12]} vs candidate {revisions.candidate.sha[:12]}"
            f" ({revisions.candidate.ref}){' [CPU smoke test: Triton interpreter, fp32]' if cpu_mode else ''}")
    _write_json(manifest_path, manifest)

    terminal = None if opts.bench_only else _oracle_phases(loaded, revisions, run_dir, opts, cpu_mode, log)
    # a candidate that failed verification, or a failed Amdahl pre-gate, may still be measured
    # anyway; a red or terminal baseline never is (there is nothing to compare against)
    may_measure_anyway = terminal is not None and terminal.startswith(CANDIDATE_FAILED)
    if terminal is None and not opts.bench_only:
        _pytest_phase(loaded, revisions, run_dir, opts, cpu_mode, log)
        terminal = _profile_phase(loaded, revisions, run_dir, opts, cpu_mode, log)
        may_measure_anyway = terminal is not None
        _agreement_phase(loaded, revisions, run_dir, opts, cpu_mode, log)
    measure = terminal is None
    if may_measure_anyway and (opts.measure_anyway or manifest.get("measure_anyway")):
        # the NO-GO stands; the blocks only put the candidate's real cost on record
        manifest.setdefault("measure_anyway", {"reason": opts.measure_anyway, "terminal": terminal, "at": _now()})
        _write_json(manifest_path, manifest)
        log(f"measuring anyway ({manifest['measure_anyway']['reason']}); the verdict stays NO-GO: {terminal}")
        measure = True
    elif terminal is not None:
        log(f"not measured: {terminal}")
    if measure:
        log.phase("bench")
        if settings.measure.engine == "lockstep":
            from harness.measure.driver import run_measurement

            run_measurement(loaded, revisions, run_dir, settings, opts.profile_root, log=log)
        else:
            run_blocks(loaded, revisions, run_dir, settings, opts.profile_root, plan, log=log)
        if not opts.bench_only:
            _ncu_phase(loaded, revisions, run_dir, opts, cpu_mode, log)

    manifest["finished"] = _now()
    _write_json(manifest_path, manifest)
    return _report_phase(loaded, run_dir, opts, terminal, log)


def _oracle_phases(loaded, revisions, run_dir, opts, cpu_mode, log) -> str | None:
    """Freeze the oracle (once per experiment) and verify both sides against it."""
    if loaded.exp.fixtures is None:
        return None
    from harness import attempts, fixtures, verify

    log.phase("verify")
    state = attempts.experiment_state(opts.profile_root, loaded.exp)
    if state.get("state") == "TERMINAL_NO_GO":
        log(f"experiment is terminally NO-GO: {state.get('reason')}")
        return f"terminal NO-GO: {state.get('reason')}"
    if not (run_dir / "verify.json").exists():
        # a CPU run (--cpu on a GPU machine too) freezes and checks the CPU oracle, at its stand-in dims
        record = fixtures.freeze(loaded, revisions, opts.profile_root, log=log, device="cpu" if cpu_mode else None)
        if record.terminal:
            return f"red baseline: {record.reason}"
        verify.verify_run(loaded, revisions, record, run_dir, cpu_mode=cpu_mode, log=log)
    # read back from the record, so a resumed run stops where the first one did
    return verify.candidate_terminal(json.loads((run_dir / "verify.json").read_text()))


def _pytest_phase(loaded, revisions, run_dir, opts, cpu_mode, log) -> None:
    """The repository's own test files (pytest gates), frozen at BENCH_BASE, on both sides: a
    failing test fails its gate, not the run."""
    from harness.spec import PytestGate

    if not any(isinstance(g, PytestGate) for g in loaded.exp.gates) or (run_dir / "pytest.json").exists():
        return
    from harness import fixtures, pytest_gate

    log.phase("pytest")
    record = fixtures.load_freeze(opts.profile_root, loaded.exp.name) if loaded.exp.fixtures is not None else None
    pytest_gate.pytest_run(loaded, revisions, run_dir, opts.profile_root, cpu_mode, log=log,
                           freeze_record=record if record is not None and not record.terminal else None)


def _profile_phase(loaded, revisions, run_dir, opts, cpu_mode, log) -> str | None:
    """Stage attribution of the baseline; a failed Amdahl pre-gate stops the run (terminal NO-GO)."""
    if loaded.exp.profile is None:
        return None
    from harness import profile

    log.phase("profile")
    path = run_dir / "profile.json"
    record = json.loads(path.read_text()) if path.exists() else \
        profile.profile_run(loaded, revisions, run_dir, opts.profile_root, cpu_mode=cpu_mode, log=log)
    return profile.pregate_terminal(record, cpu_mode)


def _agreement_phase(loaded, revisions, run_dir, opts, cpu_mode, log) -> None:
    """Both sides on the same inputs (an agreement gate): a disagreement fails its gate, not the run."""
    from harness.spec import AgreementGate

    if not any(isinstance(g, AgreementGate) for g in loaded.exp.gates) or (run_dir / "agreement.json").exists():
        return
    from harness import agreement

    log.phase("agreement")
    agreement.agreement_run(loaded, revisions, run_dir, opts.profile_root, cpu_mode=cpu_mode, log=log)


def _ncu_phase(loaded, revisions, run_dir, opts, cpu_mode, log) -> None:
    if cpu_mode or loaded.exp.ncu is None or (run_dir / "ncu.json").exists():
        return
    from harness import ncu

    log.phase("ncu")
    ncu.ncu_run(loaded, revisions, run_dir, opts.profile_root, log=log)


def _report_phase(loaded, run_dir, opts, terminal, log) -> tuple[str, Path, dict]:
    """Analyse, cap the verdict by the attempt budget, publish the report, log the attempt."""
    from harness import analyse, attempts, report

    log.phase("report")
    # A/A runs and bench-only runs measure, but are no attempt at the candidate
    aa = json.loads((run_dir / "run.json").read_text()).get("aa", False) or opts.bench_only
    data = analyse.build_report(loaded, run_dir, terminal=terminal)
    if not aa:
        # A STOPPED experiment still measures, but cannot publish GO without a logged --reopen.
        if opts.reopen:
            attempts.reopen(opts.profile_root, loaded.exp.name, opts.reopen, run_id=run_dir.name,
                            max_attempts=loaded.exp.max_attempts)
        state = attempts.attempt_state(opts.profile_root, loaded.exp)
        capped, reason = attempts.cap_verdict(state, data["verdict"])
        if capped != data["verdict"]:
            terminal = reason
            data = analyse.build_report(loaded, run_dir, terminal=terminal)
        attempts.log_run(opts.profile_root, loaded.exp, data, run_dir, note=opts.note)
        # the published report's attempt history includes the run it reports
        data = analyse.with_attempt_history(data, loaded, run_dir)
    out_dir = opts.reports_root / loaded.exp.name / run_dir.name
    analyse.write_report(data, out_dir)
    report.render_index(opts.reports_root)
    log(f"verdict: {data['verdict']}  report: {out_dir / 'index.html'}")
    return data["verdict"], out_dir, data
