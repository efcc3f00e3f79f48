"""policy_loss against an independent float64 implementation of the paper's F table."""

import math

import numpy as np
import pytest
import torch

from megatron_dgpo.algorithm import losses
from megatron_dgpo.algorithm.losses import METHODS, TOKEN_METHODS, LossHyperparams, policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28  # unequal on purpose: a swapped bound would show
BETA1, BETA2, ASPO_LOW, ASPO_HIGH = 0.75, 1.1, 0.33, 3.0


def reference_F(method, w, a, n, m):
    """The issue's F table, written independently, one scalar at a time, in Python floats."""
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    ln, hp = w < lo and a < 0, w > hi and a > 0
    if method == "grpo":
        return 0.0 if (ln or hp) else w
    if method == "cispo":
        return min(max(w, lo), hi)
    if method == "gppo":
        return lo if ln else hi if hp else w
    if method == "ce_gppo":
        return BETA1 * lo if ln else BETA2 * hi if hp else w
    if method == "aspo":
        if ln or hp:
            return 0.0
        if a > 0:
            return 1 - ASPO_LOW if w < 1 - ASPO_LOW else 1 / w
        if a < 0:
            return 1 + ASPO_HIGH if w > 1 + ASPO_HIGH else w
        return w
    if method == "dgpo":
        # Paper Eq. 8-9: F = W * pi with W = C_left sg(pi)^n, C_left = (1-eps)^-n pi_old^-(n+1)
        # in LN and W = C_right sg(pi)^(-1/m), C_right = (1+eps)^(1/m) pi_old^(1/m-1) in HP.
        pi_old = 0.37  # any value: F must not depend on it
        pi = w * pi_old
        if ln:
            return (1 - EPS_LOW) ** -n * pi_old ** -(n + 1) * pi ** n * pi
        if hp:
            return (1 + EPS_HIGH) ** (1 / m) * pi_old ** (1 / m - 1) * pi ** (-1 / m) * pi
        return pi / pi_old
    raise AssertionError(method)


def kwargs(n=1, m=2):
    return dict(hp=LossHyperparams(eps_low=EPS_LOW, eps_high=EPS_HIGH, n=n, m=m, beta1=BETA1,
                                   beta2=BETA2, aspo_eps_low=ASPO_LOW, aspo_eps_high=ASPO_HIGH))


def random_batch(shape=(6, 50), seed=0, dtype=torch.float64):
    """Ratios spanning every region (log-ratios in [-2.5, 2.5], ASPO's dual clips included)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 5
    log_w = (torch.rand(shape, generator=gen, dtype=torch.float64) - 0.5) * 5
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    adv.view(-1)[:5] = 0.0  # A = 0 tokens (region M whatever w)
    mask = torch.rand(shape, generator=gen) > 0.2
    return (old + log_w).to(dtype), old.to(dtype), adv.to(dtype), mask


@pytest.mark.parametrize("method", TOKEN_METHODS)
@pytest.mark.parametrize("n,m", [(n, m) for n in (1, 2, 3) for m in (1, 2, 3)])
def test_gradient_matches_closed_form(method, n, m):
    logp, old, adv, mask = random_batch(seed=n * 10 + m)
    logp.requires_grad_(True)
    loss, _ = policy_loss(method, logp, old, adv, mask, **kwargs(n, m))
    loss.backward()
    num_tokens = mask.sum().item()
    w = (logp.detach() - old).exp()
    want = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        if mask[idx]:
            f = reference_F(method, w[idx].item(), adv[idx].item(), n, m)
            want[idx] = -f * adv[idx].item() / num_tokens
    got = logp.grad.numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-10 * scale
    nonzero = np.abs(want) > 1e-6 * scale
    assert np.all(np.abs(got - want)[nonzero] <= 1e-10 * np.abs(want)[nonzero])


def test_batch_covers_every_region():
    logp, old, adv, mask = random_batch()
    _, metrics = policy_loss("dgpo", logp, old, adv, mask, **kwargs())
    for region in losses.REGIONS:
        assert metrics[f"region_{region}_count"] >= 5, region
    w = (logp - old).exp()
    assert ((w < 1 - ASPO_LOW) & (adv > 0) & mask).sum() > 3  # ASPO's positive dual clip
    assert ((w > 1 + ASPO_HIGH) & (adv < 0) & mask).sum() > 3  # ASPO's negative dual clip


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_dgpo_continuous_at_both_boundaries(n, m):
    def F(w, a):
        logp = torch.tensor([math.log(w)], dtype=torch.float64, requires_grad=True)
        loss, _ = policy_loss("dgpo", logp, torch.zeros(1, dtype=torch.float64),
                              torch.tensor([a], dtype=torch.float64), torch.ones(1),
                              **kwargs(n, m))
        loss.backward()
        return -logp.grad.item() / a

    left, right = 1 - EPS_LOW, 1 + EPS_HIGH
    for w0, a in ((left, -1.0), (right, 1.0)):
        assert F(w0, a) == pytest.approx(w0, rel=1e-12)
        assert F(w0 * (1 - 1e-9), a) == pytest.approx(w0, rel=1e-7)
        assert F(w0 * (1 + 1e-9), a) == pytest.approx(w0, rel=1e-7)


def test_limits_as_ratio_vanishes_in_LN():
    w = torch.tensor([1e-1, 1e-2, 1e-3, 1e-4], dtype=torch.float64)
    old = torch.zeros_like(w)
    adv = -torch.ones_like(w)
    grads = {}
    for method in ("dgpo", "gppo"):
        logp = w.log().requires_grad_(True)
        policy_loss(method, logp, old, adv, torch.ones_like(w), **kwargs(n=1))[0].backward()
        grads[method] = logp.grad * len(w)  # = F (A = -1)
    assert torch.all(grads["dgpo"][1:] < grads["dgpo"][:-1])  # decreasing towards 0
    assert grads["dgpo"][-1] < 1e-7
    torch.testing.assert_close(grads["gppo"], torch.full_like(w, 1 - EPS_LOW))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_no_nan_or_inf_on_extreme_inputs(method, dtype):
    log_w = torch.tensor([80.0, -80.0, 80.0, -80.0, 0.0, 40.0, -40.0, 88.0, -100.0, 700.0])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 5.0, -5.0, -1.0, 1.0, -2.0])
    old = torch.full_like(log_w, -3.0)
    mask = torch.ones_like(log_w, dtype=torch.bool)
    # masked-out garbage: huge finite values in every input
    log_w = torch.cat([log_w, torch.tensor([1e30, -1e30])])
    old = torch.cat([old, torch.tensor([-1e30, 3e38])])
    adv = torch.cat([adv, torch.tensor([1e30, -3e38])])
    mask = torch.cat([mask, torch.tensor([False, False])])
    logp = (old + log_w).to(dtype).requires_grad_(True)
    for n, m in ((1, 1), (3, 3)):
        loss, metrics = policy_loss(method, logp, old.to(dtype), adv.to(dtype), mask,
                                    **kwargs(n, m))
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss), (method, dtype)
        assert torch.isfinite(grad).all(), (method, dtype, grad)
        assert torch.all(grad[-2:] == 0)  # exact: masked: the slope is torch.where's 0
        for key, value in metrics.items():
            if not key.endswith(("_max", "_min")):
                assert torch.isfinite(value), key


def test_masked_tokens_do_not_matter():
    logp, old, adv, mask = random_batch(seed=3)
    garbage = torch.where(mask, logp, torch.full_like(logp, -7e3))
    results = []
    for lp in (logp, garbage):
        lp = lp.clone().requires_grad_(True)
        loss, metrics = policy_loss("dgpo", lp, old, adv, mask, **kwargs())
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    # exact: policy_loss replaces the masked garbage by torch.where before any arithmetic: the
    # same ops on the same values
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    # exact: likewise for the gradient
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    for key in results[0][2]:
        # exact: and the metrics
        torch.testing.assert_close(results[0][2][key], results[1][2][key], rtol=0, atol=0)


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_num_tokens_normalises_across_micro_batches(method):
    """Splitting a mini-batch and normalising each part by the global count sums exactly."""
    logp, old, adv, mask = random_batch(shape=(8, 40), seed=5)
    logp.requires_grad_(True)
    whole, whole_metrics = policy_loss(method, logp, old, adv, mask, **kwargs())
    (whole_grad,) = torch.autograd.grad(whole, logp)

    total = mask.sum()
    parts, part_metrics = [], []
    for rows in (slice(0, 1), slice(1, 4), slice(4, 8)):
        loss, metrics = policy_loss(method, logp[rows], old[rows], adv[rows], mask[rows],
                                    **kwargs(), num_tokens=total)
        parts.append(loss)
        part_metrics.append(metrics)
    (split_grad,) = torch.autograd.grad(sum(parts), logp)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-16)

    merged = losses.merge_metrics(part_metrics)
    assert merged.keys() == whole_metrics.keys()
    for key in merged:
        torch.testing.assert_close(merged[key], whole_metrics[key], rtol=1e-12, atol=0)

    # a per-part mean (the classic bias) would differ: the check above can fail
    biased = sum(policy_loss(method, logp[r], old[r], adv[r], mask[r], **kwargs())[0] / 3
                 for r in (slice(0, 1), slice(1, 4), slice(4, 8)))
    assert not torch.allclose(biased, whole)


def test_one_dimensional_input_and_default_normaliser():
    logp, old, adv, mask = random_batch(shape=(30,), seed=7)
    logp.requires_grad_(True)
    loss, _ = policy_loss("gppo", logp, old, adv, mask, **kwargs())
    loss2, _ = policy_loss("gppo", logp, old, adv, mask, **kwargs(), num_tokens=mask.sum() * 2)
    torch.testing.assert_close(loss2 * 2, loss)


def test_forward_values_are_the_documented_objectives():
    logp, old, adv, mask = random_batch(shape=(4, 25), seed=11)
    w = (logp - old).exp()
    count = mask.sum()
    clipped = w.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
    ppo = torch.minimum(w * adv, clipped * adv)
    want_grpo = -(ppo * mask).sum() / count
    want_cispo = -(clipped * adv * logp * mask).sum() / count
    got_grpo, _ = policy_loss("grpo", logp, old, adv, mask, **kwargs())
    got_cispo, _ = policy_loss("cispo", logp, old, adv, mask, **kwargs())
    torch.testing.assert_close(got_grpo, want_grpo)
    torch.testing.assert_close(got_cispo, want_cispo)
    # GPPO's value is PPO's (its clipped terms have value (1 +- eps) A)
    got_gppo, _ = policy_loss("gppo", logp, old, adv, mask, **kwargs())
    torch.testing.assert_close(got_gppo, want_grpo)


def test_metrics_against_direct_counts():
    logp, old, adv, mask = random_batch(seed=13)
    _, metrics = policy_loss("ce_gppo", logp, old, adv, mask, **kwargs())
    summary = losses.summarize_metrics(metrics)
    w = (logp - old).exp()[mask]
    a = adv[mask]
    ln = (w < 1 - EPS_LOW) & (a < 0)
    hp = (w > 1 + EPS_HIGH) & (a > 0)
    assert summary["tokens"] == mask.sum().item()  # exact: a count
    assert summary["region/LN_frac"] == pytest.approx(ln.double().mean().item())
    assert summary["region/HP_frac"] == pytest.approx(hp.double().mean().item())
    assert summary["clip_frac"] == pytest.approx((ln | hp).double().mean().item())
    assert summary["F/LN_mean"] == pytest.approx(BETA1 * (1 - EPS_LOW))
    assert summary["F/HP_max"] == pytest.approx(BETA2 * (1 + EPS_HIGH))
    assert summary["ratio/mean"] == pytest.approx(w.mean().item())
    assert summary["ratio/min"] == pytest.approx(w.min().item())
    assert summary["ratio/max"] == pytest.approx(w.max().item())
    fracs = sum(summary[f"region/{r}_frac"] for r in losses.REGIONS)
    assert fracs == pytest.approx(1.0)


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_weight_on_grad_pi_per_region_against_the_reference_table(method):
    """F / w per region (mean and max), the paper's W pi_old, from the independent F table; it
    stays bounded in LN for DGPO (F / w = (w / (1 - eps))^n) and not for GPPO (F / w = lo / w)."""
    logp, old, adv, mask = random_batch(seed=17)
    logp[0, :4], adv[0, :4], mask[0, :4] = old[0, :4] - 12.0, -1.0, True  # w ~ 6e-6, LN
    _, metrics = policy_loss(method, logp, old, adv, mask, **kwargs(n=1, m=2))
    summary = losses.summarize_metrics(metrics)
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    per_region = {r: [] for r in losses.REGIONS}
    for w, a in zip((logp - old).exp()[mask].tolist(), adv[mask].tolist()):
        region = ("LN" if w < lo and a < 0 else "HP" if w > hi and a > 0 else
                  "LP" if w < lo and a > 0 else "HN" if w > hi and a < 0 else "M")
        per_region[region].append(reference_F(method, w, a, 1, 2) / w)
    for region, values in per_region.items():
        assert values, region  # the batch covers every region
        assert summary[f"F_over_w/{region}_mean"] == pytest.approx(np.mean(values), rel=1e-9)
        assert summary[f"F_over_w/{region}_max"] == pytest.approx(max(values), rel=1e-9)
    if method == "dgpo":
        assert summary["F_over_w/LN_max"] <= 1.0
    if method == "gppo":
        assert summary["F_over_w/LN_max"] > 1e5


def test_empty_mask_gives_zero_loss_and_nan_free_summary():
    logp, old, adv, _ = random_batch(shape=(5,))
    mask = torch.zeros(5, dtype=torch.bool)
    loss, metrics = policy_loss("dgpo", logp.requires_grad_(True), old, adv, mask)
    assert loss.item() == 0.0  # exact: every term is torch.where's 0
    summary = losses.summarize_metrics(metrics)
    assert summary["tokens"] == 0 and math.isnan(summary["ratio/mean"])


@pytest.mark.parametrize("bad, match", [
    (dict(method="ppo"), "unknown method 'ppo'"),
    (dict(n=0), r"n must be >= 1, got 0"),
    (dict(m=1.5), "m must be an integer, got 1.5"),
    (dict(n=True), "n must be a number >= 1, got True"),
    (dict(eps_low=1.0), r"eps_low must be in \(0, 1\), got 1.0"),
    (dict(eps_high=-0.1), "eps_high must be > 0, got -0.1"),
    (dict(aspo_eps_low=0.0), r"aspo_eps_low must be in \(0, 1\)"),
    (dict(gspo_eps_low=1.5), r"gspo_eps_low must be in \(0, 1\)"),
    (dict(gspo_eps_high=0.0), "gspo_eps_high must be > 0"),
    (dict(beta1=-1.0), "beta1 must be >= 0"),
    (dict(beta2=math.inf), "beta2 must be a finite number >= 0"),
    (dict(num_tokens=0), "num_tokens must be a positive scalar"),
    (dict(shape_mismatch=True), "advantages has shape"),
])
def test_bad_arguments_raise(bad, match):
    logp, old, adv, mask = random_batch(shape=(2, 5))
    args = dict(method="dgpo")
    args.update(bad)
    if args.pop("shape_mismatch", False):
        adv = adv[:, :3]
    method = args.pop("method")
    num_tokens = args.pop("num_tokens", None)
    with pytest.raises(ValueError, match=match):
        policy_loss(method, logp, old, adv, mask, LossHyperparams(**args), num_tokens=num_tokens)


def test_cli_self_check_and_plot(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "losscheck.py"
    spec = importlib.util.spec_from_file_location("losscheck", path)
    losscheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(losscheck)
    out = tmp_path / "f.png"
    assert losscheck.main(["--n", "2", "--m", "3", "--plot", str(out)]) == 0
    assert out.stat().st_size > 20_000


def _grouped_batch(group_size=4, groups=3, seed=3):
    """Prompt groups of responses of unequal lengths, flattened to tokens: per-token tensors
    [T], the sample of each token, and the response lengths [B]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (group_size * groups,), generator=gen)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    logp, old, _, _ = random_batch(shape=(len(sample),), seed=seed)
    adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)[sample]
    return logp, old, adv, sample, lengths


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
@pytest.mark.parametrize("method", ["dgpo", "grpo"])
def test_each_aggregation_gradient_is_its_formula(aggregation, method):
    """grad = -F A / (N), -F A / (T_g #groups), -F A / (L_i #samples): written per token."""
    G, groups = 4, 3
    logp, old, adv, sample, lengths = _grouped_batch(G, groups)
    logp.requires_grad_(True)
    mask = torch.ones_like(logp, dtype=torch.bool)
    sample_w = losses.sample_loss_weights(lengths, G, aggregation)
    weights = None if sample_w is None else sample_w[sample]
    normaliser = mask.sum() if weights is None else weights.sum()
    loss, _ = policy_loss(method, logp, old, adv, mask, **kwargs(), num_tokens=normaliser,
                          weights=weights)
    loss.backward()
    w = (logp.detach() - old).exp()
    group_tokens = [int(lengths[g * G:(g + 1) * G].sum()) for g in range(groups)]
    want = np.zeros(len(logp))
    for t in range(len(logp)):
        i = int(sample[t])
        f = reference_F(method, w[t].item(), adv[t].item(), 1, 2)
        denominator = {"token_mean": len(logp),
                       "group_token_mean": group_tokens[i // G] * groups,
                       "seq_mean_token_mean": int(lengths[i]) * len(lengths)}[aggregation]
        want[t] = -f * adv[t].item() / denominator
    np.testing.assert_allclose(logp.grad.numpy(), want, rtol=1e-12, atol=1e-15)
    if weights is not None:  # the normaliser is the number of groups / samples
        assert float(normaliser) == pytest.approx(
            groups if aggregation == "group_token_mean" else len(lengths), rel=1e-14)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_filtered_samples_get_zero_weight_and_the_loss_is_the_kept_samples_alone(aggregation):
    """The overlong filter's ``keep`` (single samples: one of group 0, the whole of group 1):
    weight 0 on exactly those samples, and the gradient is each aggregation's formula over the
    kept samples only (T_g, #groups and #samples counting what is kept)."""
    G, groups = 4, 3
    logp, old, adv, sample, lengths = _grouped_batch(G, groups)
    filtered = {1, 4, 5, 6, 7}
    keep = torch.tensor([i not in filtered for i in range(G * groups)])
    sample_w = losses.sample_loss_weights(lengths, G, aggregation, keep)
    # exact: 0 is written for the filtered, 1 / k > 0 for the kept
    assert [i for i, c in enumerate(sample_w.tolist()) if c == 0] == sorted(filtered)
    weights = sample_w[sample]
    valid = weights > 0  # what train_step's _valid_and_weights keeps
    logp.requires_grad_(True)
    loss, metrics = policy_loss("dgpo", logp, old, adv, valid, **kwargs(),
                                num_tokens=weights.sum(), weights=weights)
    loss.backward()
    kept = [i for i in range(G * groups) if i not in filtered]
    group_tokens = {g: sum(int(lengths[i]) for i in kept if i // G == g) for g in range(groups)}
    kept_groups = sum(1 for t in group_tokens.values() if t)
    kept_tokens = sum(int(lengths[i]) for i in kept)
    w = (logp.detach() - old).exp()
    want = np.zeros(len(logp))
    for t in range(len(logp)):
        i = int(sample[t])
        if i in filtered:
            continue
        f = reference_F("dgpo", w[t].item(), adv[t].item(), 1, 2)
        denominator = {"token_mean": kept_tokens,
                       "group_token_mean": group_tokens[i // G] * kept_groups,
                       "seq_mean_token_mean": int(lengths[i]) * len(kept)}[aggregation]
        want[t] = -f * adv[t].item() / denominator
    np.testing.assert_allclose(logp.grad.numpy(), want, rtol=1e-12, atol=1e-15)
    assert not logp.grad[torch.isin(sample, torch.tensor(sorted(filtered)))].any()
    assert metrics["tokens_count"].item() == kept_tokens  # exact: a count of tokens


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_a_fully_filtered_mini_batch_has_no_token_and_no_gradient(aggregation):
    """Every sample truncated: every weight 0, no valid token, a loss of 0 with a zero (not NaN)
    gradient at the scale train_step uses when N = 0 (it then skips the optimizer step)."""
    G, groups = 4, 2
    logp, old, adv, sample, lengths = _grouped_batch(G, groups)
    none_kept = torch.zeros(G * groups, dtype=torch.bool)
    sample_w = losses.sample_loss_weights(lengths, G, aggregation, none_kept)
    assert not sample_w.any()
    weights = sample_w[sample]
    valid = weights > 0
    assert not valid.any()
    logp.requires_grad_(True)
    loss, _ = policy_loss("dgpo", logp, old, adv, valid, **kwargs(), num_tokens=1.0,
                          weights=weights)
    loss.backward()
    assert loss.item() == 0.0  # exact: a sum of no terms
    assert not logp.grad.any() and torch.isfinite(logp.grad).all()


def test_sample_loss_weights_keep_and_errors():
    lengths = torch.tensor([2, 3, 5, 4])
    assert losses.sample_loss_weights(lengths, 2, "token_mean") is None
    keep = torch.tensor([False, False, True, True])
    # exact: weights 0 and 1; below, one correctly rounded IEEE division of integers (1.0 / 9)
    # in torch as in Python
    assert losses.sample_loss_weights(lengths, 2, "token_mean", keep).tolist() == [0, 0, 1, 1]
    assert losses.sample_loss_weights(lengths, 2, "group_token_mean", keep).tolist() == \
        [0, 0, 1 / 9, 1 / 9]  # exact: one division of integers
    assert losses.sample_loss_weights(lengths, 2, "seq_mean_token_mean").tolist() == \
        [1 / 2, 1 / 3, 1 / 5, 1 / 4]  # exact: one division of integers each
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        losses.sample_loss_weights(lengths, 2, "mean")
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        losses.sample_loss_weights(lengths, 3, "group_token_mean")
    with pytest.raises(ValueError, match="at least one token"):
        losses.sample_loss_weights(torch.tensor([0, 1]), 2, "seq_mean_token_mean")


# --------------------------------------------------------------------------- GRPO dual clip

def verl_dual_clip_ppo(logp, old, adv, mask, eps_low, eps_high, c):
    """verl's dual-clip PPO loss (``compute_policy_loss_vanilla``, token-mean over ``mask``),
    written directly from its formula so that autograd gives the reference gradient: per token
    max(-w A, -clip(w) A), and for A < 0 the min of that with -c A; ratio = exp(clamp(log w))."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.minimum(-adv * c, clip1)
    per_token = torch.where(adv < 0, clip2, clip1)
    m = mask.to(per_token.dtype)
    clipfrac = ((pg2 > pg1).to(m.dtype) * m).sum() / m.sum()
    clipfrac_lower = ((clip1 > -adv * c) & (adv < 0)).to(m.dtype).mul(m).sum() / m.sum()
    return (per_token * m).sum() / m.sum(), clipfrac, clipfrac_lower


def _dual_clip_batch(c):
    """Tokens on every side of every boundary (eps 0.2 / 0.28, dual clip c), plus random ones:
    A < 0 with w < 1-eps_low, inside, between 1+eps_high and c, just below and above c, far
    above c and past the log-ratio clamp; A > 0 below, inside, above 1+eps_high and above c;
    A = 0 above c; and masked garbage."""
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    ws = [0.3, 0.7, 0.95, 1.05, 1.2, 0.5 * (hi + c), c * (1 - 1e-6), c * (1 + 1e-6), 2 * c, 50.0,
          math.exp(25.0),                                # A < 0
          0.3, 0.95, 1.2, 0.5 * (hi + c), c * (1 + 1e-6), 2 * c, 50.0,  # A > 0
          2 * c]                                         # A = 0
    advs = [-1.3] * 11 + [0.8] * 7 + [0.0]
    assert min(ws[:11]) < lo and sum(w > c for w in ws[:11]) >= 4 and ws[6] < c < ws[7]
    log_w = torch.tensor([math.log(w) for w in ws], dtype=torch.float64)
    adv = torch.tensor(advs, dtype=torch.float64)
    r_logp, r_old, r_adv, r_mask = random_batch(shape=(120,), seed=21)
    old = torch.cat([torch.full_like(log_w, -2.0), r_old, torch.tensor([3e3, -1e4])])
    logp = torch.cat([log_w - 2.0, r_logp, torch.tensor([-5e3, 7.0])])
    adv = torch.cat([adv, r_adv, torch.tensor([-9.0, 4.0])])
    mask = torch.cat([torch.ones_like(log_w, dtype=torch.bool), r_mask,
                      torch.tensor([False, False])])
    return logp, old, adv, mask


@pytest.mark.parametrize("c", [3.0, 1.5, 1.1])  # 1.1 < 1+eps_high: the cut reaches into M
def test_grpo_dual_clip_matches_verls_formula(c):
    logp, old, adv, mask = _dual_clip_batch(c)
    hp = LossHyperparams(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=c)
    ours_in = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss("grpo", ours_in, old, adv, mask, hp)
    (grad,) = torch.autograd.grad(loss, ours_in)

    ref_in = logp.clone().requires_grad_(True)
    ref_loss, clipfrac, clipfrac_lower = verl_dual_clip_ppo(ref_in, old, adv, mask, EPS_LOW,
                                                           EPS_HIGH, c)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_in)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-18)

    # the F table: 0 in LN, HP and where A < 0 and w > c, w elsewhere (w taken clamped)
    w = (logp - old).clamp(-20, 20).exp()
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    want_f = [0.0 if (wi < lo and a < 0) or (wi > hi and a > 0) or (a < 0 and wi > c) else wi
              for wi, a in zip(w.tolist(), adv.tolist())]
    f = losses.coefficient("grpo", (logp - old).clamp(-20, 20), adv, hp)
    torch.testing.assert_close(f, torch.tensor(want_f, dtype=torch.float64), rtol=1e-15, atol=0)
    num_tokens = mask.sum()
    torch.testing.assert_close(grad, torch.where(mask, -f * adv / num_tokens, 0.0),
                               rtol=1e-14, atol=0)

    # the named tokens (A < 0 first): dual-clipped ones have no gradient, the others below c
    # outside LN keep F = w; their value is c A (checked through the loss above)
    head = slice(0, 19)
    dual = (adv[head] < 0) & (w[head] > c)
    assert dual.sum() >= 4 and torch.all(grad[head][dual] == 0)  # exact: F = 0 there (torch.where)
    kept = (adv[head] < 0) & (w[head] <= c) & (w[head] >= lo)
    # exact: must differ from 0: F A / N with F = w >= 0.8 and A = -1.3
    assert kept.sum() >= 3 and torch.all(grad[head][kept] != 0)
    if c > hi:  # HN tokens between 1+eps_high and c are not cut
        assert torch.all(grad[head][kept & (w[head] > hi)] != 0)  # exact: must differ from 0
        assert (kept & (w[head] > hi)).sum() >= 2

    summary = losses.summarize_metrics(metrics)
    assert summary["dual_clip_frac"] == pytest.approx(clipfrac_lower.item(), rel=1e-14)
    assert summary["clip_frac"] == pytest.approx(clipfrac.item(), rel=1e-14)
    valid_w, valid_a = w[mask], adv[mask]
    assert summary["dual_clip_frac"] == pytest.approx(
        ((valid_a < 0) & (valid_w > c)).double().mean().item(), rel=1e-14)


def test_dual_clip_leaves_non_negative_advantages_untouched():
    logp, old, adv, mask = _dual_clip_batch(3.0)
    keep = mask & (adv >= 0)
    results = []
    for c in (None, 3.0):
        lp = logp.clone().requires_grad_(True)
        hp = LossHyperparams(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=c)
        loss, _ = policy_loss("grpo", lp, old, adv, keep, hp)
        results.append((loss, *torch.autograd.grad(loss, lp)))
    # exact: the only tokens kept have A >= 0, where torch.where picks the same PPO values: the
    # same sum of the same values
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    # exact: the gradient likewise
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    # A > 0 above c (HP) keeps PPO's value (1+eps_high) A and zero gradient
    assert ((adv > 0) & keep & ((logp - old).exp() > 3.0)).sum() >= 3


def _pre_dual_clip_grpo(logp, old, adv, mask):
    """The grpo loss as losses.py computed it before dual clip existed, op for op."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        logp_d = torch.where(valid, logp, zero)
        a = torch.where(valid, adv, zero)
        log_w = torch.where(valid, logp_d - old, zero).clamp(-20.0, 20.0)
        low, high = log_w < math.log1p(-EPS_LOW), log_w > math.log1p(EPS_HIGH)
        w = log_w.exp()
        f = torch.where((low & (a < 0)) | (high & (a > 0)), torch.zeros_like(w), w)
        clipped = w.clamp(1.0 - EPS_LOW, 1.0 + EPS_HIGH)
        value = torch.where(valid, torch.minimum(w * a, clipped * a), zero)
        slope = torch.where(valid, f * a, zero)
    return -(value + slope * (logp - logp.detach())).sum() / valid.sum().clamp(min=1).double()


def test_dual_clip_off_by_default_is_bit_identical():
    assert LossHyperparams().dual_clip is None
    logp, old, adv, mask = _dual_clip_batch(3.0)
    hp = LossHyperparams(eps_low=EPS_LOW, eps_high=EPS_HIGH)
    lp, ref = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss, metrics = policy_loss("grpo", lp, old, adv, mask, hp)
    want = _pre_dual_clip_grpo(ref, old, adv, mask)
    # exact: _pre_dual_clip_grpo is the old code op for op: the same ops in the same order on the
    # same inputs
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(want, ref)[0],
                               rtol=0, atol=0)  # exact: its gradient likewise
    # nothing new in the metrics when off
    assert "dual_clipped_count" not in metrics
    assert "dual_clip_frac" not in losses.summarize_metrics(metrics)
    # and the off case really differs from c = 3 on this batch (tokens with A < 0, w > 3)
    on, _ = policy_loss("grpo", logp, old, adv, mask, LossHyperparams(eps_low=EPS_LOW,
                                                                      eps_high=EPS_HIGH,
                                                                      dual_clip=3.0))
    assert not torch.equal(on, loss.detach())  # exact: must differ (c = 3 cuts tokens of this batch)


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0, 0, math.inf, math.nan, "3.0", True, [3.0]])
def test_bad_dual_clip_names_the_field(bad):
    with pytest.raises(ValueError, match=r"dual_clip must be (a |a finite )?(number )?> 1"):
        LossHyperparams(dual_clip=bad)


def test_dual_clip_accepts_an_integer_as_a_float():
    assert LossHyperparams(dual_clip=3).dual_clip == 3.0
    assert isinstance(LossHyperparams(dual_clip=3).dual_clip, float)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "grpo"])
def test_dual_clip_is_refused_by_the_other_methods(method):
    logp, old, adv, mask = random_batch(shape=(2, 5))
    with pytest.raises(ValueError, match=rf"dual_clip \(algorithm.loss.dual_clip = 3.0\) applies "
                                         rf"to method grpo only .* not '{method}'"):
        policy_loss(method, logp, old, adv, mask, LossHyperparams(dual_clip=3.0))


def test_dual_clip_errors_from_a_recipe_name_the_key():
    from megatron_dgpo.recipe import AlgorithmConfig
    from megatron_dgpo.runtime.config import ConfigError, from_dict

    cfg = from_dict(AlgorithmConfig, {"method": "grpo", "loss": {"dual_clip": 3}})
    assert cfg.loss.dual_clip == 3.0
    with pytest.raises(ConfigError, match=r"algorithm.loss.dual_clip must be > 1, got 1.0"):
        from_dict(AlgorithmConfig, {"method": "grpo", "loss": {"dual_clip": 1.0}}, "algorithm")
    with pytest.raises(ConfigError, match=r"algorithm.loss.dual_clip: expected float \| null"):
        from_dict(AlgorithmConfig, {"method": "grpo", "loss": {"dual_clip": "three"}}, "algorithm")
    with pytest.raises(ConfigError, match=r"algorithm: dual_clip \(algorithm.loss.dual_clip = "
                                          r"3.0\) applies to method grpo only .* not 'dgpo'"):
        from_dict(AlgorithmConfig, {"method": "dgpo", "loss": {"dual_clip": 3.0}}, "algorithm")
