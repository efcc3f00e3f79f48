"""benchmarks/gpu_check.py on a machine without CUDA: one line saying it skipped, exit 0,
nothing written (the GPU checks themselves run only on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--out", str(tmp_path / "results")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu_check: skipped: no CUDA device (the GPU checks need one)"]
    assert not (tmp_path / "results").exists()


def test_every_check_is_its_own_function():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    names = [name for name, _ in gpu_check.CHECKS]
    assert len(set(names)) == len(names) == 7
    assert len({fn for _, fn in gpu_check.CHECKS}) == len(names)
    assert all(name in fn.__name__ for name, fn in gpu_check.CHECKS)
