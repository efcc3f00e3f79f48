"""Megatron's distributed optimizer on CPU (gloo; ``megatron_dgpo.runtime.cpu`` patches 11-13), as every
GPU recipe runs it: its updates equal the plain optimizer's, and its checkpoints, written in the
background by Megatron's persistent writer, resume bit for bit at the same layout and within
float rounding at another DP size (``dp_reshardable``, Megatron-LM's default) or another TP
size (``fully_reshardable``), or are refused with the reason. Every save of the
distributed optimizer crashed in Megatron's default sharding type, and its resume without apex
or Transformer-Engine failed on Adam's empty per-parameter step."""

from __future__ import annotations

import pytest

from tests import _rank_fns_distopt as fns
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt")
    return root, run_ranks(fns.train_save_and_resume, 2, str(root))


def test_megatron_default_sharding_type_cannot_save(saved):
    _, results = saved
    for result in results:  # why checkpoint.py always names the type
        assert "flattened_range is not supported" in result["default_sharding"]


def test_an_aborted_saver_stops_its_writer(saved):
    _, results = saved
    assert all(result["aborted"] for result in results)


@pytest.mark.parametrize("sharding", fns.SHARDINGS)
def test_updates_equal_the_plain_optimizer_and_a_resume_is_bitwise(saved, sharding):
    _, results = saved
    for result in (r[sharding] for r in results):
        assert result["distributed"] == [False, True]
        assert result["buckets"] > 1  # overlapped reduction over several buckets
        assert result["writer_started"]  # before the first save
        for plain, distributed in result["norms"]:  # the norm sums shards in another order
            assert abs(plain - distributed) <= 1e-6 * plain
        assert result["vs_plain"] < 1e-5
        assert result["resumed_equal"]


def test_resume_at_another_tensor_parallel_size(saved):
    """TP 1 x DP 2 -> TP 2 x DP 1: fully_reshardable resumes; dp_reshardable is refused with the
    field to change."""
    root, _ = saved
    for result in run_ranks(fns.resume_at_another_layout, 2, str(root), 2):
        full = result["fully_reshardable"]
        assert full["refused"] is None and full["diff"] < 1e-5 < full["moved"]
        refused = result["dp_reshardable"]["refused"]
        assert "saved as 'dp_reshardable'" in refused and "tensor_parallel 1 -> 2" in refused
        assert "checkpoint.optimizer_sharding=fully_reshardable" in refused


def test_resume_at_another_data_parallel_size(saved):
    """TP 1 x DP 2 -> TP 1 x DP 1: both formats reshard over data parallelism."""
    root, _ = saved
    (result,) = run_ranks(fns.resume_at_another_layout, 1, str(root), 1)
    for sharding in fns.SHARDINGS:
        assert result[sharding]["refused"] is None
        assert result[sharding]["diff"] < 1e-5 < result[sharding]["moved"]


def test_resume_across_context_parallel_sizes(tmp_path):
    """CP 2 x DP 1 -> CP 1 x DP 2 and back, both sharding types (the optimizer shards over DP x
    CP, the same 2 ranks): weights and each rank's optimizer shard come back exactly, and the
    next step equals the run that never stopped; CP 2 -> one rank: the weights exactly, the next
    step within rounding."""
    results = run_ranks(fns.resume_across_context_parallel, 2, str(tmp_path))
    for result in results:
        assert len(result) == 2 * len(fns.SHARDINGS)
        for name, got in result.items():
            saved_cp, loaded_cp = (int(part[2:]) for part in name.split("_")[-3::2])
            assert got["layout"]["context_parallel"] == loaded_cp, name
            assert got["layout"]["data_parallel"] == 2 // loaded_cp, name
            assert got["params_equal"] and got["state_equal"] and got["moments"] > 0, name
            assert got["next_step_equal"], name
    # CP 2 -> one rank: the optimizer's two shards become one
    (one,) = run_ranks(fns.resume_on_one_rank, 1, str(tmp_path))
    for sharding, got in one.items():
        assert got["params_equal"], sharding
        assert got["next_step_diff"] < 1e-6 < got["moved"], sharding
