"""train_step: loss, every gradient and every metric independent of TP, PP, DP, micro-batches."""

import math

import pytest
import torch

from megatron_dgpo.algorithm.packing import MicroBatch, padded_micro_batch
from tests._rank_fns_train import (CASES, DROPPED_GROUPS, LAYOUTS, LENGTHS, NUM_GROUPS, PROMPTS,
                                   compare, reference_fn, split_fn)
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


def test_aggregations_tis_and_filter_single_rank(reference):
    """Each case's loss equals losses' float64 formula (weights, W = #groups / #samples / kept
    tokens, TIS); 8 micro-batches (every group split) change nothing; the filter's gradient is
    the gradient of the kept groups alone."""
    kept = [i for i in range(len(LENGTHS)) if i % NUM_GROUPS not in DROPPED_GROUPS]
    kept_tokens = sum(LENGTHS[i] - PROMPTS[i] for i in kept)
    want_w = {"group": NUM_GROUPS, "seq": len(LENGTHS), "drop": kept_tokens,
              "group_drop_tis": NUM_GROUPS - len(DROPPED_GROUPS)}
    for tied, ref in reference.items():
        assert set(ref["cases"]) == set(CASES)
        for case, want in ref["cases"].items():
            assert abs(want["loss"] - want["loss64"]) <= TOL * max(1.0, abs(want["loss64"])), case
            assert float(want["metrics"]["weight_sum"]) == pytest.approx(want_w[case], rel=1e-12)
            drop = CASES[case][1]
            assert want["num_tokens"] == (kept_tokens if drop else ref["num_tokens"]), case
            assert want["summary"]["tokens"] == want["num_tokens"]
            errs = compare(*ref["case_splits"][case], want)
            for key in ("loss_err", "metric_err", "grad_err"):
                assert errs[key] <= TOL, (tied, case, key, errs[key])
            # the weighting matters: a token-mean gradient would fail the comparisons above
            differs = max(float((want["grads"][k] - ref["grads"][k]).abs().max()
                                / ref["grads"][k].abs().max()) for k in ref["grads"])
            assert differs > 1e-2, (case, differs)
        tis = ref["cases"]["group_drop_tis"]["summary"]
        assert 0 < tis["correction/clip_frac"] < 1 and tis["correction/ratio_max"] > 1.2
        assert 0 < tis["correction/weight_mean"] <= 1.2
        assert "correction/clip_frac" not in ref["cases"]["group"]["summary"]
        # filter: same loss, token count, metrics and gradients as the kept groups alone
        drop, alone = ref["cases"]["drop"], ref["kept_only"]
        assert drop["num_tokens"] == alone["num_tokens"] == kept_tokens
        assert abs(drop["loss"] - alone["loss"]) <= TOL * max(1.0, abs(alone["loss"]))
        for key in alone["metrics"]:
            a, b = float(drop["metrics"][key]), float(alone["metrics"][key])
            assert a == b or abs(a - b) <= TOL * max(1.0, abs(b)), key
        for name, grad in alone["grads"].items():
            err = float((drop["grads"][name] - grad).abs().max() / grad.abs().max())
            assert err <= TOL, (name, err)
        # the weighted path's loss and gradient against the formulas built from token means
        for case, want in ref["by_definition"].items():
            got = ref["cases"][case]
            assert abs(got["loss"] - want["loss"]) <= TOL * max(1.0, abs(want["loss"])), case
            for name, grad in want["grads"].items():
                err = float((got["grads"][name].double() - grad).abs().max() / grad.abs().max())
                assert err <= TOL, (case, name, err)
        # every group dropped: no token, a zero loss and exactly zero (not NaN) gradients
        assert ref["nothing_kept"] == dict(loss=0.0, num_tokens=0, grad_max=0.0)


def test_tp_pp_dp_layouts_match_single_rank(reference):
    results = run_ranks(split_fn, 4, reference)
    layouts = set()
    for tied in (False, True):
        for index, (tp, pp, n_micro) in enumerate(LAYOUTS):
            covered, sent = set(), 0
            for rank_results in results:
                case = rank_results[2 * index + int(tied)]
                assert case["tied"] == tied and case["layout"][:2] == (tp, pp)
                for key in ("loss_err", "metric_err", "grad_err"):
                    assert case[key] <= TOL, (key, case["layout"], tied, case[key])
                assert set(case["cases"]) == set(CASES)
                for name, errs in case["cases"].items():  # groups split across DP and micro
                    for key in ("loss_err", "metric_err", "grad_err"):
                        assert errs[key] <= TOL, (name, key, case["layout"], tied, errs[key])
                    assert errs["num_tokens"] == reference[tied]["cases"][name]["num_tokens"]
                assert case["pad_ok"]
                # PP > 1: the last stage's metrics reach the other stages as an object with
                # no tensor inside (a pickled CUDA tensor unpickles onto the sender's GPU)
                objects, tensors = case["crossing"]
                assert tensors == 0, (case["layout"], tensors)
                sent += objects
                assert case["fwd_err"] <= TOL, ("forward_logprobs", case["layout"], tied)
                assert case["num_tokens"] == reference[tied]["num_tokens"]
                covered |= set(case["covered"])
                layouts.add(case["layout"])
            want = set(reference[tied]["grads"])
            if tied and pp > 1:
                want.add("output_layer.weight")  # the last stage's copy of the embedding
            assert covered == want, (tp, pp, covered ^ want)
            # PP 2 on 4 ranks: each of the last stage's 2 ranks sends its metrics once
            assert sent == (2 if pp > 1 else 0), (tp, pp, sent)
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
    # exact: token ids, offsets and masks: integers and booleans
    assert mb.tokens.tolist() == [5, 6, 7, 8, 9, 0] and mb.cu_seqlens.tolist() == [0, 3, 6]
    assert mb.targets.tolist() == [6, 7, 0, 9, 0, 0]  # exact: token ids
    assert mb.loss_mask.tolist() == [True, True, False, True, False, False]  # exact: booleans


def test_loss_config_and_micro_batch_checks_for_the_new_options():
    from megatron_dgpo.algorithm.losses import LossConfig
    from megatron_dgpo.training.train_step import _check_micro_batch

    with pytest.raises(ValueError, match="loss_aggregation must be one of token_mean"):
        LossConfig(loss_aggregation="sum")
    with pytest.raises(ValueError, match="rollout_correction must be one of none, tis, token_mask"):
        LossConfig(rollout_correction="is")
    mb = padded_micro_batch([torch.tensor([5, 6, 7])], [torch.tensor([0, 1, 1])],
                            [torch.zeros(3)], [torch.ones(3)])
    _check_micro_batch(mb, 0, True, LossConfig())
    with pytest.raises(ValueError, match=r"micro_batches\[3\] lacks loss_weights"):
        _check_micro_batch(mb, 3, True, LossConfig(loss_aggregation="group_token_mean"))
    for option in ("tis", "geometric_mask"):
        with pytest.raises(ValueError, match=rf"micro_batches\[0\] lacks rollout_logprobs, which "
                                             rf"rollout_correction '{option}' needs"):
            _check_micro_batch(mb, 0, True, LossConfig(rollout_correction=option))


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
