"""One running job per run directory: ``RunLock`` on ``<run_dir>/.lock``.

The lock is a POSIX record lock (``fcntl.lockf``) held by rank 0 for the run's life. The kernel
(or, over NFS, the lock manager, with which Linux also implements ``flock``) drops it when the
holder's process dies however it dies, so a killed, requeued or restarted job never finds its
own stale lock. A record lock, not ``flock``: it is not inherited by forked children, so a
helper process cannot keep a dead trainer's lock, and NFS and Lustre (with ``-o flock``) apply
it across nodes. On a file system without locks (Lustre's ``noflock``, ``localflock`` across
nodes) the holder's record in the file is judged instead: the same host and a live pid, or the
same SLURM job (a requeued job keeps its id), or a job ``squeue`` still lists.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from megatron_dgpo.runtime.errors import InputError

LOCK_FILE = ".lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def holder_record() -> dict:
    """Who this process is, as written into the lock file."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def describe(record: dict) -> str:
    job = f", SLURM job {record['slurm_job_id']}" if record.get("slurm_job_id") else ""
    return f"host {record.get('host')}, pid {record.get('pid')}{job}, since {record.get('since')}"


class RunLock:
    """Held from ``acquire`` until ``release`` or the process's death."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``InputError`` naming the job that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise self._refusal() from None
            if exc.errno not in _NO_LOCKS:
                raise
            holder = self._read()  # no locks on this file system: judge the record
            if holder and _alive(holder):
                raise self._refusal() from None
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder_record()) + "\n").encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Give the lock up (the file stays: removing it would let two jobs lock two files)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _refusal(self) -> InputError:
        holder = self._read()
        who = describe(holder) if holder else "another process"
        return InputError(f"{self.path.parent} is in use by a running job ({who}): wait for it to "
                          f"end, stop it, or use another run_dir")


def _alive(holder: dict) -> bool:
    """Whether the job in a lock file's record may still run (no kernel lock to ask)."""
    job = holder.get("slurm_job_id")
    if job and job == os.environ.get("SLURM_JOB_ID"):
        return False  # this very job, requeued or restarted: its earlier attempt is over
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except (ProcessLookupError, KeyError, ValueError, TypeError):
            return False
        except PermissionError:
            return True
        return True
    if job and shutil.which("squeue"):
        listed = subprocess.run(["squeue", "-h", "-j", str(job)], capture_output=True, text=True)
        return listed.returncode == 0 and bool(listed.stdout.strip())
    return True  # another host, nothing to ask: refuse, naming it
