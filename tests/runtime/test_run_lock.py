"""One job per run directory: a live holder refuses a second trainer, naming itself; a killed
holder's lock never blocks its successor."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.runtime.run_lock import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from megatron_dgpo.runtime.run_lock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")


def _holder(run_dir: Path, **env) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_refuses_a_second_trainer_and_a_killed_one_does_not(tmp_path):
    holder = _holder(tmp_path, SLURM_JOB_ID="4242")
    try:
        with pytest.raises(InputError, match=rf"{tmp_path} is in use by a running job \(host "
                                             rf"{socket.gethostname()}, pid {holder.pid}, "
                                             rf"SLURM job 4242, since .*\): wait for it"):
            RunLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(tmp_path)  # the kernel dropped the dead holder's lock
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    RunLock(tmp_path).acquire()  # released: taken again


def test_without_file_locks_the_holders_record_is_judged(tmp_path, monkeypatch):
    """A file system without locks (Lustre's noflock): a record of a dead pid on this host, or
    of this very SLURM job (requeued), is stale; a live pid here, or an unknown job on another
    host, refuses."""
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    path = tmp_path / LOCK_FILE
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    cases = [({"host": socket.gethostname(), "pid": int(dead)}, True),
             ({"host": "elsewhere", "pid": 1, "slurm_job_id": "7"}, True),
             ({"host": socket.gethostname(), "pid": os.getppid()}, False),
             ({"host": "elsewhere", "pid": 1, "slurm_job_id": "8"}, False)]
    for record, stale in cases:
        path.write_text(json.dumps(record))
        if stale:
            RunLock(tmp_path).acquire()
            assert json.loads(path.read_text())["pid"] == os.getpid()
        else:
            with pytest.raises(InputError, match="is in use by a running job"):
                RunLock(tmp_path).acquire()
