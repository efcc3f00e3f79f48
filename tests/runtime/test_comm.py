"""megatron_dgpo.runtime.comm is the only place that calls torch.distributed collectives, and it puts
their tensors where the backend needs them (CUDA for NCCL), with no device tensor inside an
object that crosses ranks."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dgpo.runtime import comm

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_dgpo"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
               "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
               "barrier", "all_to_all", "all_to_all_single", "monitored_barrier"}


def direct_collectives(source: str) -> list[str]:
    """``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` calls in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.append(f"line {node.lineno}: {owner}.{node.func.attr}")
    return found


def test_no_collective_outside_the_comm_module(tmp_path):
    offenders = {str(p.relative_to(PACKAGE)): calls for p in sorted(PACKAGE.rglob("*.py"))
                 if p.name != "comm.py" and (calls := direct_collectives(p.read_text()))}
    assert not offenders, offenders
    # the check sees a planted one
    planted = "import torch.distributed as dist\n\ndef f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n"
    assert direct_collectives(planted) == ["line 4: dist.all_reduce", "line 5: torch.distributed.barrier"]


def test_nccl_reductions_run_on_the_cuda_device_and_come_back_to_the_host(monkeypatch):
    """With the backend reported as NCCL, the device is the current CUDA device, host statistics
    are moved there before the all-reduce and the result comes back on the CPU; a model tensor
    on the wrong device is refused before NCCL sees it."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.device_of() == torch.device("cuda", 3)

    # CPU torch cannot allocate on CUDA: stand in with the meta device to see where the
    # reduction runs
    seen = []
    monkeypatch.setattr(comm, "device_of", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append((t.device.type, op)))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t: torch.zeros(t.shape, dtype=t.dtype))
    out = comm.reduce_values([1.0, 2.0], "max")
    assert seen == [("meta", dist.ReduceOp.MAX)] and out.device.type == "cpu" and out.dtype == torch.float64

    with pytest.raises(RuntimeError, match="nccl collective needs tensors on meta, got one on cpu"):
        comm.all_reduce_(torch.zeros(2))


def test_objects_cross_ranks_without_device_tensors(monkeypatch):
    """host_pickle moves every tensor inside any container to the CPU before pickling (a meta
    tensor stands in for a CUDA one: its ``.cpu()`` is recorded), and the rest pickles as is."""
    moved = []
    real_cpu = torch.Tensor.cpu

    def cpu(t):
        moved.append(t.device.type)
        return torch.zeros(t.shape) if t.device.type == "meta" else real_cpu(t)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    obj = {"sums": {"a": torch.empty(2, device="meta")}, "rows": [(1, torch.empty(3, device="meta"))],
           "tokens": [[1, 2, 3]], "kept": torch.ones(2)}
    back = pickle.loads(comm.host_pickle(obj))
    assert moved == ["meta", "meta"]  # the device tensors only; CPU ones pickle as they are
    assert back["sums"]["a"].device.type == back["rows"][0][1].device.type == "cpu"
    # exact: a pickle round trip
    assert back["tokens"] == [[1, 2, 3]] and back["kept"].tolist() == [1.0, 1.0]
