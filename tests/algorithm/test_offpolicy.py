"""The behaviour weights of every ``algorithm.rollout_correction``, GSPO and the decoupled
objective against independent float64 formulas written one scalar at a time, for every method
and aggregation; the decoupled loss equals today's when pi_behav = pi_prox."""

import math

import numpy as np
import pytest
import torch

from megatron_dgpo.algorithm import losses
from megatron_dgpo.algorithm.losses import (AGGREGATIONS, METHODS, MASK_BANDS, LossConfig,
                                            LossHyperparams, Segments, behaviour_weights,
                                            policy_loss)
from tests.algorithm.test_losses import reference_F

HP = LossHyperparams(eps_low=0.2, eps_high=0.28, beta1=0.75, beta2=1.1, aspo_eps_low=0.33,
                     aspo_eps_high=3.0, gspo_eps_low=0.03, gspo_eps_high=0.04)
OPTIONS = losses.ROLLOUT_CORRECTIONS[1:]
CAP = 1.7
BANDS = {"token_mask": (0.6, 1.5), "sequence_mask": (0.4, 2.5), "geometric_mask": (0.9, 1.08)}


def config(option, **extra):
    band = BANDS.get(option, (None, None))
    return LossConfig(rollout_correction=option, rollout_correction_cap=CAP,
                      rollout_correction_low=band[0], rollout_correction_high=band[1], **extra)


def reference_weight(option, ratios):
    """v of one sample's valid tokens (their r_t = pi_prox / pi_behav, Python floats), from the
    formulas of docs/losses.md."""
    if option == "tis":
        return [min(r, CAP) for r in ratios]
    if option == "token_mask":
        low, high = BANDS[option]
        return [r if low <= r <= high else 0.0 for r in ratios]
    log_rho = sum(math.log(r) for r in ratios)
    if option == "sequence_tis":
        return [min(math.exp(log_rho), CAP)] * len(ratios)
    if option == "sequence_mask":
        low, high = BANDS[option]
        rho = math.exp(log_rho)
        return [rho if low <= rho <= high else 0.0] * len(ratios)
    low, high = BANDS[option]
    g = math.exp(log_rho / len(ratios))
    return [1.0 if low <= g <= high else 0.0] * len(ratios)


GROUP = 3


def batch(seed=0, lengths=(1, 5, 2000, 7, 3, 12, 9, 1, 30)):
    """Flat tokens of samples of the given lengths (one of 1 token, one of 2000, sample 4
    all-masked), laid out as groups of ``GROUP``: logprobs, pi_prox, pi_behav, advantages,
    mask, sample of each token. Token ratios pi_prox / pi_behav sit at and around every band
    edge and cap; sample ratios straddle the sequence bands."""
    gen = torch.Generator().manual_seed(seed)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = len(sample)
    prox = -torch.rand(n, generator=gen, dtype=torch.float64) * 4 - 0.1
    log_r = torch.randn(n, generator=gen, dtype=torch.float64) * 0.35
    long = sample == 2
    log_r[long] = torch.randn(int(long.sum()), generator=gen, dtype=torch.float64) * 0.02
    edges = [math.log(x) for x in (*BANDS["token_mask"], CAP)]
    pinned = [e + d for e in edges for d in (-1e-9, 0.0, 1e-9)]
    log_r[3:3 + len(pinned)] = torch.tensor(pinned, dtype=torch.float64)
    behav = prox - log_r
    logp = prox + torch.randn(n, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)[sample]
    mask = torch.rand(n, generator=gen) > 0.1
    mask[sample == 4] = False
    mask[sample == 0] = True
    return logp, prox, behav, adv, mask, sample, torch.tensor(lengths)


def _segments(sample, count):
    return Segments(sample, count)


@pytest.mark.parametrize("option", OPTIONS)
def test_each_behaviour_weight_is_its_formula(option):
    _, prox, behav, _, mask, sample, lengths = batch()
    v, metrics = behaviour_weights(config(option), prox, behav, mask, _segments(sample, len(lengths)))
    want = torch.zeros_like(v)
    ratios, dropped, samples, dropped_samples = [], 0, 0, 0
    for i in range(len(lengths)):
        idx = [t for t in range(len(sample)) if sample[t] == i and mask[t]]
        if not idx:
            continue
        r = [math.exp(float(prox[t] - behav[t])) for t in idx]
        ref = reference_weight(option, r)
        want[idx] = torch.tensor(ref, dtype=torch.float64)
        samples += 1
        if option in ("tis", "token_mask"):
            ratios += r
        elif option == "geometric_mask":
            ratios += [math.exp(sum(map(math.log, r)) / len(r))]
        else:
            ratios += [math.exp(sum(map(math.log, r)))]
        cut = [x == 0.0 for x in ref] if option not in ("tis", "sequence_tis") else \
            ([x > CAP for x in r] if option == "tis" else [math.exp(sum(map(math.log, r))) > CAP] * len(r))
        dropped += sum(cut)
        dropped_samples += any(cut)
    np.testing.assert_allclose(v.numpy(), want.numpy(), rtol=1e-12, atol=0)
    assert float(v[~mask].abs().max()) == 0.0  # exact: torch.where's 0 off the mask
    summary = losses.summarize_metrics(losses.merge_metrics([_dummy_loss_metrics(), metrics]))
    valid_v = v[mask]
    assert summary["correction/weight_mean"] == pytest.approx(float(valid_v.mean()), rel=1e-12)
    assert summary["correction/weight_min"] == float(valid_v.min())  # exact: the same minimum
    assert summary["correction/weight_max"] == float(valid_v.max())  # exact: the same maximum
    assert summary["correction/ratio_min"] == pytest.approx(min(ratios), rel=1e-12)
    assert summary["correction/ratio_max"] == pytest.approx(max(ratios), rel=1e-12)
    frac = dropped / int(mask.sum())
    if option in ("tis", "sequence_tis"):
        assert summary["correction/clip_frac"] == pytest.approx(frac, rel=1e-12)
        assert "correction/token_masked_frac" not in summary
    else:
        assert summary["correction/token_masked_frac"] == pytest.approx(frac, rel=1e-12)
        assert summary["correction/sample_masked_frac"] == pytest.approx(
            dropped_samples / samples, rel=1e-12)
    assert 0 < dropped < int(mask.sum())  # the options act, and not on everything


def _dummy_loss_metrics():
    logp, prox, _, adv, mask, _, _ = batch()
    return policy_loss("dgpo", logp, prox, adv, mask, HP)[1]


def test_the_batch_reaches_every_side_of_every_threshold():
    _, prox, behav, _, mask, sample, lengths = batch()
    r = (prox - behav).exp()[mask]
    for edge in (*BANDS["token_mask"], CAP):
        assert (r < edge).any() and (r > edge).any()
    log_rho = torch.zeros(len(lengths), dtype=torch.float64).index_add_(
        0, sample[mask], (prox - behav)[mask])
    count = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, sample[mask],
                                                                       torch.ones(int(mask.sum()), dtype=torch.float64))
    has = count > 0
    for option in ("sequence_mask", "geometric_mask"):
        stat = (log_rho / count.clamp(min=1) if option == "geometric_mask" else log_rho)[has].exp()
        low, high = BANDS[option]
        assert ((stat >= low) & (stat <= high)).any() and ((stat < low) | (stat > high)).any(), option
    assert (log_rho[has].exp() > CAP).any() and (log_rho[has].exp() < CAP).any()


def test_masked_tokens_stay_in_the_normaliser_and_the_weights_carry_no_gradient():
    logp, prox, behav, adv, mask, sample, lengths = batch(seed=1)
    prox, behav = prox.clone().requires_grad_(True), behav.clone().requires_grad_(True)
    v, _ = behaviour_weights(config("token_mask"), prox, behav, mask)
    assert not v.requires_grad
    logp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss("dgpo", logp, prox.detach(), adv, mask, HP, weights=v)
    loss.backward()
    assert prox.grad is None and behav.grad is None
    kept = mask & (v > 0)
    assert metrics["tokens_count"] == mask.sum()  # exact: masked tokens still counted
    w = (logp.detach() - prox.detach()).exp()
    n = int(mask.sum())  # the normaliser: every valid token, masked or not
    for t in torch.nonzero(kept).flatten()[:50].tolist():
        f = reference_F("dgpo", float(w[t]), float(adv[t]), 1, 2)
        assert float(logp.grad[t]) == pytest.approx(-float(v[t]) * f * float(adv[t]) / n, rel=1e-12)
    assert not logp.grad[mask & (v == 0)].any() and (mask & (v == 0)).any()


def reference_gspo_grad(logp, prox, adv, mask, sample, count, c, v, W):
    """GSPO's paper: grad_t = -c_t v_t F_i A_i / W with s_i = exp(mean_t log w) over the sample's
    valid tokens and F_i = s_i unless the sample is clipped (A > 0, s > 1+eps or A < 0, s <
    1-eps), then 0."""
    grad = np.zeros(len(logp))
    for i in range(count):
        idx = [t for t in range(len(logp)) if sample[t] == i and mask[t]]
        if not idx:
            continue
        s = math.exp(sum(float(logp[t] - prox[t]) for t in idx) / len(idx))
        a = float(adv[idx[0]])
        clipped = (a > 0 and s > 1 + HP.gspo_eps_high) or (a < 0 and s < 1 - HP.gspo_eps_low)
        for t in idx:
            grad[t] = 0.0 if clipped else -float(c[t]) * float(v[t]) * s * a / W
    return grad


def _aggregation_weights(aggregation, lengths, sample, mask):
    weights = losses.sample_loss_weights(lengths, GROUP, aggregation)
    c = torch.ones(len(sample), dtype=torch.float64) if weights is None else weights[sample]
    return c, float(torch.where(mask, c, 0.0).sum())


def _formula_grad(method, logp, prox, adv, mask, sample, count, c, v, W):
    if method == "gspo":
        return reference_gspo_grad(logp, prox, adv, mask, sample, count, c, v, W)
    grad = np.zeros(len(logp))
    for t in range(len(logp)):
        if mask[t]:
            f = reference_F(method, math.exp(float(logp[t] - prox[t])), float(adv[t]), 1, 2)
            grad[t] = -float(c[t]) * float(v[t]) * f * float(adv[t]) / W
    return grad


def _lengths_for_gspo():
    return (1, 5, 40, 7, 3, 12, 9, 1, 30)  # short enough for the per-token Python loops


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("option", ("none",) + OPTIONS)
def test_decoupled_gradient_is_the_formula_for_every_method_option_and_aggregation(
        option, method, aggregation):
    """grad_t = -(1/W) c_t v_t F(pi_theta / pi_prox) A_t, v from pi_prox / pi_behav, W = sum c
    over the valid tokens (masked ones included)."""
    if method == "gspo" and aggregation != "seq_mean_token_mean":
        with pytest.raises(ValueError, match="seq_mean_token_mean"):
            LossConfig(method=method, loss_aggregation=aggregation)
        return
    logp, prox, behav, adv, mask, sample, lengths = batch(seed=2, lengths=_lengths_for_gspo())
    if method == "gspo":  # sample ratios on both sides of GSPO's clip (samples 0, 4, 6)
        logp = prox + (logp - prox) * 0.25
    segments = _segments(sample, len(lengths))
    c, W = _aggregation_weights(aggregation, lengths, sample, mask)
    v = torch.ones_like(c)
    if option != "none":
        v, _ = behaviour_weights(config(option), prox, behav, mask, segments)
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(method, logp, prox, adv, mask, HP, num_tokens=W, weights=c * v,
                          segments=segments)
    loss.backward()
    want = _formula_grad(method, logp.detach(), prox, adv, mask, sample, len(lengths), c, v, W)
    np.testing.assert_allclose(logp.grad.numpy(), want, rtol=1e-11, atol=1e-15)
    assert np.abs(want).max() > 0
    if method == "gspo":  # whole samples clipped (gradient 0) beside unclipped ones
        clipped = [i for i in range(len(lengths)) if (mask & (sample == i)).any()
                   and not want[(mask & (sample == i)).numpy()].any()]
        assert clipped and len(clipped) < 8


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("option", OPTIONS)
def test_behaviour_equal_to_prox_is_exactly_todays_loss(option, method, aggregation):
    """pi_behav = pi_prox: every v is 1, and the loss, gradient and loss metrics are bit for bit
    those without a correction (weights c alone, or none for token_mean)."""
    if method == "gspo" and aggregation != "seq_mean_token_mean":
        return
    logp, prox, _, adv, mask, sample, lengths = batch(seed=3, lengths=_lengths_for_gspo())
    segments = _segments(sample, len(lengths))
    weights = losses.sample_loss_weights(lengths, GROUP, aggregation)
    c = None if weights is None else weights[sample]
    W = mask.sum() if c is None else torch.where(mask, c, 0.0).sum()
    v, _ = behaviour_weights(config(option), prox, prox.clone(), mask, segments)
    assert torch.equal(v, mask.double())  # exact: log r = 0 gives exp(0) = 1 everywhere valid
    results = []
    for token_weights in (c, v if c is None else c * v):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(method, lp, prox, adv, mask, HP, num_tokens=W,
                                    weights=token_weights, segments=segments)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    # exact: multiplying by 1.0 changes no bit, so the same sums of the same values
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)  # exact: likewise
    for key in results[0][2]:
        # exact: the metrics likewise (the same ops on the same values)
        torch.testing.assert_close(results[0][2][key], results[1][2][key], rtol=0, atol=0)


def test_gspo_value_and_regions_are_the_sample_ratios():
    """GSPO's objective value is mean_i min(s_i A_i, clip(s_i) A_i) under seq_mean_token_mean;
    its regions are counted per token at the sample's ratio; a 1-token sample is token-level
    PPO with GSPO's epsilons."""
    logp, prox, _, adv, mask, sample, lengths = batch(seed=4, lengths=_lengths_for_gspo())
    logp = prox + (logp - prox) * 0.25
    segments = _segments(sample, len(lengths))
    c, W = _aggregation_weights("seq_mean_token_mean", lengths, sample, mask)
    loss, metrics = policy_loss("gspo", logp, prox, adv, mask, HP, num_tokens=W, weights=c,
                                segments=segments)
    values, clipped_tokens = [], 0
    for i in range(len(lengths)):
        idx = [t for t in range(len(logp)) if sample[t] == i and mask[t]]
        if not idx:
            continue
        s = math.exp(sum(float(logp[t] - prox[t]) for t in idx) / len(idx))
        a = float(adv[idx[0]])
        clip = min(max(s, 1 - HP.gspo_eps_low), 1 + HP.gspo_eps_high)
        # c_t = 1 / L_i over the whole response, masked tokens included
        values.append(min(s * a, clip * a) * len(idx) / int(lengths[i]))
        if (a > 0 and s > 1 + HP.gspo_eps_high) or (a < 0 and s < 1 - HP.gspo_eps_low):
            clipped_tokens += len(idx)
    assert float(loss) == pytest.approx(-sum(values) / W, rel=1e-12)
    assert 0 < clipped_tokens < int(mask.sum())
    assert float(metrics["clipped_count"]) == clipped_tokens  # exact: a count


def test_gspo_needs_segments_and_a_sample_of_one_token_is_ppo_with_gspos_eps():
    logp, prox, _, adv, mask, _, _ = batch(seed=5)
    with pytest.raises(ValueError, match="pass segments"):
        policy_loss("gspo", logp, prox, adv, mask, HP)
    ones = Segments(torch.arange(len(logp)), len(logp))  # every token its own sample
    hp = LossHyperparams(eps_low=HP.gspo_eps_low, eps_high=HP.gspo_eps_high)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    policy_loss("gspo", a, prox, adv, mask, HP, segments=ones)[0].backward()
    policy_loss("grpo", b, prox, adv, mask, hp)[0].backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-15, atol=0)


def test_segments_reduce_is_applied_to_the_partial_totals():
    """A sample split between two holders: each one's partial sums, added by ``reduce``, give
    the whole sample's ratio (what train_step does over the CP group)."""
    logp, prox, _, adv, mask, sample, lengths = batch(seed=6, lengths=(4, 6, 5))
    whole = Segments(sample, 3)
    half = torch.arange(len(sample)) % 2 == 0
    other = {}

    def reduce_first(totals):
        return totals + other["part"]

    parts = {}
    for name, keep in (("a", half), ("b", ~half)):
        seg = Segments(sample[keep], 3)
        log_w = torch.where(mask[keep], logp[keep] - prox[keep], 0.0)
        parts[name] = seg.totals(torch.stack([log_w, mask[keep].double()]))
    other["part"] = parts["b"]
    split = Segments(sample[half], 3, reduce=reduce_first)
    got = losses.sequence_log_ratio(torch.where(mask[half], logp[half] - prox[half], 0.0),
                                    mask[half], split)
    want = losses.sequence_log_ratio(torch.where(mask, logp - prox, 0.0), mask, whole)[half]
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)


def test_effective_sample_size_of_a_mini_batch():
    _, prox, behav, _, mask, sample, lengths = batch(seed=7)
    v, metrics = behaviour_weights(config("tis"), prox, behav, mask)
    ess = losses.effective_sample_size(metrics)
    valid = v[mask]
    want = float(valid.sum()) ** 2 / float(valid.square().sum())
    assert float(ess["correction_ess_sum"]) == pytest.approx(want, rel=1e-12)
    assert float(ess["correction_ess_frac_sum"]) == pytest.approx(want / int(mask.sum()), rel=1e-12)
    # two mini-batches: the step logs their mean
    merged = losses.merge_metrics([metrics, ess, metrics, losses.effective_sample_size(metrics)])
    summary = losses._correction_summary(merged, lambda a, b: float(a) / b, float)
    assert summary["correction/ess"] == pytest.approx(want, rel=1e-12)
    assert 0 < want < int(mask.sum())


def test_config_checks_name_the_key():
    assert LossConfig(rollout_correction="token_mask").mask_band() == MASK_BANDS["token_mask"]
    assert LossConfig(rollout_correction="sequence_mask",
                      rollout_correction_high=3.0).mask_band() == (0.5, 3.0)
    for bad, match in (
            (dict(rollout_correction="tis", rollout_correction_low=0.5), "bound the masking corr"),
            (dict(rollout_correction="token_mask", rollout_correction_low=1.2),
             r"rollout_correction_low must be in \(0, 1\]"),
            (dict(rollout_correction="token_mask", rollout_correction_high=0.9),
             "rollout_correction_high must be >= 1"),
            (dict(rollout_correction_cap=0.5), "rollout_correction_cap must be >= 1"),
            (dict(old_logprobs="rollout", rollout_correction="tis"), "set it to none"),
            (dict(old_logprobs="engine"), "old_logprobs must be one of trainer, rollout"),
            (dict(old_logprobs_check_every=-1), "old_logprobs_check_every must be >= 0"),
            (dict(method="gspo"), "set loss_aggregation: seq_mean_token_mean")):
        with pytest.raises(ValueError, match=match):
            LossConfig(**bad)
    with pytest.raises(ValueError, match="pass segments"):
        behaviour_weights(LossConfig(rollout_correction="sequence_tis"), *batch()[1:3],
                          batch()[4])
    with pytest.raises(ValueError, match="has no weight"):
        behaviour_weights(LossConfig(), *batch()[1:3], batch()[4])
