"""harness/runlock.py: one writer per run folder. Holders are real processes; the refusal names
them; a holder killed with SIGKILL leaves a lock the next process takes over."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.runlock import LOCK_FILE, RunLocked, holder_of, run_lock
from test_children import cleanup, resume_run, sleepy_repo, start_harness, wait_for_child

ROOT = Path(__file__).resolve().parent.parent
HOLD = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from harness.runlock import run_lock
    with run_lock(Path(sys.argv[1]), command="harness run exp.yaml --resume --run-id r1"):
        print("locked", flush=True)
        time.sleep(float(sys.argv[2]))
    """)


def hold(run_dir: Path, seconds: float = 60, env: dict | None = None) -> subprocess.Popen:
    """A real process holding the lock of run_dir (it prints 'locked' once it does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), str(seconds)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_holder_is_refused_naming_host_pid_and_command(tmp_path):
    proc = hold(tmp_path)
    try:
        with pytest.raises(RunLocked) as e:
            with run_lock(tmp_path, command="second"):
                pass
        msg = str(e.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in msg
        assert "running `harness run exp.yaml --resume --run-id r1`" in msg
        assert holder_of(tmp_path)["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_holder_inside_a_slurm_job_is_named_by_its_job_id(tmp_path):
    proc = hold(tmp_path, env={"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "", "SLURM_ARRAY_TASK_ID": ""})
    try:
        with pytest.raises(RunLocked, match=r"in Slurm job 4242 "):
            with run_lock(tmp_path):
                pass
    finally:
        proc.kill()
        proc.wait()


def test_dead_holders_lock_is_taken_over(tmp_path):
    proc = hold(tmp_path)
    proc.send_signal(signal.SIGKILL)  # no cleanup: the lock file and its record stay behind
    proc.wait()
    assert (tmp_path / LOCK_FILE).exists() and holder_of(tmp_path) is None
    with run_lock(tmp_path, command="resume") as lock:
        assert lock.took_over["pid"] == proc.pid
        assert holder_of(tmp_path)["command"] == "resume" and holder_of(tmp_path)["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists() and holder_of(tmp_path) is None


def test_released_lock_is_free_again_in_the_same_process(tmp_path):
    with run_lock(tmp_path) as first:
        assert first.took_over is None
    with run_lock(tmp_path) as second:
        assert second.took_over is None


def test_many_contenders_at_once_exactly_one_holds_at_a_time(tmp_path):
    """Eight processes each try 30 times to take the lock, and while holding it append
    'in'/'out' to a shared file: no two holders ever overlap."""
    script = textwrap.dedent("""\
        import sys, time, os
        from pathlib import Path
        from harness.runlock import RunLocked, run_lock
        run_dir, log = Path(sys.argv[1]), Path(sys.argv[2])
        won = 0
        for _ in range(30):
            try:
                with run_lock(run_dir):
                    with open(log, "a") as f: f.write(f"in {os.getpid()}\\n")
                    time.sleep(0.002)
                    with open(log, "a") as f: f.write(f"out {os.getpid()}\\n")
                    won += 1
            except RunLocked:
                pass
        print(won)
        """)
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "run"), str(log)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(8)]
    wins = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert sum(wins) > 0
    lines = log.read_text().split()
    events = list(zip(lines[0::2], lines[1::2]))
    assert len(events) == 2 * sum(wins)
    for (kind_in, pid_in), (kind_out, pid_out) in zip(events[0::2], events[1::2]):
        assert (kind_in, kind_out) == ("in", "out") and pid_in == pid_out


def test_cli_run_refuses_a_run_folder_held_by_another_process(temp_repo):
    exp = temp_repo.experiment("held", "main", "- {kind: speedup, name: e, row: small, mode: fwd, threshold: 1.2}\n")
    run_dir = temp_repo.root / "profile" / "held" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    proc = hold(run_dir)
    try:
        t0 = time.monotonic()
        res = resume_run(temp_repo, exp, timeout=120)
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"run folder {run_dir} is in use by pid {proc.pid} on {socket.gethostname()}" in res.stderr
        assert "Traceback" not in res.stderr and time.monotonic() - t0 < 60
        assert not (run_dir / "run.json").exists()  # refused before it wrote anything
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_two_harness_runs_of_one_run_at_once_the_second_is_refused_naming_the_first(temp_repo):
    repo = sleepy_repo(temp_repo)
    exp = repo.experiment("twice", "main", "- {kind: speedup, name: e, row: small, mode: fwd, threshold: 1.2}\n",
                          blocks=3, samples=2, engine="blocks")  # its block_start records name each worker's pid
    first = start_harness(repo, exp)  # run r1, its op asleep in block 0
    try:
        wait_for_child(first, "harness.measure.blocks_worker")
        second = resume_run(repo, exp, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is in use by pid {first.pid} on {socket.gethostname()} running `harness run {exp} --run-id r1 " \
               in second.stderr
        samples = repo.root / "profile" / "twice" / "runs" / "r1" / "samples.jsonl"
        starts = [json.loads(line) for line in samples.read_text().splitlines() if '"block_start"' in line]
        assert [(s["block"], s["pid"] != first.pid) for s in starts] == [(0, True)]  # one worker, the first run's
    finally:
        cleanup(first)
