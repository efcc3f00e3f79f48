"""Context parallelism: CP = 2 and TP = 2 (2 ranks), TP = 2 x CP = 2, CP = 2 x DP = 2 and
PP = 2 x CP = 2 (4 ranks) give the CP = 1 run's log-probs, loss, metrics and every gradient, for every loss
aggregation (TIS, left-out samples), ``sequence_mask`` and GSPO (with ``geometric_mask``), whose
sample statistics span both CP ranks' shards, on packed rows whose samples are not multiples of
2 CP long."""

import math

import pytest
import torch

from megatron_dgpo.algorithm.losses import AGGREGATIONS
from megatron_dgpo.algorithm.packing import cp_zigzag_indices
from tests._rank_fns_cp import CASES, LAYOUTS, layouts_fn, reference_fn, rows
from tests.distributed import run_ranks

TOL = 1e-5


def test_zigzag_indices_by_hand_and_as_megatron_rope_reads_them():
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    from megatron_dgpo.runtime.cpu import _cp_positions

    cu = torch.tensor([0, 8, 12], dtype=torch.int32)  # widths 8 and 4 at CP = 2: chunks 2 and 1
    # exact: integer positions, here and below
    assert cp_zigzag_indices(cu, 0, 2).tolist() == [0, 1, 6, 7, 8, 11]
    # exact: integer positions
    assert cp_zigzag_indices(cu, 1, 2).tolist() == [2, 3, 4, 5, 9, 10]
    # exact: integer positions
    assert cp_zigzag_indices(cu, 0, 1).tolist() == list(range(12))
    cu = torch.tensor([0, 16, 24, 48], dtype=torch.int32)
    everything = torch.arange(48)
    for size in (2, 4):
        held = []
        for rank in range(size):
            megatron = torch.cat([_get_thd_freqs_on_this_cp_rank(
                rank, size, everything[:(e - s) // size], everything, s)
                for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
            mine = cp_zigzag_indices(cu, rank, size)
            # exact: integer positions; the CPU attention's mask reads them through Megatron too
            assert mine.tolist() == megatron.tolist() == _cp_positions(cu, rank, size).tolist()
            held.append(mine)
        # exact: integer positions
        assert sorted(torch.cat(held).tolist()) == list(range(48))  # a partition of the row
    with pytest.raises(ValueError, match="pad samples to"):
        cp_zigzag_indices(torch.tensor([0, 6], dtype=torch.int32), 0, 2)


def test_cp_shard_slices_every_per_token_field_and_keeps_the_row_boundaries():
    row = rows("token_mean_drop_tis")[0]
    shard = row.cp_shard(1, 2)
    index = cp_zigzag_indices(row.cu_seqlens, 1, 2)
    # exact: a shard is an index selection of the row's own tensors
    assert torch.equal(shard.targets, row.targets[index])
    # exact: as above
    assert torch.equal(shard.loss_weights, row.loss_weights[index])
    # exact: the global boundaries travel unchanged
    assert torch.equal(shard.cu_seqlens, row.cu_seqlens) and len(shard.tokens) * 2 == len(row.tokens)
    assert row.cp_shard(0, 1) is row
    with pytest.raises(ValueError, match="THD"):
        shard.attention_mask()


@pytest.fixture(scope="module")
def reference():
    return run_ranks(reference_fn, 1)[0]


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _check(result, ref):
    assert {a for a, _, _ in CASES.values()} == set(AGGREGATIONS)
    dp_rank, dp_size = result["dp_rank"], result["dp_size"]
    want = ref["forward"][dp_rank::dp_size]
    assert len(result["forward"]) == len(want)
    for got, exp in zip(result["forward"], want):
        assert got.shape == exp.shape and float((got - exp).abs().max()) < TOL
    for case, got in result["cases"].items():
        exp = ref["cases"][case]
        assert got["num_tokens"] == exp["num_tokens"] > 0
        assert abs(got["loss"] - exp["loss"]) < TOL * max(1.0, abs(exp["loss"])), case
        assert got["summary"].keys() == exp["summary"].keys()
        for key, value in exp["summary"].items():
            if math.isnan(value):  # a region no token reached, at both layouts
                assert math.isnan(got["summary"][key]), (case, key)
                continue
            assert abs(got["summary"][key] - value) < TOL * max(1.0, abs(value)), (case, key)
        assert got["grads"] and got["grads"].keys() <= exp["grads"].keys()  # this stage's
        for name, grad in got["grads"].items():
            assert float(exp["grads"][name].abs().max()) > 0
            assert _rel(grad, exp["grads"][name]) < TOL, (case, name)
    sft = result["sft"]
    assert sft["num_tokens"] == ref["sft"]["num_tokens"]
    assert abs(sft["loss"] - ref["sft"]["loss"]) < TOL
    for name, grad in sft["grads"].items():
        assert _rel(grad, ref["sft"]["grads"][name]) < TOL, name


def test_the_corrections_act_on_some_samples_and_not_all(reference):
    """The CP comparisons below could fail: the masks mask a share of the samples, sequence_tis
    cuts some, GSPO clips some samples and not others, and each changes the gradient."""
    for case in ("sequence_mask", "token_mask_drop"):
        masked = reference["cases"][case]["summary"]
        assert 0 < masked["correction/sample_masked_frac"] < 1, case
        assert 0 < masked["correction/token_masked_frac"] < 1, case
    assert 0 < reference["cases"]["sequence_tis"]["summary"]["correction/clip_frac"] < 1
    gspo = reference["cases"]["gspo_drop_geometric_mask"]["summary"]
    assert 0 < gspo["clip_frac"] < 1 and 0 < gspo["correction/sample_masked_frac"] < 1
    base = reference["cases"]["group_token_mean"]["grads"]
    for case in ("sequence_mask", "gspo_drop_geometric_mask", "sequence_tis", "token_mask_drop"):
        grads = reference["cases"][case]["grads"]
        assert max(float((grads[k] - base[k]).abs().max() / base[k].abs().max())
                   for k in base) > 1e-2, case


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_context_parallel_matches_cp1(reference, world):
    results = run_ranks(layouts_fn, world)
    for layout, *per_rank in zip(LAYOUTS[world], *results):  # every parameter on some rank
        assert set().union(*(r["cases"]["token_mean"]["grads"] for r in per_rank)) \
            == reference["cases"]["token_mean"]["grads"].keys(), layout
    for rank_results in results:
        assert [r["layout"] for r in rank_results] == list(LAYOUTS[world])
        for result in rank_results:
            _check(result, reference)
