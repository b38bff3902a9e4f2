"""One writer per run folder: an exclusive lock that every command writing into a run folder holds.

    with run_lock(run_dir, command="harness run ...") as lock:   # raises RunLocked naming the holder
        ...                                                        # lock.took_over: a dead holder's record

The lock is a kernel file lock (flock) on `<run_dir>/run.lock`, which holds a JSON record of its
holder {host, pid, slurm_job_id, command, since}. The kernel drops a flock when its holder dies,
however it dies (SIGKILL, OOM, a node crash seen by an NFS server), so a stale lock needs no guess:
a lock file that is there but not locked is a dead holder's, and is taken over (its record is
returned as `took_over`). A live holder's record is put in the refusal. Released cleanly, the file
is removed while still locked; a contender that opened the removed file sees that it is no longer
the path's file and tries again, so two contenders can never both win.

Workers never inherit the lock (Python opens files non-inheritable), so a worker cannot hold it
after the harness is gone; harness/children.py makes sure no worker outlives the harness.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from harness.errors import BadInput

LOCK_FILE = "run.lock"


class RunLocked(BadInput):
    """Another live process holds the run folder; the message names it."""

    def __init__(self, run_dir: Path, holder: dict | None):
        self.run_dir, self.holder = Path(run_dir), holder or {}
        super().__init__(f"run folder {self.run_dir} is in use by {describe_holder(self.holder)}; "
                         "wait for it to finish or stop it (a dead holder's lock is taken over by itself)")


@dataclass
class Lock:
    path: Path
    holder: dict  # this process's record
    took_over: dict | None  # the record a dead holder left behind, when there was one


def describe_holder(holder: dict) -> str:
    if not holder:
        return "another process (its record is not written yet)"
    job = f" in Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    cmd = f" running `{holder['command']}`" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}{cmd} since {holder.get('since')}"


def _slurm_job() -> str | None:
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def _read_record(fd: int) -> dict | None:
    """The holder record in the lock file; None for an empty file (a fresh lock)."""
    try:
        data = os.pread(fd, 65536, 0)
        if not data.strip():
            return None
        rec = json.loads(data.decode())
    except (OSError, ValueError):
        return {"unreadable": True}
    return rec if isinstance(rec, dict) else {"unreadable": True}


def _unsupported(e: OSError) -> bool:
    return e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _acquire(path: Path) -> tuple[int, dict | None]:
    """The locked fd of `path` and the record found in it; raises BlockingIOError when held."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd, _read_record(fd)
        os.close(fd)  # the holder released (removed) this file between our open and our lock: again


def holder_of(run_dir: Path) -> dict | None:
    """The record of the live holder of `run_dir`, or None when nobody holds it."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_record(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextmanager
def run_lock(run_dir: Path, command: str | None = None) -> Iterator[Lock]:
    """Hold `run_dir` exclusively for the block; RunLocked (exit 2) when a live process holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    for _ in range(5):
        try:
            fd, found = _acquire(path)
            break
        except BlockingIOError:
            holder = holder_of(run_dir)
            if holder is not None:
                raise RunLocked(run_dir, holder) from None
            # released meanwhile, or only peeked at by `holder_of` elsewhere: try again
        except OSError as e:
            if _unsupported(e):
                raise BadInput(f"cannot lock {path}: the filesystem does not support file locks ({e.strerror}); "
                               "put the run folders on one that does (--profile-root)") from e
            raise
    else:
        raise RunLocked(run_dir, None)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": _slurm_job(),
              "command": command, "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder, sort_keys=True) + "\n").encode(), 0)
        os.fsync(fd)
        yield Lock(path=path, holder=holder, took_over=found)
    finally:
        try:
            os.unlink(path)  # while still locked: see the module docstring
        except OSError:
            pass
        os.close(fd)


def run_lock_if(run_dir: Path | None, command: str | None = None):
    """`run_lock(run_dir)` for a command that writes into a run folder only when given one
    (`harness freeze/verify --run-dir`); a no-op context otherwise."""
    from contextlib import nullcontext

    return nullcontext() if run_dir is None else run_lock(run_dir, command)
