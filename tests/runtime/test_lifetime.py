"""Children die with the process that started them, SIGKILL included (``runtime.lifetime``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
PARENT = """
import json, multiprocessing as mp, os, signal, sys, threading, time
from megatron_dgpo.runtime.lifetime import children_die_with_this_process

def nap():
    time.sleep(600)

if __name__ == "__main__":
    if sys.argv[1] == "on":
        children_die_with_this_process()
    spawned, forked = mp.get_context("spawn").Process(target=nap), mp.get_context("fork").Process(target=nap)
    spawned.start(), forked.start()
    queue = mp.get_context("spawn").Manager().Queue()  # a manager process, the resource tracker
    import psutil
    print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_spawned_forked_and_manager_children_die_with_a_killed_parent(tmp_path, mode):
    """SIGKILL to a parent with a spawned child, a forked child, a manager process and the
    resource tracker: with ``children_die_with_this_process`` none lives 10 s later; without
    it (the control) they all do."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    out = tmp_path / "out.txt"
    with open(out, "w") as handle:  # a file, not a pipe: orphans would hold a pipe open
        proc = subprocess.run([sys.executable, str(script), mode], cwd=ROOT, stdout=handle,
                              env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120)
    assert proc.returncode == -9
    children = json.loads(out.read_text().strip().splitlines()[-1])
    assert len(children) >= 4, children  # spawned, forked, manager, resource tracker
    deadline = time.monotonic() + (10 if mode == "on" else 1)  # the control: alive at 1 s
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _alive(children)
    for pid in left:
        psutil.Process(pid).kill()
    assert left == [] if mode == "on" else sorted(left) == sorted(children)
