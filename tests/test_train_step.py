"""train_step: loss, every gradient and every metric independent of TP, PP, DP, micro-batches."""

import math

import pytest
import torch

from megatron_dgpo.packing import MicroBatch, padded_micro_batch
from tests._rank_fns_train import LAYOUTS, compare, reference_fn, split_fn
from tests.distributed import run_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return run_ranks(reference_fn, 1)[0]


def test_single_rank_reference_is_sane(reference):
    for tied, ref in reference.items():
        assert ref["num_tokens"] == sum(n - p for n, p in zip((9, 24, 13, 17, 20, 11, 15, 22),
                                                              (4, 6, 3, 5, 7, 4, 6, 5)))
        assert ref["pad_ok"]
        # loss value and temperature-scaled log-probs/entropy vs float64 references
        assert abs(ref["loss"] - ref["loss64"]) <= TOL * max(1.0, abs(ref["loss64"]))
        assert ref["temp_logp_err"] < 1e-5 and ref["temp_ent_err"] < 1e-5
        # the mini-batch reaches several DGPO regions, so F and ratio metrics are exercised
        summary = ref["summary"]
        assert sum(summary[f"region/{r}_frac"] > 0 for r in ("LN", "HP", "LP", "HN", "M")) >= 3
        assert math.isfinite(summary["entropy"]) and summary["entropy"] > 5.0
        assert ("output_layer.weight" in ref["grads"]) == (not tied)
        assert all(float(g.abs().max()) > 0 for g in ref["grads"].values())


def test_micro_batch_count_and_packing_do_not_change_anything(reference):
    for tied, ref in reference.items():
        for n_micro, (res, grads) in ref["runs"].items():
            errs = compare(res, grads, ref)
            assert errs["loss_err"] <= TOL and errs["metric_err"] <= TOL, (tied, n_micro, errs)
            assert errs["grad_err"] <= TOL, (tied, n_micro, errs)
            assert sorted(errs["covered"]) == sorted(ref["grads"])
        assert set(ref["runs"]) == {2, 4, 8, "packed"}


def test_tp_pp_dp_layouts_match_single_rank(reference):
    results = run_ranks(split_fn, 4, reference)
    layouts = set()
    for tied in (False, True):
        for index, (tp, pp, n_micro) in enumerate(LAYOUTS):
            covered = set()
            for rank_results in results:
                case = rank_results[2 * index + int(tied)]
                assert case["tied"] == tied and case["layout"][:2] == (tp, pp)
                for key in ("loss_err", "metric_err", "grad_err"):
                    assert case[key] <= TOL, (key, case["layout"], tied, case[key])
                assert case["pad_ok"]
                assert case["fwd_err"] <= TOL, ("forward_logprobs", case["layout"], tied)
                assert case["num_tokens"] == reference[tied]["num_tokens"]
                covered |= set(case["covered"])
                layouts.add(case["layout"])
            want = set(reference[tied]["grads"])
            if tied and pp > 1:
                want.add("output_layer.weight")  # the last stage's copy of the embedding
            assert covered == want, (tp, pp, covered ^ want)
    assert {(tp, pp, dp) for tp, pp, dp, _ in layouts} == {(1, 1, 4), (2, 1, 2), (1, 2, 2),
                                                           (2, 2, 1)}


def test_micro_batch_validation():
    tokens = torch.zeros(10, dtype=torch.long)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="loss_mask"):
        MicroBatch(tokens=tokens, position_ids=tokens, targets=tokens, loss_mask=torch.ones(9),
                   cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"tokens must be 1-D \[S\]"):
        MicroBatch(tokens=tokens.view(2, 5), position_ids=tokens, targets=tokens,
                   loss_mask=tokens, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must be a host tensor ending at 10"):
        MicroBatch(tokens=tokens, position_ids=tokens, targets=tokens, loss_mask=tokens,
                   cu_seqlens=cu[:2])
    mb = padded_micro_batch([torch.tensor([5, 6, 7]), torch.tensor([8, 9])],
                            [torch.tensor([0, 1, 1]), torch.tensor([0, 1])])
    assert mb.tokens.tolist() == [5, 6, 7, 8, 9, 0] and mb.cu_seqlens.tolist() == [0, 3, 6]
    assert mb.targets.tolist() == [6, 7, 0, 9, 0, 0]
    assert mb.loss_mask.tolist() == [True, True, False, True, False, False]


def test_overlapped_grad_reduce_and_bf16_logits():
    from tests._rank_fns_train import overlap_and_logits_fn

    for result in run_ranks(overlap_and_logits_fn, 2):
        assert result["dp_size"] == 2
        assert result["overlap_err"] <= TOL
        # Float16Module: bf16 logits out with the train step's kwargs, the same values as its
        # fp32 default (which upcasts the bf16 output); a plain fp32 model gets no kwargs
        assert result["kwargs"] == {"fp32_output": False} and result["plain_kwargs"] == {}
        assert (result["kept_dtype"], result["default_dtype"]) == ("torch.bfloat16",
                                                                   "torch.float32")
        assert result["same_values"]
