"""The Slurm executor: the same `harness run` as the local executor, sent to a cluster as a batch job.

One job (or one task of a job array) runs the whole comparison of one experiment inside one
allocation on one GPU (`harness run EXP --resume --run-id ID`, which also writes the report), so
every interleaved block shares the device. Files it owns in the run directory:

  job.sbatch      the rendered script, kept as evidence (earlier ones: job-<jobid>.sbatch)
  slurm.json      {run_id, experiment, experiment_file, job_name, jobs: [submission...]}; a submission is
                  {job_id, array_job_id, array_index, job_ref, script, script_sha256, submit_command,
                   parameters, submitted, last_state}; the last one is the current job
  slurm_env.json  written inside the job at its start (provenance: SLURM_* ids, node, partition,
                  CUDA_VISIBLE_DEVICES, GPU UUIDs, the hash of the script that ran) and at its end
                  (harness exit code); earlier jobs of a resumed run are kept under `previous`
  slurm-<jobid>.out  the job's output

Safety: every value that reaches a script is validated against a strict pattern here and
shell-quoted by the template's `q` filter; the template environment refuses to print any string
that did not go through `q`. Nothing from the YAML is executed as shell.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import jinja2

from harness.errors import BadInput
from harness.spec import SAFE_NAME, LoadedExperiment

HARNESS_ROOT = Path(__file__).resolve().parents[2]

# --- validation ------------------------------------------------------------------------------
# re.fullmatch everywhere: `$` would also match before a trailing newline.
NAME_RE = r"[A-Za-z0-9_.-]+"                  # partition, account, qos
CONSTRAINT_RE = r"[A-Za-z0-9_.,:|&-]+"        # Slurm features with & | , : operators
TIME_RE = (r"(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}"
           r"|UNLIMITED|INFINITE)")           # sbatch --time formats
MEM_RE = r"\d+[KMGT]?"
REF_RE = r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}"
PATH_RE = r"[A-Za-z0-9_./@+=,:-]+"            # absolute paths that reach the script
DEPENDENCY_RE = r"(?:after|afterany|afterok|afternotok|aftercorr|singleton)(?::\d+(?:_\d+)?)*(?:[,?](?:after|afterany|afterok|afternotok|aftercorr|singleton)(?::\d+(?:_\d+)?)*)*"
FINAL_STATES = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
# Slurm job state -> the run's state
RUN_STATE = {
    "PENDING": "queued", "CONFIGURING": "queued", "REQUEUED": "queued", "REQUEUE_HOLD": "queued",
    "REQUEUE_FED": "queued", "RESV_DEL_HOLD": "queued",
    "RUNNING": "running", "COMPLETING": "running", "STAGE_OUT": "running", "SIGNALING": "running",
    "RESIZING": "running", "SUSPENDED": "suspended", "STOPPED": "suspended",
    "COMPLETED": "done", "FAILED": "failed", "TIMEOUT": "timeout", "DEADLINE": "timeout",
    "CANCELLED": "cancelled", "REVOKED": "cancelled", "PREEMPTED": "preempted",
    "NODE_FAIL": "node_fail", "BOOT_FAIL": "node_fail", "OUT_OF_MEMORY": "out_of_memory",
    "SPECIAL_EXIT": "failed",
}
SLURM_TIMEOUT_S = 60  # every call to a Slurm client is bounded


class SlurmError(BadInput):
    """A Slurm command failed or a value is unsafe; the message names the argument."""


def check(arg: str, value: str, pattern: str, what: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise SlurmError(f"{arg}: {value!r} is not a valid {what} (allowed: {pattern}); refused before any script")
    return value


def check_name(arg: str, value: str) -> str:
    return check(arg, value, SAFE_NAME.pattern.strip("^$"), "name")


def check_path(arg: str, value: Path | str, inside: Path | None = None) -> Path:
    p = Path(value)
    check(arg, str(p), PATH_RE, "path (letters, digits and ._/@+=,:- only)")
    p = p.resolve()
    if inside is not None and not p.is_relative_to(inside.resolve()):
        raise SlurmError(f"{arg}: {p} is outside the repository {inside.resolve()}")
    check(arg, str(p), PATH_RE, "path (letters, digits and ._/@+=,:- only)")
    return p


@dataclass(frozen=True)
class JobParams:
    """Resources of the job: the experiment's `slurm:` section, overridden on the command line."""

    template: str = "comparison"
    partition: str | None = None
    account: str | None = None
    constraint: str | None = None
    qos: str | None = None
    gpus: int = 1
    time: str = "01:00:00"
    mem: str | None = None
    exclusive: bool = False
    dependency: str | None = None

    def validated(self, label=lambda name: f"--{name}") -> "JobParams":
        """Check every field; `label` names a field in errors (a CLI option, or `FILE: slurm.x`)."""
        check_name(label("template"), self.template)
        for name, pattern, what in (
            ("partition", NAME_RE, "partition name"),
            ("account", NAME_RE, "account name"),
            ("qos", NAME_RE, "QOS name"),
            ("constraint", CONSTRAINT_RE, "constraint"),
            ("mem", MEM_RE, "memory size (e.g. 16G)"),
            ("dependency", DEPENDENCY_RE, "dependency (e.g. afterok:123)"),
        ):
            if getattr(self, name) is not None:
                check(label(name), getattr(self, name), pattern, what)
        check(label("time"), self.time, TIME_RE, "Slurm time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)")
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or not 0 <= self.gpus <= 64:
            raise SlurmError(f"{label('gpus')}: {self.gpus!r} must be an integer from 0 to 64")
        if not isinstance(self.exclusive, bool):
            raise SlurmError(f"{label('exclusive')}: {self.exclusive!r} must be true or false")
        return self


@dataclass(frozen=True)
class Task:
    """One experiment of a submission: one job, or one index of a job array."""

    name: str
    experiment_file: Path
    workdir: Path  # the repository holding the experiment
    run_id: str
    run_dir: Path
    baseline_ref: str
    candidate_ref: str

    def validated(self) -> "Task":
        check_name("experiment name", self.name)
        check_name("--resume (run id)", self.run_id)
        check("baseline.ref", self.baseline_ref, REF_RE, "git ref")
        check("candidate.ref", self.candidate_ref, REF_RE, "git ref")
        if ".." in self.candidate_ref:
            raise SlurmError(f"candidate.ref: {self.candidate_ref!r} is not a valid git ref")
        check_path("experiment", self.experiment_file)
        check_path("experiment repository", self.workdir)
        check_path("run directory", self.run_dir)
        return self


# --- rendering -------------------------------------------------------------------------------

class Quoted(str):
    """A string that went through shlex.quote (the only kind of string a template may print)."""


def _q(value) -> Quoted:
    if isinstance(value, Quoted):
        return value
    if isinstance(value, bool) or value is None:
        raise SlurmError(f"template: cannot quote {value!r}")
    return Quoted(shlex.quote(str(value)))


def _finalize(value):
    if isinstance(value, Quoted) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise SlurmError(f"template printed {value!r} without the `q` filter; every value must be shell-quoted")


def template_path(name: str, repo: Path) -> Path:
    """`slurm/<name>.sbatch.j2` of the experiment's repository, else of the harness checkout."""
    check_name("--template", name)
    for base in (repo, HARNESS_ROOT):
        base = base.resolve()
        p = (base / "slurm" / f"{name}.sbatch.j2").resolve()
        if p.is_file() and p.is_relative_to(base / "slurm"):
            return p
    raise SlurmError(f"--template: no slurm/{name}.sbatch.j2 in {repo} or {HARNESS_ROOT}")


def render(template: Path, *, params: JobParams, tasks: list[Task], python: str, profile_root: Path,
           reports_root: Path, cpu: bool = False, job_name: str | None = None) -> str:
    """The sbatch script for these tasks (validated again here: callers cannot skip the checks)."""
    params = params.validated()
    tasks = [t.validated() for t in tasks]
    if not tasks:
        raise SlurmError("no experiment to submit")
    check("python", python, PATH_RE, "interpreter path")
    profile_root = check_path("--profile-root", profile_root)
    reports_root = check_path("--reports-root", reports_root)
    job_name = job_name or job_name_for(tasks)
    check("job name", job_name, NAME_RE, "job name")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template.parent)), undefined=jinja2.StrictUndefined,
                             autoescape=False, keep_trailing_newline=True, finalize=_finalize,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = _q
    tpl = env.get_template(template.name)
    return tpl.render(params=params, tasks=tasks, array=len(tasks) > 1, python=python, profile_root=profile_root,
                      reports_root=reports_root, cpu=cpu, job_name=job_name,
                      prologue_out=profile_root / ".slurm" / "slurm-%j.out")


def job_name_for(tasks: list[Task]) -> str:
    return "harness-" + (tasks[0].name if len(tasks) == 1 else f"{tasks[0].name}-and-{len(tasks) - 1}")


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


# --- running Slurm clients (always bounded) --------------------------------------------------

def slurm_cmd(argv: list[str], timeout: float = SLURM_TIMEOUT_S, check_rc: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise SlurmError(f"{argv[0]} not found: is this a Slurm login node? ({e})") from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"{shlex.join(argv)} did not answer within {timeout:.0f} s") from e
    if check_rc and proc.returncode != 0:
        raise SlurmError(f"{shlex.join(argv)} failed (rc {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc


def sbatch(script: Path, cwd: Path, extra: list[str] = ()) -> tuple[list[str], str]:
    """Submit; returns (the command, the job id)."""
    argv = ["sbatch", "--parsable", *extra, str(script)]
    out = slurm_cmd(argv).stdout.strip().splitlines()
    job_id = out[-1].split(";")[0].strip() if out else ""
    if not re.fullmatch(r"\d+", job_id):
        raise SlurmError(f"sbatch printed no job id: {out!r}")
    return argv, job_id


# --- the run directory's Slurm records -------------------------------------------------------

def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def current_job(run_dir: Path) -> dict | None:
    rec = read_json(run_dir / "slurm.json")
    return rec["jobs"][-1] if rec and rec.get("jobs") else None


def live_job_elsewhere(run_dir: Path) -> dict | None:
    """{job_ref, state} of the run's current Slurm job while it is queued, running or suspended, unless
    this process runs inside that very job; None otherwise, or when Slurm cannot be asked (a run
    folder carried off the cluster: the run lock still keeps two writers apart)."""
    job = current_job(run_dir)
    if job is None:
        return None
    inside = {os.environ.get("SLURM_JOB_ID")}
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        inside.add(f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}")
    if job.get("job_ref") in inside or (job.get("job_id") in inside and job.get("array_index") is None):
        return None
    try:
        st = query_state(job)
    except SlurmError:
        return None
    if st.run_state in ("queued", "running", "suspended"):
        return {"job_ref": job["job_ref"], "state": st.state}
    return None


@dataclass
class JobState:
    state: str                    # Slurm's word (COMPLETED, CANCELLED, ...) or UNKNOWN
    run_state: str                # queued | running | done | failed | timeout | cancelled | ... | unknown
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    node: str | None = None
    source: str = "none"          # sacct | squeue | scontrol | jobcomp | cached | none
    job_name: str | None = None

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def to_json(self) -> dict:
        return asdict(self)


def _state(word: str, **kw) -> JobState:
    word = ((word or "").split() or ["UNKNOWN"])[0].rstrip("+").upper()  # sacct: "CANCELLED by 0"
    if kw.get("reason") in ("None", "(null)", ""):
        kw["reason"] = None
    return JobState(state=word, run_state=RUN_STATE.get(word, "unknown"), **kw)


def _exit(value: str | None) -> tuple[int | None, int | None]:
    m = re.fullmatch(r"(\d+):(\d+)", (value or "").strip())
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


_config_cache: dict[str, str] | None = None


def slurm_config() -> dict[str, str]:
    """`scontrol show config` as a dict (cached per process)."""
    global _config_cache
    if _config_cache is None:
        out = slurm_cmd(["scontrol", "show", "config"]).stdout
        _config_cache = {}
        for line in out.splitlines():
            if " = " in line:
                k, v = line.split(" = ", 1)
                _config_cache[k.strip()] = v.strip()
    return _config_cache


def accounting_enabled() -> bool:
    try:
        return "slurmdbd" in slurm_config().get("AccountingStorageType", "")
    except SlurmError:
        return False


def _from_sacct(job_ref: str) -> JobState | None:
    proc = slurm_cmd(["sacct", "-X", "-n", "-P", "-j", job_ref, "-o", "JobID,State,ExitCode,Reason,NodeList,JobName"],
                     check_rc=False)
    if proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) >= 6 and parts[0] == job_ref:
            code, sig = _exit(parts[2])
            return _state(parts[1], exit_code=code, signal=sig, reason=parts[3] or None, node=parts[4] or None,
                          source="sacct", job_name=parts[5])
    return None


def _from_squeue(job_ref: str) -> JobState | None:
    proc = slurm_cmd(["squeue", "-h", "-t", "all", "-j", job_ref, "-o", "%T|%r|%N|%j"], check_rc=False)
    line = proc.stdout.strip().splitlines()[:1]
    if proc.returncode != 0 or not line:
        return None
    state, reason, node, name = (line[0].split("|") + ["", "", "", ""])[:4]
    st = _state(state, reason=reason or None, node=node or None, source="squeue", job_name=name or None)
    if st.final:  # squeue has no exit code: scontrol has, while it still holds the job
        sc = _from_scontrol(job_ref)
        if sc is not None:
            st.exit_code, st.signal = sc.exit_code, sc.signal
    return st


def _from_scontrol(job_ref: str) -> JobState | None:
    proc = slurm_cmd(["scontrol", "-o", "show", "job", job_ref], check_rc=False)
    if proc.returncode != 0 or "JobState=" not in proc.stdout:
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout.splitlines()[0]))
    code, sig = _exit(fields.get("ExitCode"))
    return _state(fields.get("JobState", ""), exit_code=code, signal=sig, reason=fields.get("Reason"),
                  node=fields.get("NodeList") or None, source="scontrol", job_name=fields.get("JobName"))


def _from_jobcomp(job_id: str, array_job_id: str | None, array_index: int | None) -> JobState | None:
    try:
        cfg = slurm_config()
    except SlurmError:
        return None
    if "filetxt" not in cfg.get("JobCompType", "") or not cfg.get("JobCompLoc"):
        return None
    path = Path(cfg["JobCompLoc"])
    if not path.is_file():
        return None
    found = None
    for line in path.read_text(errors="replace").splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if array_index is not None:
            hit = fields.get("ArrayJobId") == array_job_id and fields.get("ArrayTaskId") == str(array_index)
        else:
            hit = fields.get("JobId") == job_id
        if hit:
            found = fields
    if found is None:
        return None
    code, sig = _exit(found.get("ExitCode"))
    return _state(found.get("JobState", ""), exit_code=code, signal=sig, node=found.get("NodeList") or None,
                  source="jobcomp", job_name=found.get("JobName"))


def query_state(job: dict) -> JobState:
    """The state of a submission from slurm.json: sacct (accounting on), squeue / scontrol, then the
    job-completion log; a job id now naming another job (a restarted cluster) reads as UNKNOWN."""
    ref = job["job_ref"]
    sources = []
    if accounting_enabled():
        sources.append(lambda: _from_sacct(ref))
    sources += [lambda: _from_squeue(ref), lambda: _from_scontrol(ref),
                lambda: _from_jobcomp(job["job_id"], job.get("array_job_id"), job.get("array_index"))]
    for source in sources:
        st = source()
        if st is None:
            continue
        if st.job_name and job.get("job_name") and st.job_name != job["job_name"]:
            return JobState("UNKNOWN", "unknown", reason=f"job {ref} is now {st.job_name!r}, not ours", source=st.source)
        return st
    last = job.get("last_state")
    if last and last.get("state") in FINAL_STATES:
        return JobState(**{**last, "source": "cached"})
    return JobState("UNKNOWN", "unknown", reason=f"Slurm no longer knows job {ref}")


def remember_state(run_dir: Path, st: JobState) -> None:
    """Keep the last observed state in slurm.json: Slurm forgets finished jobs (MinJobAge)."""
    rec = read_json(run_dir / "slurm.json")
    if not rec or not rec.get("jobs") or st.source in ("cached", "none"):
        return
    rec["jobs"][-1]["last_state"] = {**st.to_json(), "seen": now()}
    write_json(run_dir / "slurm.json", rec)


# --- provenance inside the job ---------------------------------------------------------------

ENV_KEYS = ["SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NAME", "SLURMD_NODENAME",
            "SLURM_JOB_NODELIST", "SLURM_JOB_PARTITION", "SLURM_JOB_ACCOUNT", "SLURM_JOB_QOS", "SLURM_CLUSTER_NAME",
            "SLURM_SUBMIT_DIR", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES", "SLURM_CPUS_ON_NODE"]


def gpu_uuids() -> list[dict] | None:
    """UUIDs of the GPUs this job sees, via nvidia-smi when present (bounded)."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return None
    argv = ["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd and re.fullmatch(r"[0-9,]+", cvd):
        argv += ["-i", cvd]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    return [{"index": r[0], "uuid": r[1], "name": r[2]} for r in rows if len(r) >= 3]


def record_env(run_dir: Path, script: Path | None) -> dict:
    """At job start: slurm_env.json with this job's provenance (earlier jobs kept under `previous`)."""
    import socket

    path = run_dir / "slurm_env.json"
    old = read_json(path)
    env = {k.lower(): os.environ.get(k) for k in ENV_KEYS}
    rec = {
        **env, "host": socket.gethostname(), "started": now(), "finished": None, "harness_rc": None,
        "gpus": gpu_uuids(), "script": str(script) if script else None,
        "script_sha256": sha256(script.read_bytes()) if script and script.is_file() else None,
    }
    job = current_job(run_dir)
    if job is not None:
        rec["submitted_script_sha256"] = job.get("script_sha256")
        rec["script_matches_submitted"] = rec["script_sha256"] == job.get("script_sha256")
    previous = []
    if old:
        previous = old.pop("previous", [])
        if old.get("slurm_job_id") != rec["slurm_job_id"]:
            previous.append(old)
    rec["previous"] = previous
    write_json(path, rec)
    return rec


def record_finish(run_dir: Path, rc: int) -> None:
    path = run_dir / "slurm_env.json"
    rec = read_json(path) or {}
    rec.update(finished=now(), harness_rc=rc)
    write_json(path, rec)


def manifest_slurm(run_dir: Path) -> dict | None:
    """The `slurm` field of run.json (docs/CONTRACTS.md) from slurm_env.json + slurm.json, or None
    outside a Slurm job."""
    env = read_json(run_dir / "slurm_env.json")
    job = current_job(run_dir)
    if not env or not env.get("slurm_job_id"):
        return None
    return {"job_id": env.get("slurm_array_job_id") or env.get("slurm_job_id"),
            "array_index": int(env["slurm_array_task_id"]) if env.get("slurm_array_task_id") else None,
            "node": env.get("slurmd_nodename"), "partition": env.get("slurm_job_partition"),
            "gpus": (job or {}).get("parameters", {}).get("gpus"), "script_sha256": env.get("script_sha256"),
            "cuda_visible_devices": env.get("cuda_visible_devices"), "gpu_uuids": env.get("gpus")}


# --- submission ------------------------------------------------------------------------------

@dataclass
class Submission:
    job_id: str
    script: str
    tasks: list[Task] = field(default_factory=list)


def submit(tasks: list[Task], params: JobParams, *, profile_root: Path, reports_root: Path, python: str,
           cpu: bool = False, dry_run: bool = False, argv: list[str] | None = None) -> Submission:
    """Render one script for all tasks, keep it in every run dir, sbatch it, record slurm.json."""
    repo = tasks[0].workdir
    tpl = template_path(params.template, repo)
    script = render(tpl, params=params, tasks=tasks, python=python, profile_root=profile_root,
                    reports_root=reports_root, cpu=cpu)
    digest = sha256(script)
    (profile_root / ".slurm").mkdir(parents=True, exist_ok=True)
    for t in tasks:
        t.run_dir.mkdir(parents=True, exist_ok=True)
        prev = current_job(t.run_dir)
        path = t.run_dir / "job.sbatch"
        if path.exists() and prev is not None:
            path.replace(t.run_dir / f"job-{prev['job_ref']}.sbatch")
        path.write_text(script)
    if dry_run:
        return Submission(job_id="", script=script, tasks=tasks)
    extra = [f"--dependency={params.dependency}"] if params.dependency else []
    # Submit the copy in the first run dir; the others are byte-identical (same sha256).
    cmd, job_id = sbatch(tasks[0].run_dir / "job.sbatch", cwd=repo, extra=extra)
    for i, t in enumerate(tasks):
        array = len(tasks) > 1
        entry = {
            "job_id": job_id, "array_job_id": job_id if array else None, "array_index": i if array else None,
            "job_ref": f"{job_id}_{i}" if array else job_id, "script": str(t.run_dir / "job.sbatch"),
            "template": str(tpl), "script_sha256": digest, "submit_command": cmd, "harness_command": argv,
            "parameters": asdict(params), "submitted": now(), "last_state": None,
            "profile_root": str(profile_root), "reports_root": str(reports_root), "cpu": cpu,
        }
        path = t.run_dir / "slurm.json"
        rec = read_json(path) or {"run_id": t.run_id, "experiment": t.name, "experiment_file": str(t.experiment_file),
                                  "job_name": None, "jobs": []}
        rec["job_name"] = job_name_for(tasks)
        entry["job_name"] = rec["job_name"]
        rec["jobs"].append(entry)
        write_json(path, rec)
    return Submission(job_id=job_id, script=script, tasks=tasks)


def task_for(loaded: LoadedExperiment, run_id: str, run_dir: Path) -> Task:
    exp = loaded.exp
    return Task(name=exp.name, experiment_file=loaded.path, workdir=loaded.root, run_id=run_id, run_dir=run_dir,
                baseline_ref=exp.baseline.ref, candidate_ref=exp.candidate.ref).validated()


def params_for(loaded: LoadedExperiment, overrides: dict) -> JobParams:
    s = loaded.exp.slurm
    base = dict(template=s.template, partition=s.partition, account=s.account, constraint=s.constraint,
                gpus=s.gpus, time=s.time, exclusive=s.exclusive)
    JobParams(**base).validated(label=lambda name: f"{loaded.path}: slurm.{name}")
    base.update({k: v for k, v in overrides.items() if v is not None})
    return JobParams(**base).validated()


def interpreter() -> str:
    return sys.executable
