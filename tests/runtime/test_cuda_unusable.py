"""A GPU node where torch cannot start CUDA is refused with torch's reason
(``gpu_flags.require_usable_cuda``), by the trainer (``parallel.init_distributed``) and by
``benchmarks/gpu_check.py``, instead of running on the CPU path. The GPU node is stood in by a
folder of device files and probe functions; this machine itself (no /dev/nvidia*) passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dgpo.runtime import gpu_flags
from megatron_dgpo.runtime.gpu_flags import cpu_requested, nvidia_device_files, require_usable_cuda

ROOT = Path(__file__).resolve().parents[2]
# torch's message on a CUDA 13 wheel with an R535 driver (torch/csrc/cuda/Module.cpp's wording)
OLD_DRIVER = ("The NVIDIA driver on your system is too old (found version 12020). Please update "
              "your GPU driver by downloading and installing a new version from the URL: "
              "http://www.nvidia.com/Download/index.aspx Alternatively, go to: "
              "https://pytorch.org to install a PyTorch version that has been compiled with "
              "your version of the CUDA driver.")


def _gpu_node(tmp_path, names=("nvidia0", "nvidiactl", "nvidia-uvm")) -> str:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in names:
        (dev / name).touch()
    return str(dev)


def _old_driver():
    raise RuntimeError(OLD_DRIVER)


def _never(*_):
    raise AssertionError("a probe that must not run here ran")


def test_device_files_are_the_numbered_gpus_only(tmp_path):
    dev = _gpu_node(tmp_path, ("nvidia10", "nvidia2", "nvidia0", "nvidiactl", "nvidia-uvm",
                               "nvidia-caps", "nvidia-modeset", "nvidia1x"))
    assert nvidia_device_files(dev) == ["nvidia0", "nvidia2", "nvidia10"]
    assert nvidia_device_files(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("value, cpu", [("", True), (" ", True), ("-1", True), ("-1,0", True),
                                        ("0", False), ("1,0", False), ("GPU-5d1c", False),
                                        (None, False)])
def test_an_empty_cuda_visible_devices_is_the_request_for_the_cpu(value, cpu):
    assert cpu_requested({} if value is None else {"CUDA_VISIBLE_DEVICES": value}) is cpu


def test_old_driver_on_a_gpu_node_fails_with_torchs_message_and_the_way_out(tmp_path):
    with pytest.raises(RuntimeError) as caught:
        require_usable_cuda(dev=_gpu_node(tmp_path), environ={}, cuda_available=lambda: False,
                            cuda_init=_old_driver, cuda_build=lambda: "13.0")
    message = str(caught.value)
    assert "GPU node" in message and "/nvidia0" in message and "nvidiactl" not in message
    assert "found version 12020" in message and "RuntimeError: The NVIDIA driver" in message
    assert "built for CUDA 13.0" in message and "R580" in message
    assert gpu_flags.CUDA_DRIVER_HELP in message
    assert "CUDA_VISIBLE_DEVICES= (empty)" in message


def test_cpu_build_of_torch_on_a_gpu_node_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="a CPU build of torch is installed") as caught:
        require_usable_cuda(dev=_gpu_node(tmp_path), environ={}, cuda_available=lambda: False,
                            cuda_init=_never, cuda_build=lambda: None)
    assert "CUDA_VISIBLE_DEVICES=" in str(caught.value)


def test_no_error_from_cuda_init_still_fails(tmp_path):
    with pytest.raises(RuntimeError, match="is_available.. is False although CUDA initialised"):
        require_usable_cuda(dev=_gpu_node(tmp_path), environ={}, cuda_available=lambda: False,
                            cuda_init=lambda: None, cuda_build=lambda: "13.0")


def test_usable_cuda_cpu_request_and_cpu_machine_pass_without_probing(tmp_path):
    dev = _gpu_node(tmp_path)
    # CUDA works: nothing initialised, nothing raised
    require_usable_cuda(dev=dev, environ={}, cuda_available=lambda: True, cuda_init=_never,
                        cuda_build=_never)
    # the GPUs hidden on purpose: not even is_available is asked
    require_usable_cuda(dev=dev, environ={"CUDA_VISIBLE_DEVICES": ""}, cuda_available=_never,
                        cuda_init=_never, cuda_build=_never)
    # no device files: a CPU machine, whatever CUDA_VISIBLE_DEVICES says
    require_usable_cuda(dev=str(tmp_path / "empty"), environ={"CUDA_VISIBLE_DEVICES": "0"},
                        cuda_available=_never, cuda_init=_never, cuda_build=_never)


def test_this_cpu_machine_passes_with_the_real_probes():
    if nvidia_device_files():
        pytest.skip("this machine has NVIDIA device files")
    require_usable_cuda()


def test_init_distributed_checks_before_anything_else(monkeypatch):
    """The trainer's (and SFT's, and the engines') first call refuses the node before the
    process group or the CUDA device is touched."""
    import torch.distributed as dist

    from megatron_dgpo.runtime import parallel

    def refuse():
        raise RuntimeError("unusable CUDA (stand-in)")

    monkeypatch.setattr(parallel, "require_usable_cuda", refuse)
    monkeypatch.setattr(dist, "is_initialized", _never)
    with pytest.raises(RuntimeError, match="stand-in"):
        parallel.init_distributed(timeout_minutes=-1)  # an invalid value is not even looked at


def test_gpu_check_fails_loudly_instead_of_skipping(tmp_path, monkeypatch, capsys):
    """gpu_check.py on a stand-in GPU node whose CUDA does not start: exit 1 with torch's
    reason, not the "skipped: no CUDA device" line and exit 0 of a CPU machine."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    dev, real = _gpu_node(tmp_path), gpu_flags.require_usable_cuda
    monkeypatch.setattr(gpu_flags, "require_usable_cuda", lambda: real(
        dev=dev, environ={}, cuda_available=lambda: False, cuda_init=_old_driver,
        cuda_build=lambda: "13.0"))
    assert gpu_check.main(["--out", str(tmp_path / "results")]) == 1
    out, err = capsys.readouterr()
    assert gpu_check.SKIP_LINE not in out
    assert "found version 12020" in err and "GPU node" in err
    assert not (tmp_path / "results").exists()


def test_the_error_points_at_a_section_that_exists():
    path, title = gpu_flags.CUDA_DRIVER_HELP.split(", ", 1)
    text = (ROOT / path).read_text()
    assert f"### {title.strip(chr(39))}\n" in text
    # the section says what the message promises: the driver floor, the compat package, the
    # way to run on the CPU on purpose
    section = text.split(f"### {title.strip(chr(39))}\n", 1)[1].split("\n### ", 1)[0]
    assert all(s in section for s in ("R580", "cuda-compat-13-0", "CUDA_VISIBLE_DEVICES=",
                                      "benchmarks/gpu_check.py"))
