"""Unit tests of the Slurm executor without a cluster: the rendered sbatch script for given
parameters, refusal of unsafe values (in the renderer and through the CLI, exit 2 naming the
argument), and the job-state parsing/mapping (job-completion log fallback)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.cli import main
from harness.executors import slurm as S

UNSAFE = ["$(rm -rf /)", "`id`", "gpu;reboot", "gpu\nreboot", "gpu\n", "a b", "x>y", "a'b"]
GATE = "- {kind: speedup, name: endpoint, row: small, mode: fwd, threshold: 1.25}\n"


def task(tmp_path: Path, i: int = 0, **kw) -> S.Task:
    base = dict(name=f"exp{i}", experiment_file=tmp_path / f"experiments/exp{i}.yaml", workdir=tmp_path,
                run_id=f"20260101T000000Z-000{i}", run_dir=tmp_path / f"profile/exp{i}/runs/20260101T000000Z-000{i}",
                baseline_ref="0123456789abcdef", candidate_ref="feature/fast-path")
    base.update(kw)
    return S.Task(**base)


def render(tmp_path: Path, params: S.JobParams | None = None, tasks=None, python="/usr/bin/python3", **kw) -> str:
    return S.render(S.template_path("comparison", tmp_path), params=params or S.JobParams(),
                    tasks=tasks or [task(tmp_path)], python=python, profile_root=tmp_path / "profile",
                    reports_root=tmp_path / "reports", **kw)


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_render_full_parameters(tmp_path):
    params = S.JobParams(partition="gpu-h200", account="perf.team", constraint="h200&nvlink|a100", qos="high",
                         gpus=1, time="1-02:30:00", mem="64G", exclusive=True)
    script = render(tmp_path, params)
    lines = sbatch_lines(script)
    assert "#SBATCH --partition=gpu-h200" in lines
    assert "#SBATCH --account=perf.team" in lines
    assert "#SBATCH --constraint='h200&nvlink|a100'" in lines  # quoted: & and | are shell operators
    assert "#SBATCH --qos=high" in lines
    assert "#SBATCH --gres=gpu:1" in lines
    assert "#SBATCH --time=1-02:30:00" in lines
    assert "#SBATCH --mem=64G" in lines
    assert "#SBATCH --exclusive" in lines
    assert "#SBATCH --job-name=harness-exp0" in lines
    assert not any("--array" in line for line in lines)
    assert f"RUN_DIR={tmp_path}/profile/exp0/runs/20260101T000000Z-0000" in script
    assert 'run "$EXP_FILE" --resume --run-id "$RUN_ID"' in script
    assert "slurm-env --run-dir" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_render_defaults_omit_unset_resources(tmp_path):
    lines = sbatch_lines(render(tmp_path, S.JobParams(gpus=0)))
    assert not any(opt in line for line in lines for opt in ("--partition", "--account", "--constraint", "--gres",
                                                             "--exclusive", "--qos", "--mem"))
    assert "#SBATCH --time=01:00:00" in lines


def test_render_array_one_case_per_experiment(tmp_path):
    script = render(tmp_path, tasks=[task(tmp_path, 0), task(tmp_path, 1)])
    assert "#SBATCH --array=0-1" in sbatch_lines(script)
    assert "  0)\n    EXP_NAME=exp0" in script and "  1)\n    EXP_NAME=exp1" in script
    assert script.count("RUN_ID=20260101T000000Z-000") == 2
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_rendered_script_selects_task_and_quotes_paths(tmp_path):
    """Run the case-selection prologue of the script in bash (no Slurm): index 1 picks experiment 1."""
    script = render(tmp_path, tasks=[task(tmp_path, 0), task(tmp_path, 1, candidate_ref="topic/a.b-c")])
    prologue = script.split('cd "$WORKDIR"')[0] + 'echo "$EXP_NAME|$RUN_ID|$HARNESS_CANDIDATE_REF"\n'
    out = subprocess.run(["bash", "-c", prologue], env={"SLURM_ARRAY_TASK_ID": "1", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert out.stdout.strip() == "exp1|20260101T000000Z-0001|topic/a.b-c"
    bad = subprocess.run(["bash", "-c", prologue], env={"SLURM_ARRAY_TASK_ID": "7", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no experiment for array index 7" in bad.stderr


@pytest.mark.parametrize("field,arg", [("partition", "--partition"), ("account", "--account"),
                                       ("constraint", "--constraint"), ("qos", "--qos")])
@pytest.mark.parametrize("value", UNSAFE)
def test_unsafe_resource_values_refused(tmp_path, field, arg, value):
    with pytest.raises(S.SlurmError) as e:
        render(tmp_path, S.JobParams(**{field: value}))
    assert arg in str(e.value)


@pytest.mark.parametrize("field,label", [("name", "experiment name"), ("candidate_ref", "candidate.ref"),
                                         ("baseline_ref", "baseline.ref"), ("run_id", "run id")])
@pytest.mark.parametrize("value", UNSAFE + ["../../etc", "-rf"])
def test_unsafe_names_and_refs_refused(tmp_path, field, label, value):
    with pytest.raises(S.SlurmError) as e:
        render(tmp_path, tasks=[task(tmp_path, **{field: value})])
    assert label in str(e.value)


def test_unsafe_paths_refused(tmp_path):
    with pytest.raises(S.SlurmError, match="python"):
        render(tmp_path, python="/usr/bin/python3;id")
    with pytest.raises(S.SlurmError, match="--profile-root"):
        S.render(S.template_path("comparison", tmp_path), params=S.JobParams(), tasks=[task(tmp_path)],
                 python="/usr/bin/python3", profile_root=tmp_path / "$(id)", reports_root=tmp_path)
    with pytest.raises(S.SlurmError, match="--template"):
        S.template_path("../../etc/passwd", tmp_path)


@pytest.mark.parametrize("value", ["60", "30:00", "01:00:00", "2-00", "2-12:00", "1-02:30:00", "UNLIMITED"])
def test_time_formats_accepted(tmp_path, value):
    assert f"#SBATCH --time={value}" in sbatch_lines(render(tmp_path, S.JobParams(time=value)))


@pytest.mark.parametrize("value", ["1h", "01:00:00;id", "1:2:3:4", "", "-1", "01:00:00\n", "$(date)"])
def test_bad_time_refused(tmp_path, value):
    with pytest.raises(S.SlurmError, match="--time"):
        render(tmp_path, S.JobParams(time=value))


@pytest.mark.parametrize("gpus", [-1, 65, True, "1"])
def test_bad_gpus_refused(tmp_path, gpus):
    with pytest.raises(S.SlurmError, match="--gpus"):
        render(tmp_path, S.JobParams(gpus=gpus))


def test_template_must_quote_every_value(tmp_path):
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "raw.sbatch.j2").write_text("#!/bin/bash\necho {{ tasks[0].name }}\n")
    (tmp_path / "slurm" / "ok.sbatch.j2").write_text("#!/bin/bash\necho {{ tasks[0].name | q }} {{ params.gpus }}\n")
    common = dict(params=S.JobParams(), tasks=[task(tmp_path)], python="/usr/bin/python3",
                  profile_root=tmp_path / "profile", reports_root=tmp_path / "reports")
    with pytest.raises(S.SlurmError, match="without the `q` filter"):
        S.render(S.template_path("raw", tmp_path), **common)
    assert S.render(S.template_path("ok", tmp_path), **common) == "#!/bin/bash\necho exp0 1\n"


# --- through the CLI (exit 2, naming the argument) ----------------------------------------------

@pytest.fixture
def exp_repo(temp_repo):
    temp_repo.branch("slow", work=12)
    path = temp_repo.experiment("cli-exp", "slow", GATE, extra="slurm: {gpus: 0, time: '10:00', partition: debug}\n")
    return temp_repo, path


def submit(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["submit", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def roots(repo) -> list[str]:
    return ["--profile-root", str(repo.root / "profile"), "--reports-root", str(repo.root / "reports")]


@pytest.mark.parametrize("opt", ["--partition", "--account", "--constraint", "--qos", "--time", "--mem"])
@pytest.mark.parametrize("value", ["$(rm -rf /)", "`id`", "x;id", "x\nid"])
def test_cli_refuses_unsafe_option(exp_repo, capsys, opt, value):
    repo, path = exp_repo
    rc, _, err = submit(capsys, path, *roots(repo), opt, value, "--dry-run")
    assert rc == 2
    assert err.startswith("error: ") and opt in err
    assert not (repo.root / "profile").exists()  # refused before any run directory or script


def test_cli_refuses_unsafe_experiment_argument(exp_repo, capsys):
    repo, path = exp_repo
    rc, _, err = submit(capsys, f"{path};id", *roots(repo), "--dry-run")
    assert rc == 2 and "EXP" in err
    rc, _, err = submit(capsys, path, *roots(repo), "--resume", "$(id)")
    assert rc == 2 and "--resume" in err


@pytest.mark.parametrize("key,value,named", [("name", "'$(rm -rf /)'", "name"), ("name", "'a;b'", "name"),
                                             ("candidate", "{ref: '`id`'}", "candidate.ref"),
                                             ("candidate", "{ref: 'x;id'}", "candidate.ref"),
                                             ("candidate", '{ref: "a\\nb"}', "candidate.ref")])
def test_cli_refuses_unsafe_name_or_ref_in_yaml(exp_repo, capsys, key, value, named):
    repo, path = exp_repo
    lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line for line in path.read_text().splitlines()]
    if key == "candidate":  # `candidate:\n  ref: slow` -> one flow mapping
        i = lines.index(f"{key}: {value}")
        del lines[i + 1]
    path.write_text("\n".join(lines) + "\n")
    rc, _, err = submit(capsys, path, *roots(repo), "--dry-run")
    assert rc == 2 and named in err, err


@pytest.mark.parametrize("field,value", [("partition", "'gpu;id'"), ("account", "'$(id)'"), ("constraint", "'a`id`'"),
                                         ("time", "'1h'")])
def test_cli_refuses_unsafe_slurm_section(exp_repo, capsys, field, value):
    repo, path = exp_repo
    text = path.read_text().replace("slurm: {gpus: 0, time: '10:00', partition: debug}",
                                    f"slurm: {{gpus: 0, {field}: {value}}}")
    path.write_text(text)
    rc, _, err = submit(capsys, path, *roots(repo), "--dry-run")
    assert rc == 2 and f"slurm.{field}" in err and str(path) in err, err


def test_cli_dry_run_keeps_script_and_applies_overrides(exp_repo, capsys):
    repo, path = exp_repo
    rc, out, err = submit(capsys, path, *roots(repo), "--dry-run", "--time", "5", "--gpus", "1", "--exclusive")
    assert rc == 0, err
    [kept] = list((repo.root / "profile" / "cli-exp" / "runs").glob("*/job.sbatch"))
    assert kept.read_text() == out
    lines = sbatch_lines(out)
    assert "#SBATCH --partition=debug" in lines  # from the YAML
    assert "#SBATCH --time=5" in lines and "#SBATCH --gres=gpu:1" in lines and "#SBATCH --exclusive" in lines
    assert not (kept.parent / "slurm.json").exists()  # not submitted


def test_cli_array_needs_one_set_of_resources(temp_repo, capsys):
    temp_repo.branch("slow", work=12)
    a = temp_repo.experiment("exp-a", "slow", GATE, extra="slurm: {gpus: 0, time: '10'}\n")
    b = temp_repo.experiment("exp-b", "slow", GATE, extra="slurm: {gpus: 0, time: '20'}\n")
    rc, _, err = submit(capsys, a, b, *roots(temp_repo), "--dry-run")
    assert rc == 2 and "--time" in err
    rc, out, err = submit(capsys, a, b, *roots(temp_repo), "--dry-run", "--time", "30")
    assert rc == 0, err
    assert "#SBATCH --array=0-1" in sbatch_lines(out)


def test_cli_roots_must_be_inside_repository(exp_repo, capsys, tmp_path_factory):
    repo, path = exp_repo
    outside = tmp_path_factory.mktemp("elsewhere")
    rc, _, err = submit(capsys, path, "--profile-root", outside, "--reports-root", repo.root / "reports", "--dry-run")
    assert rc == 2 and "--profile-root" in err and "outside" in err


# --- job states --------------------------------------------------------------------------------

@pytest.mark.parametrize("word,run_state", [("PENDING", "queued"), ("RUNNING", "running"), ("COMPLETED", "done"),
                                            ("FAILED", "failed"), ("TIMEOUT", "timeout"), ("CANCELLED by 0", "cancelled"),
                                            ("PREEMPTED", "preempted"), ("NODE_FAIL", "node_fail"),
                                            ("OUT_OF_MEMORY", "out_of_memory"), ("WEIRD", "unknown")])
def test_state_mapping(word, run_state):
    st = S._state(word)
    assert st.run_state == run_state
    assert st.final == (run_state not in ("queued", "running", "unknown"))


def test_jobcomp_fallback_parses_key_value_lines(tmp_path, monkeypatch):
    log = tmp_path / "jobcomp.txt"
    log.write_text(
        "JobId=4 UserId=root(0) GroupId=root(0) Name=harness-a JobState=FAILED Partition=debug TimeLimit=10 "
        "NodeList=vm NodeCnt=1 ProcCnt=1 WorkDir=/x ExitCode=3:0 DerivedExitCode=0:0 JobName=harness-a\n"
        "JobId=7 UserId=root(0) JobState=CANCELLED NodeList=vm ExitCode=0:15 ArrayJobId=6 ArrayTaskId=1 JobName=harness-b\n"
        "JobId=9 UserId=root(0) JobState=TIMEOUT NodeList=vm ExitCode=0:0 JobName=harness-c\n")
    monkeypatch.setattr(S, "slurm_config", lambda: {"JobCompType": "jobcomp/filetxt", "JobCompLoc": str(log)})
    missing = lambda *a, **k: None  # noqa: E731  (squeue/scontrol/sacct forgot the job)
    for name in ("_from_squeue", "_from_scontrol", "_from_sacct"):
        monkeypatch.setattr(S, name, missing)
    st = S.query_state({"job_id": "4", "job_ref": "4", "job_name": "harness-a"})
    assert (st.state, st.run_state, st.exit_code, st.source) == ("FAILED", "failed", 3, "jobcomp")
    st = S.query_state({"job_id": "6", "job_ref": "6_1", "array_job_id": "6", "array_index": 1, "job_name": "harness-b"})
    assert (st.state, st.run_state, st.signal) == ("CANCELLED", "cancelled", 15)
    st = S.query_state({"job_id": "9", "job_ref": "9", "job_name": "someone-else"})
    assert st.state == "UNKNOWN" and "not ours" in st.reason
    st = S.query_state({"job_id": "99", "job_ref": "99", "last_state": {"state": "TIMEOUT", "run_state": "timeout"}})
    assert (st.state, st.source) == ("TIMEOUT", "cached")


@pytest.mark.parametrize("harness_rc, job_rc", [(0, 0), (1, 0), (3, 0), (2, 2), (4, 4), (143, 143)])
def test_rendered_job_succeeds_on_a_verdict_and_fails_on_bad_input_a_harness_error_or_a_signal(
        tmp_path, harness_rc, job_rc):
    """The real template run by bash, with a stand-in interpreter that exits `harness run` with the
    given code: the job's own exit code is what Slurm judges it by (0 COMPLETED, else FAILED)."""
    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/bash\n[ "$3" = run ] && exit "$HARNESS_RC"\nexit 0\n')
    stand_in.chmod(0o755)
    t = task(tmp_path)
    t.run_dir.mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render(tmp_path, tasks=[t], python=str(stand_in)))
    env = {"PATH": "/usr/bin:/bin", "HARNESS_RC": str(harness_rc)}
    assert subprocess.run(["bash", str(script)], env=env, timeout=60).returncode == job_rc
    assert f"harness: run exited {harness_rc}" in (t.run_dir / "slurm-local.out").read_text()
