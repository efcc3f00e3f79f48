"""The rollout corrections and GSPO against the anchors' own functions' stored outputs
(tests/algorithm/anchors/README.md), in float64: equal, or different exactly where
docs/losses.md ("Differences from the anchors") says and by what it says."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dgpo.algorithm import losses
from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams, Segments

DATA = Path(__file__).parent / "anchors"


@pytest.fixture(scope="module")
def anchors():
    data = dict(np.load(DATA / "anchors.npz"))
    meta = json.loads((DATA / "anchors.json").read_text())
    lengths = torch.tensor(data["lengths"])
    sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return data, meta, sample, Segments(sample, len(lengths))


def _ours(anchors, option, **keys):
    data, _, _, segments = anchors
    config = LossConfig(rollout_correction=option, **keys)
    mask = torch.tensor(data["mask"]).bool()
    weights, metrics = losses.behaviour_weights(config, torch.tensor(data["prox_logprobs"]),
                                                torch.tensor(data["behav_logprobs"]), mask,
                                                segments)
    summary = losses._correction_summary(
        losses.merge_metrics([metrics, losses.effective_sample_size(metrics)]),
        lambda a, b: float(a) / b, float)
    return weights.numpy(), summary


def _log_r(data):
    return (data["prox_logprobs"] - data["behav_logprobs"]) * data["mask"]


def segments_log_rho(anchors):
    """Each token's sample's sum of log r over its valid tokens."""
    data, _, sample, segments = anchors
    return segments.totals(torch.tensor(_log_r(data))[None])[0].numpy()[sample.numpy()]


def _differs(got, want):
    return np.abs(got - want) > 1e-14 * np.maximum(1.0, np.abs(want))


def test_tis_equals_verl_slime_and_nemo_rl(anchors):
    data, meta, _, _ = anchors
    ours, summary = _ours(anchors, "tis", rollout_correction_cap=2.0)
    for key in ("verl_tis_2", "slime_tis_2", "nemo_tis_2"):
        assert not _differs(ours, data[key]).any(), key
    clipped = (np.exp(_log_r(data)) > 2.0) & (data["mask"] > 0)
    assert clipped.any() and (~clipped & (data["mask"] > 0)).any()
    verl = meta["outputs"]["verl_tis_2"]["metrics"]
    # verl's rollout_is_mean is the mean ratio before truncation; ours logs the weight's mean
    ratio = np.exp(_log_r(data))[data["mask"] > 0]
    assert verl["rollout_corr/rollout_is_mean"] == pytest.approx(ratio.mean(), rel=1e-10)  # its mean: / (n + 1e-8)
    assert summary["correction/weight_mean"] == pytest.approx(
        np.minimum(ratio, 2.0).mean(), rel=1e-12)
    # verl's ESS: the share (sum w)^2 / (n sum w^2) of the weights clamped to [1/C, C], its
    # mean + 1e-8; ours: of the weights as they enter the loss
    valid = ours[data["mask"] > 0]
    assert summary["correction/ess_frac"] == pytest.approx(
        valid.sum() ** 2 / (len(valid) * (valid ** 2).sum()), rel=1e-12)
    floored = np.clip(valid, 0.5, 2.0)
    assert verl["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        floored.sum() ** 2 / (len(floored) * (floored ** 2).sum()), rel=1e-7)


def test_token_mask_equals_icepop_and_verl_up_to_the_documented_edges(anchors):
    data, meta, _, _ = anchors
    log_r, valid = _log_r(data), data["mask"] > 0
    for low, high in ((0.5, 2.0), (0.6, 1.4)):
        ours, summary = _ours(anchors, "token_mask", rollout_correction_low=low,
                              rollout_correction_high=high)
        # slime and NeMo-RL compare exp(log r) with the edges, we (like verl) log r with their
        # logs: a token within an ulp of an edge can fall on different sides (there, theirs
        # kept it at r or dropped it: 0); every other token is equal
        outside_in_log = (log_r < math.log(low)) | (log_r > math.log(high))
        near_edge = valid & np.isclose(log_r[None], np.log([[low], [high]]), rtol=1e-15,
                                       atol=0).any(0)
        for key in (f"slime_icepop_{low:g}_{high:g}", f"nemo_icepop_{low:g}_{high:g}"):
            differs = _differs(ours, data[key])
            assert not (differs & ~near_edge).any(), key
            theirs = data[key][differs]
            assert np.all((theirs == 0) | np.isclose(theirs, np.exp(log_r[differs]), rtol=1e-14))
        verl = data[f"verl_token_mask_{low:g}_{high:g}"]
        # verl's token_k1 bounds -log r by log(low), log(high): it keeps r in [1/high, 1/low]
        verl_keeps = valid & (-log_r >= math.log(low)) & (-log_r <= math.log(high))
        ours_keeps = valid & ~outside_in_log
        # exact: booleans from the same correctly rounded subtraction and comparisons with the
        # same math.log bounds as verl's code and ours
        assert np.array_equal(_differs(ours, verl), verl_keeps != ours_keeps)
        assert (verl_keeps != ours_keeps).any() == (low != 1 / high)  # exact: booleans, as above
        if low == 1 / high:
            metrics = meta["outputs"][f"verl_token_mask_{low:g}_{high:g}"]["metrics"]
            assert summary["correction/token_masked_frac"] == pytest.approx(
                metrics["rollout_corr/rollout_rs_masked_fraction"], rel=1e-12)
            # verl shares masked samples over every row (the one with no valid token too);
            # ours over the samples with a valid token: 10 of the 11
            assert summary["correction/sample_masked_frac"] == pytest.approx(
                metrics["rollout_corr/rollout_rs_seq_masked_fraction"] * 11 / 10, rel=1e-7)


def test_the_inputs_reach_every_edge(anchors):
    """The comparisons above can fail: tokens sit on and beside every edge, and the 1-token
    sample at exactly 2.0 is the one slime and NeMo-RL keep and we do not."""
    data, _, sample, _ = anchors
    log_r, valid = _log_r(data), data["mask"] > 0
    for edge in (0.5, 0.6, 1.4, 2.0):
        near = valid & (np.abs(log_r - math.log(edge)) <= 1.01e-9)
        assert near.sum() >= 3, edge
    first = (sample == 0).numpy()
    assert log_r[first] > math.log(2.0)  # an ulp above log 2: we mask it, ...
    # ... and slime and NeMo-RL kept it at r = 2.0 (their exp rounded onto the edge)
    for key in ("slime_icepop_0.5_2", "nemo_icepop_0.5_2"):
        assert data[key][first] == pytest.approx(2.0, rel=1e-15)


def test_sequence_tis_and_sequence_mask_equal_verl(anchors):
    data, meta, sample, _ = anchors
    ours, summary = _ours(anchors, "sequence_tis", rollout_correction_cap=2.0)
    np.testing.assert_allclose(ours, data["verl_sequence_tis_2"], rtol=1e-14, atol=0)
    seq_ratio = np.exp(np.minimum(segments_log_rho(anchors), 20.0))
    assert meta["outputs"]["verl_sequence_tis_2"]["metrics"]["rollout_corr/rollout_is_mean"] \
        == pytest.approx(seq_ratio[data["mask"] > 0].mean(), rel=1e-10)  # untruncated, again
    assert summary["correction/weight_mean"] == pytest.approx(
        np.minimum(seq_ratio, 2.0)[data["mask"] > 0].mean(), rel=1e-12)
    ours, summary = _ours(anchors, "sequence_mask", rollout_correction_low=0.5,
                          rollout_correction_high=2.0)
    np.testing.assert_allclose(ours, data["verl_sequence_mask_0.5_2"], rtol=1e-14, atol=0)
    # the samples at 2.0 +- 1e-9 (in log) and below 0.5 are masked or kept as their side says
    kept = {i: bool(ours[(sample == i).numpy()].any()) for i in (2, 3, 4)}
    assert kept == {2: False, 3: True, 4: False}
    assert summary["correction/token_masked_frac"] == pytest.approx(
        meta["outputs"]["verl_sequence_mask_0.5_2"]["metrics"][
            "rollout_corr/rollout_rs_masked_fraction"], rel=1e-12)


def test_geometric_mask_equals_verls_geo_rs_and_nemo_rl_keeps_the_token_ratios(anchors):
    data, _, sample, segments = anchors
    log_r, valid = _log_r(data), data["mask"] > 0
    ours, _ = _ours(anchors, "geometric_mask", rollout_correction_low=1 / 1.1,
                    rollout_correction_high=1.1)
    assert not _differs(ours, data["verl_geometric_mask_1.1"]).any()
    # NeMo-RL's seq-mask-tis: the same samples kept, each token weighted by its own ratio
    np.testing.assert_allclose(ours * np.exp(log_r) * valid, data["nemo_seq_mask_tis_1.1"],
                               rtol=1e-14, atol=0)
    assert {i: bool(ours[(sample == i).numpy()].any()) for i in (5, 10)} == {5: True, 10: True}
    # an asymmetric band: verl bounds the geometric mean of 1/r (seq_mean_k1)
    ours, _ = _ours(anchors, "geometric_mask", rollout_correction_low=0.9,
                    rollout_correction_high=1.1)
    totals = segments.totals(torch.tensor(np.stack([log_r, data["mask"]])))
    log_g = (totals[0] / totals[1].clamp(min=1)).numpy()[sample.numpy()]
    ours_keeps = valid & (log_g >= math.log(0.9)) & (log_g <= math.log(1.1))
    verl_keeps = valid & (-log_g >= math.log(0.9)) & (-log_g <= math.log(1.1))
    bounds = np.log([0.9, 1.1, 1 / 0.9, 1 / 1.1])
    assert np.abs(log_g[valid][:, None] - bounds).min() > 1e-12  # no sample near an edge: ...
    # exact: ... so these booleans do not depend on the order of a sample's sum
    assert np.array_equal(ours > 0, ours_keeps)
    # exact: booleans, as above
    assert np.array_equal(data["verl_geometric_mask_0.9_1.1"] > 0, verl_keeps)
    assert (ours_keeps != verl_keeps).any()  # exact: booleans, as above


def test_gspo_equals_slime_and_verl_nemo_rl_up_to_their_normaliser_epsilon(anchors):
    data, meta, sample, segments = anchors
    mask = torch.tensor(data["gspo_mask"]).bool()
    lengths = torch.zeros(len(data["lengths"]), dtype=torch.long).index_add_(0, sample, mask.long())
    kept = lengths > 0
    c = torch.where(mask, 1.0 / lengths[sample].clamp(min=1).double(), 0.0)  # seq_mean_token_mean
    logp = torch.tensor(data["logprobs"]).requires_grad_(True)
    eps_low, eps_high = meta["gspo_eps"]
    loss, metrics = losses.policy_loss(
        "gspo", logp, torch.tensor(data["prox_logprobs"]), torch.tensor(data["advantages"]),
        mask, LossHyperparams(gspo_eps_low=eps_low, gspo_eps_high=eps_high),
        num_tokens=float(kept.sum()), weights=c, segments=segments)
    loss.backward()
    grad = logp.grad.numpy()
    scale = np.abs(grad).max()
    np.testing.assert_allclose(grad, data["slime_gspo_grad"], rtol=0, atol=1e-15 * scale)
    assert float(loss.detach()) == pytest.approx(meta["outputs"]["slime_gspo"]["loss"], rel=1e-14)
    # verl divides each sample's token sum by (L_i + 1e-8). NeMo-RL also its mean over samples
    # by (G + 1e-8), and it differentiates s_i = exp(sum_t log w_t / (L_i + 1e-8)) itself: its
    # gradient is -A s'_i L_i / (L_i + 1e-8)^2 / (G + 1e-8). Each differs from ours,
    # -A s_i / (L_i G), by exactly that factor where the sample is not clipped.
    eps, length = 1e-8, lengths[sample].clamp(min=1).double().numpy()
    groups = float(kept.sum())
    totals = segments.totals(torch.stack([(logp.detach() - torch.tensor(data["prox_logprobs"]))
                                          * mask, mask.double()]))
    log_s = (totals[0] / totals[1].clamp(min=1)).numpy()[sample.numpy()]
    factors = {"verl_gspo_grad": length / (length + eps),
               "nemo_gspo_grad": np.exp(log_s * (length / (length + eps) - 1))
               * length ** 2 / (length + eps) ** 2 * groups / (groups + eps)}
    for key, factor in factors.items():
        want = data[key]
        np.testing.assert_allclose(want, grad * factor, rtol=1e-13, atol=1e-18)
        assert (np.abs(grad - want) > 1e-15 * scale).any()  # the epsilons show: it could fail
    # both clipped and unclipped samples (GSPO's eps are small: most samples are clipped)
    unclipped = {int(i) for i in sample[torch.tensor(grad != 0)].unique()}
    assert 0 < len(unclipped) < int(kept.sum())
    assert float(metrics["clipped_count"]) / float(metrics["tokens_count"]) == pytest.approx(
        meta["outputs"]["verl_gspo"]["pg_clipfrac"], rel=1e-6)
