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
    assert len(set(names)) == len(names) == 9
    assert len({fn for _, fn in gpu_check.CHECKS}) == len(names)
    # a function per check, or the tiny-run function bound to its layout's name
    assert all(name in getattr(fn, "__name__", "") or fn.args == (name,) for name, fn in gpu_check.CHECKS)


def test_tiny_gpu_layouts_run_under_torchrun_at_tp2_and_dp2():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    one = gpu_check.tiny_gpu_command(*gpu_check.TINY_GPU_LAYOUTS["tiny_gpu_run"], "r")
    assert one[:3] == [sys.executable, "-m", "megatron_dgpo.train"]
    for name, parallel in (("tiny_gpu_tp2", ["parallel.tensor_parallel=2"]), ("tiny_gpu_dp2", [])):
        cmd = gpu_check.tiny_gpu_command(*gpu_check.TINY_GPU_LAYOUTS[name], "r")
        assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
        assert cmd[cmd.index("-m", 2):][:2] == ["-m", "megatron_dgpo.train"]
        assert [a for a in cmd if a.startswith("parallel.")] == parallel
    # with fewer GPUs than a layout needs, the row says so instead of failing
    row = gpu_check.check_tiny_gpu("tiny_gpu_tp2")
    assert row.ok is None and "needs 2" in row.result
