"""Child processes that never outlive the harness, and signals that stop it as cleanly as an error.

Every worker the harness starts (block, oracle, profile, agreement, warm, ncu) goes through
`start` / `run` here:
- it runs in its own process group, and that whole group (the worker and anything it started,
  e.g. the program under ncu) is killed whenever the harness stops waiting for it: on return, on
  an exception, on a timeout, on SIGTERM/SIGINT/SIGHUP, and at interpreter exit;
- a worker that imports `harness` asks the kernel to kill it when its parent dies
  (PR_SET_PDEATHSIG, see `die_with_parent`), so even a SIGKILL of the harness leaves no worker
  measuring behind it.
`install_signal_handlers` turns SIGTERM and SIGHUP (and SIGINT) into a `Stopped` exception in the
main thread, after killing every live worker group: the run unwinds through its `finally` blocks,
its run-folder lock is released, and `harness run --resume` continues from the last complete block.

Start workers from the main thread, or from a thread that outlives them: the kernel ties
PR_SET_PDEATHSIG to the thread that forked the child. Standard library only.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading

PARENT_ENV = "HARNESS_PARENT_PID"  # set for a child by `start`; read (and removed) by `die_with_parent`
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_live: dict[int, subprocess.Popen] = {}  # pid -> a started child whose group may still have processes
_live_lock = threading.RLock()  # re-entrant: the signal handler may interrupt a holder in the main thread
# The stop signal received, kept after the handler raised: a Stopped raised while a finaliser runs
# (GitPython's Repo.__del__ during a garbage collection, say) is printed and dropped by Python, so
# the run would go on with its workers killed; `raise_if_stopped` raises it again at the next step.
_stop_signal: int | None = None


class Stopped(BaseException):
    """The harness got a stop signal. A BaseException (like KeyboardInterrupt): `except Exception`
    blocks that record a failed row or block and go on do not swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (the child and everything it started), then reap the child."""
    _kill(proc)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # a process stuck in the kernel (D state): nothing more to do
        pass
    with _live_lock:
        _live.pop(proc.pid, None)


def kill_all(reap: bool = True) -> None:
    """Kill every live child group (at interpreter exit; without reaping in a signal handler, which
    may have interrupted a wait on one of them: the code that started it reaps it)."""
    with _live_lock:
        procs = list(_live.values())
    for proc in procs:
        kill_group(proc) if reap else _kill(proc)


def start(argv: list[str], env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen in a process group of its own, registered so that it is killed with us."""
    raise_if_stopped()  # no new worker after a stop signal, even one whose Stopped was swallowed
    env = dict(os.environ if env is None else env)
    env[PARENT_ENV] = str(os.getpid())
    proc = subprocess.Popen(argv, env=env, process_group=0, **popen_kwargs)
    with _live_lock:
        _live[proc.pid] = proc
    if _stop_signal is not None:
        # a stop that came while another thread was between the check above and the registration:
        # the handler's kill_all may have missed this child (the handler sets _stop_signal first)
        kill_group(proc)
        raise Stopped(_stop_signal)
    return proc


def run(argv: list[str], *, timeout: float | None = None, input: bytes | str | None = None,
        capture_output: bool = False, **popen_kwargs) -> subprocess.CompletedProcess:
    """Like subprocess.run (raises subprocess.TimeoutExpired after `timeout` s), but the child's whole
    process group is killed on every way out, and a stop signal kills it at once."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    proc = start(argv, **popen_kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    finally:
        kill_group(proc)  # after a normal exit: whatever the child left running in its group
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def stop_signal() -> int | None:
    """The stop signal this process got since `install_signal_handlers`, or None."""
    return _stop_signal


def raise_if_stopped() -> None:
    """Raise `Stopped` again if a stop signal came, whatever became of the first one."""
    if _stop_signal is not None:
        raise Stopped(_stop_signal)


def _on_stop_signal(signum, frame):
    global _stop_signal
    _stop_signal = signum
    kill_all(reap=False)  # first: threads waiting on workers see them end, and nothing measures on without us
    raise Stopped(signum)


def install_signal_handlers() -> dict:
    """Route SIGTERM, SIGINT and SIGHUP to `Stopped` (main thread only); returns the previous
    handlers for `restore_signal_handlers`. Elsewhere (a thread) it does nothing."""
    global _stop_signal
    if threading.current_thread() is not threading.main_thread():
        return {}
    _stop_signal = None
    return {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}


def restore_signal_handlers(previous: dict) -> None:
    global _stop_signal
    _stop_signal = None
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def die_with_parent() -> None:
    """In a child started by `start`: have the kernel SIGKILL this process when the harness dies, also
    by SIGKILL (Linux PR_SET_PDEATHSIG). A process that is not the harness's direct child (the
    program ncu starts) only forgets the variable: the group kill covers it."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent or not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    parent_pid = int(parent)
    if os.getppid() != parent_pid:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(128 + signal.SIGKILL)  # the harness died before we got here
        except PermissionError:
            pass
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died between the check and the prctl
        os._exit(128 + signal.SIGKILL)


atexit.register(kill_all)
