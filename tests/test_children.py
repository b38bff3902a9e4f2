"""harness/children.py: SIGTERM/SIGINT to the harness stop every worker it started (block, oracle,
profile, agreement, ncu) and leave a resumable run; a SIGKILLed harness takes its worker with it.

The op of these repositories sleeps while TEST_OP_SLEEP is set (the harness passes its environment
on to its workers), so each phase's worker is caught mid-call; the processes are real and found in
/proc by their parent pid."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.records import completed_blocks
from harness.runlock import LOCK_FILE, holder_of

ROOT = Path(__file__).resolve().parent.parent
SLEEPY_OP = """\
import os
import time

import torch


def op(x, w):
    if os.environ.get("TEST_OP_SLEEP"):
        time.sleep(float(os.environ["TEST_OP_SLEEP"]))
    return torch.tanh(x @ w)
"""
SPEEDUP = "- {kind: speedup, name: endpoint, row: small, mode: fwd, threshold: 1.25}\n"
PHASES = {
    # phase: (the worker's module, gates, extra experiment sections, measurement engine)
    "oracle": ("harness.oracle_worker", "- {kind: correctness, name: correct}\n", """\
        fixture_shapes:
          - {name: tiny, B: 1, T: 4, H: 1, K: 8, V: 8}
        fixtures: {reference: "op:op", cases: [tiny], rtol: 1.0e-5, atol: 1.0e-6}
        """, "lockstep"),
    "profile": ("harness.profile_worker", "- {kind: amdahl, name: pre, stage: mm, row: small, min_share: 0.05, "
                "min_bound: 1.0001}\n", """\
        stages:
          mm: {baseline: ['aten::mm'], candidate: ['aten::mm']}
        profile: {rows: [small], iters: 1}
        """, "lockstep"),
    "agreement": ("harness.agreement", "- {kind: agreement, name: same, rows: [small], modes: [fwd], rtol: 1.0e-5, "
                  "atol: 1.0e-6}\n", "", "lockstep"),
    "bench-lockstep": ("harness.measure.worker", SPEEDUP, "", "lockstep"),  # a side worker of the default engine
    "bench-blocks": ("harness.measure.blocks_worker", SPEEDUP, "", "blocks"),  # a block worker of the first engine
}


def sleepy_repo(repo):
    """The temp repository with the sleeping op as its baseline (and main) commit."""
    repo.baseline_sha = repo.commit_op(4, "sleepy op", extra={"op.py": SLEEPY_OP})
    return repo


def start_harness(repo, exp: Path, *extra, sleep: float | None = 600) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_QUIET": "1"}
    env.pop("TEST_OP_SLEEP", None)
    if sleep is not None:
        env["TEST_OP_SLEEP"] = str(sleep)
    return subprocess.Popen([sys.executable, "-m", "harness", "run", str(exp), "--run-id", "r1",
                             "--profile-root", str(repo.root / "profile"), "--reports-root", str(repo.root / "reports"),
                             *extra], cwd=repo.root, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def resume_run(repo, exp: Path, run_id: str = "r1", timeout: float = 600) -> subprocess.CompletedProcess:
    """`harness run EXP --resume --run-id RUN_ID` to its end, the op awake."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TEST_OP_SLEEP", None)
    return subprocess.run([sys.executable, "-m", "harness", "run", str(exp), "--resume", "--run-id", run_id,
                           "--profile-root", str(repo.root / "profile"), "--reports-root", str(repo.root / "reports")],
                          cwd=repo.root, env=env, capture_output=True, text=True, timeout=timeout)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def wait_for_child(proc: subprocess.Popen, needle: str, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in children_of(proc.pid):
            if needle in cmdline(pid):
                return pid
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"harness exited {proc.returncode} before starting {needle}: {out}\n{err}")
        time.sleep(0.1)
    pytest.fail(f"no child running {needle} after {timeout} s")


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped runs nothing)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def cleanup(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigterm_stops_the_phase_worker_and_leaves_a_resumable_run(temp_repo, phase):
    module, gates, extra, engine = PHASES[phase]
    repo = sleepy_repo(temp_repo)
    exp = repo.experiment(f"term-{phase}", "main", gates, extra=textwrap.dedent(extra), blocks=3, samples=2,
                          engine=engine)
    proc = start_harness(repo, exp)
    try:
        worker = wait_for_child(proc, module)
        time.sleep(0.5)  # inside the op's sleep
        proc.send_signal(signal.SIGTERM)  # the harness alone, not its process group
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, out + err
        run_dir = repo.root / "profile" / f"term-{phase}" / "runs" / "r1"
        assert f"harness: stopped by SIGTERM; every worker was stopped; run {run_dir} is resumable: harness run {exp} " \
               "--resume --run-id r1" in err
        assert "Traceback" not in err
        assert gone_within(worker, 5), f"worker {worker} ({module}) outlived the harness"
        assert not (run_dir / LOCK_FILE).exists() and holder_of(run_dir) is None
        assert json.loads((run_dir / "run.json").read_text())["run_id"] == "r1"
    finally:
        cleanup(proc)


def test_sigint_stops_the_side_workers_too(temp_repo):
    repo = sleepy_repo(temp_repo)
    exp = repo.experiment("int", "main", SPEEDUP, blocks=3, samples=2)
    proc = start_harness(repo, exp)
    try:
        worker = wait_for_child(proc, "harness.measure.worker")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGINT and "stopped by SIGINT" in err, out + err
        assert gone_within(worker, 5)
    finally:
        cleanup(proc)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped Stopped, on purpose
def test_a_stop_a_finaliser_swallowed_still_refuses_the_next_worker():
    """Seen in CI: SIGINT landed while GitPython's Repo.__del__ ran; Python printed the Stopped and
    dropped it, and the run went on without its killed workers past the test's 60 s."""
    from harness import children

    previous = children.install_signal_handlers()
    try:
        class Finalised:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the handler runs here, inside __del__, whose exception Python ignores

        Finalised()  # unreferenced at once: __del__ runs now
        assert children.stop_signal() == signal.SIGINT
        with pytest.raises(children.Stopped):
            children.start([sys.executable, "-c", "pass"])
        with pytest.raises(children.Stopped):
            children.raise_if_stopped()
    finally:
        children.restore_signal_handlers(previous)
    assert children.stop_signal() is None
    children.raise_if_stopped()  # nothing pending once the handlers are restored


def test_a_stop_between_the_check_and_the_registration_kills_the_new_child(monkeypatch):
    """A thread (the pytest gate's two sides) can pass start's check just before the stop signal's
    handler runs kill_all in the main thread: the child it then starts must not outlive the stop."""
    from harness import children

    # the race, made certain: the stop arrives after the check, while Popen runs
    real_popen = subprocess.Popen

    def popen_then_stop(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        monkeypatch.setattr(children, "_stop_signal", signal.SIGTERM)
        return proc

    monkeypatch.setattr(children.subprocess, "Popen", popen_then_stop)
    with pytest.raises(children.Stopped):
        children.start([sys.executable, "-c", "import time; time.sleep(60)"])
    with children._live_lock:
        live = list(children._live.values())
    assert all(p.poll() is not None for p in live)  # reaped, not sleeping on


def test_sigterm_mid_bench_then_resume_completes_every_block_once(temp_repo):
    repo = sleepy_repo(temp_repo)
    exp = repo.experiment("term-resume", "main", SPEEDUP, blocks=3, samples=2, engine="blocks")
    samples = repo.root / "profile" / "term-resume" / "runs" / "r1" / "samples.jsonl"
    proc = start_harness(repo, exp, sleep=None)  # measure block 0 and more at full speed
    try:
        deadline = time.monotonic() + 240
        while not [b for b in completed_blocks(samples, []) if b.index >= 1] and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, out + err
    finally:
        cleanup(proc)
    done_before = {b.index: b.attempt for b in completed_blocks(samples)}
    assert done_before and len(done_before) < 6
    res = resume_run(repo, exp)
    assert res.returncode in (0, 1, 3), res.stdout + res.stderr
    done = completed_blocks(samples)
    assert [b.index for b in done] == list(range(6))
    assert all(done_before[b.index] == b.attempt for b in done if b.index in done_before)  # kept, not re-run
    assert all(len(b.samples[("small", "fwd")]) == 2 for b in done)


@pytest.mark.parametrize("engine, module", [("lockstep", "harness.measure.worker"),
                                            ("blocks", "harness.measure.blocks_worker")])
def test_sigkill_of_the_harness_takes_its_worker_with_it(temp_repo, engine, module):
    repo = sleepy_repo(temp_repo)
    exp = repo.experiment(f"killed-parent-{engine}", "main", SPEEDUP, blocks=3, samples=2, engine=engine)
    proc = start_harness(repo, exp)
    try:
        worker = wait_for_child(proc, module)
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)  # no handler runs: the kernel's parent-death signal does it
        proc.wait(timeout=30)
        assert gone_within(worker, 5), "the worker outlived a SIGKILLed harness"
    finally:
        cleanup(proc)


def test_sigterm_stops_ncu_and_the_program_it_profiles(tmp_path):
    """harness.ncu.run_pass under a stand-in ncu that starts its target (here `sleep`) as its own child."""
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/bash\nsleep 600 &\nwait\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    driver = textwrap.dedent(f"""\
        import os, sys
        from pathlib import Path
        from harness import ncu
        from harness.children import Stopped, install_signal_handlers
        install_signal_handlers()
        tmp = Path({str(tmp_path)!r})
        try:
            ncu.run_pass([{str(fake)!r}, "-o", str(tmp / "rep"), "target"], tmp / "ncu.log", dict(os.environ), tmp, 600)
        except Stopped as e:
            sys.exit(e.exit_code)
        """)
    proc = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            start_new_session=True)
    try:
        ncu_pid = wait_for_child(proc, str(fake))
        deadline = time.monotonic() + 30
        while not (target := [p for p in children_of(ncu_pid) if "sleep" in cmdline(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert target, "the stand-in ncu never started its target"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert gone_within(ncu_pid, 5) and gone_within(target[0], 5)
    finally:
        cleanup(proc)
