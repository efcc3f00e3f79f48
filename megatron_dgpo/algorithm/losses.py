"""Policy-gradient losses of the DGPO paper's unified estimator (its Eq. 1).

Every method here is one choice of the coefficient F in

    grad J = 1/N * sum_t  F_t * A_t * grad log pi_theta(o_t),      w_t = pi_theta / pi_old,

where N is the number of valid tokens of the whole mini-batch (``token_mean``; the other
aggregations of ``AGGREGATIONS`` weight each token by c_t and divide by sum_t c_t instead, see
``sample_loss_weights``; ``truncated_is_weights`` adds the TIS factor). F depends on the region
a token falls in (paper, Table 1), set by the ratio w and the sign of the advantage A:

    LN: w < 1-eps_low  and A < 0        HP: w > 1+eps_high and A > 0
    LP: w < 1-eps_low  and A > 0        HN: w > 1+eps_high and A < 0
    M : everything else (A = 0 included)

    method    F
    grpo      0 in LN and HP; w elsewhere                                     (PPO clip)
              with ``dual_clip`` c: also 0 where A < 0 and w > c             (dual-clip PPO)
    cispo     clip(w, 1-eps_low, 1+eps_high) everywhere
    gppo      1-eps_low in LN; 1+eps_high in HP; w elsewhere
    ce_gppo   beta1*(1-eps_low) in LN; beta2*(1+eps_high) in HP; w elsewhere
    aspo      0 in LN and HP; else A > 0: 1-eps'_low if w < 1-eps'_low, else 1/w
                                     A < 0: 1+eps'_high if w > 1+eps'_high, else w
    dgpo      w^(n+1) / (1-eps_low)^n in LN; (1+eps_high)^(1/m) * w^(1-1/m) in HP; w elsewhere

How the loss is built. ``policy_loss`` returns ``-(1/N) sum_t mask_t * s_t`` with the per-token
surrogate

    s_t = J_t + F_t * A_t * (log pi_t - sg[log pi_t]),

where J_t (the value of each paper's objective) and F_t are computed from detached,
masked and clamped log-ratios. The only differentiable operation is linear in log pi, so
``d loss / d logprobs[t] = -mask[t] * F[t] * A[t] / num_tokens`` holds exactly, and no branch a
``torch.where`` discards can leak a NaN into the gradient (the failure of ``0 * inf`` in the
gradient of an unselected ``exp`` branch). Log-ratios are clamped to +-LOG_RATIO_CLAMP (w in
[2e-9, 4.9e8]) before F is formed: F is the table above for every ratio a trust region could
still care about, and F * A stays finite in float32 sums over millions of tokens.

``dual_clip`` (``grpo`` only), the objective values J_t the loss reports, and how the log-ratio
clamp and the token mean differ from the paper's official code: docs/losses.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Literal

import torch
from torch import Tensor

from megatron_dgpo.runtime.config import require_choice

METHODS = ("grpo", "cispo", "gppo", "ce_gppo", "aspo", "dgpo")
AGGREGATIONS = ("token_mean", "group_token_mean", "seq_mean_token_mean")
"""How token terms are averaged (``sample_loss_weights``)."""
ROLLOUT_CORRECTIONS = ("none", "tis")
"""Off-policy correction for the rollout engine's sampler (``truncated_is_weights``)."""
REGIONS = ("LN", "HP", "LP", "HN", "M")
DUAL_CLIP_METHODS = ("grpo",)
"""Methods that accept ``LossHyperparams.dual_clip`` (dual-clip PPO: a cut of PPO's value)."""

# ln(4.9e8): past this a token's ratio has left any trust region by eight orders of magnitude.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossHyperparams:
    """Hyper-parameters of ``policy_loss``; the defaults are the paper's (Appendix B, Table 5)."""

    eps_low: float = 0.2
    """Lower clip range: the trust region's left edge is w = 1 - eps_low. In (0, 1)."""
    eps_high: float = 0.2
    """Upper clip range: the trust region's right edge is w = 1 + eps_high. Positive."""
    n: int = 1
    """DGPO left-boundary decay power: F = w^(n+1)/(1-eps_low)^n in LN. Positive integer."""
    m: int = 2
    """DGPO right-boundary root: F = (1+eps_high)^(1/m) w^(1-1/m) in HP. Positive integer."""
    beta1: float = 0.75
    """CE-GPPO scale of the LN gradient weight (F = beta1 (1-eps_low))."""
    beta2: float = 1.0
    """CE-GPPO scale of the HP gradient weight (F = beta2 (1+eps_high))."""
    aspo_eps_low: float = 0.33
    """ASPO soft dual-clip for positive advantages: F = 1-aspo_eps_low when w < 1-aspo_eps_low."""
    aspo_eps_high: float = 3.0
    """ASPO soft dual-clip for negative advantages: F = 1+aspo_eps_high when w > 1+aspo_eps_high."""
    dual_clip: float | None = None
    """Dual-clip PPO constant c (Ye et al. 2020; verl's ``clip_ratio_c``), method ``grpo`` only
    (the others refuse it). For A < 0 the token objective becomes max(min(w A, clip(w) A), c A):
    where A < 0 and w > c its value is the constant c A and its gradient 0 (logged as
    ``dual_clip_frac``); A >= 0 and w <= c are unchanged. A finite number > 1; 3.0 is verl's
    default and the GRPO baseline of the paper's official code. null (default): off, GRPO as
    the paper's Eq. 2 writes it."""

    def __post_init__(self):
        for name in ("n", "m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, low, high in (("eps_low", 0.0, 1.0), ("aspo_eps_low", 0.0, 1.0)):
            value = getattr(self, name)
            if not low < value < high:
                raise ValueError(f"{name} must lie in ({low}, {high}), got {value!r}")
        for name in ("eps_high", "aspo_eps_high"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        c = self.dual_clip
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, Real) or not (math.isfinite(c) and c > 1):
                raise ValueError(f"dual_clip must be null (off) or a finite number > 1 (verl's "
                                 f"clip_ratio_c; 3.0 is the official GRPO baseline), got {c!r}")
            object.__setattr__(self, "dual_clip", float(c))


@dataclass
class LossConfig:
    """The policy loss of one update: the method and its hyper-parameters, how token terms are
    aggregated over a mini-batch, and the rollout correction. A recipe's ``algorithm`` section
    is one (``recipe.AlgorithmConfig`` adds the advantages and DAPO's filter), and
    ``train_step`` takes it as it is."""

    method: str = "dgpo"
    """One of dgpo, grpo, cispo, gppo, ce_gppo, aspo (``megatron_dgpo.algorithm.losses.METHODS``)."""
    loss: LossHyperparams = field(default_factory=LossHyperparams)
    """Clip ranges and each method's own constants (DGPO n, m; CE-GPPO beta1, beta2; ASPO;
    GRPO's optional ``dual_clip``, which the other methods refuse). How they and the log-ratio
    clamp differ from the paper's official code: docs/losses.md."""
    loss_aggregation: Literal["token_mean", "group_token_mean",
                              "seq_mean_token_mean"] = "token_mean"
    """How token terms s are averaged over a mini-batch (``losses.sample_loss_weights``).
    ``token_mean``: sum_t s_t / (valid tokens of the whole mini-batch, over every micro-batch
    and DP rank), DAPO's token mean. Not exactly the paper's official code (verl's
    ``token-mean``): there each micro-batch's loss is its own token mean, scaled by 1 / (the
    gradient-accumulation steps) and the gradients averaged over DP ranks, so tokens of short
    micro-batches weigh more; the two agree only when every micro-batch holds the same number
    of valid tokens, which packed micro-batches seldom do. Kept: every token of the mini-batch
    gets the same weight 1/N, so the gradient does not depend on how the mini-batch is split
    over TP/PP/DP ranks and micro-batches (tested). ``group_token_mean``: the
    paper's Eq. 1, each prompt group's token sum divided by that group's token count
    sum_i |o_i|, then the mean over the mini-batch's groups. ``seq_mean_token_mean``: each
    response's token mean, averaged over the responses."""
    rollout_correction: Literal["none", "tis"] = "none"
    """``tis``: multiply each token's loss term by the truncated importance weight
    min(pi_old / pi_rollout, rollout_correction_cap) (no gradient through it; verl, NeMo-RL),
    correcting for the rollout engine's sampler differing from the trainer (bf16, kernels).
    Logged as ``train/tis/*``. ``none``: no correction (the mismatch is still measured)."""
    rollout_correction_cap: float = 2.0
    """TIS truncation C (>= 1): importance weights above it are cut to it."""

    def __post_init__(self):
        require_choice("method", self.method, METHODS)
        check_method(self.method, self.loss)  # loss.dual_clip with a method that refuses it
        require_choice("loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        require_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        cap = self.rollout_correction_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (
                math.isfinite(cap) and cap >= 1):
            raise ValueError(f"rollout_correction_cap must be a finite number >= 1, got {cap!r}")


@dataclass(frozen=True)
class Regions:
    """Boolean masks of the five regions of paper Table 1 (M is the complement of the rest)."""

    LN: Tensor
    HP: Tensor
    LP: Tensor
    HN: Tensor
    M: Tensor

    @staticmethod
    def classify(log_w: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Regions:
        low = log_w < math.log1p(-eps_low)
        high = log_w > math.log1p(eps_high)
        pos, neg = advantages > 0, advantages < 0
        ln, hp, lp, hn = low & neg, high & pos, low & pos, high & neg
        return Regions(LN=ln, HP=hp, LP=lp, HN=hn, M=~(ln | hp | lp | hn))


def _dual_clipped(log_w: Tensor, advantages: Tensor, hp: LossHyperparams) -> Tensor:
    """Tokens whose PPO value dual clip replaces by c A (A < 0 and w > c); all False when off."""
    if hp.dual_clip is None:
        return torch.zeros_like(log_w, dtype=torch.bool)
    return (advantages < 0) & (log_w > math.log(hp.dual_clip))


def _grpo(w, log_w, advantages, regions, hp):
    clipped = regions.LN | regions.HP
    if hp.dual_clip is not None:
        clipped = clipped | _dual_clipped(log_w, advantages, hp)
    return torch.where(clipped, torch.zeros_like(w), w)


def _cispo(w, log_w, advantages, regions, hp):
    return w.clamp(1.0 - hp.eps_low, 1.0 + hp.eps_high)


def _gppo(w, log_w, advantages, regions, hp):
    return torch.where(regions.LN, 1.0 - hp.eps_low,
                       torch.where(regions.HP, 1.0 + hp.eps_high, w))


def _ce_gppo(w, log_w, advantages, regions, hp):
    return torch.where(regions.LN, hp.beta1 * (1.0 - hp.eps_low),
                       torch.where(regions.HP, hp.beta2 * (1.0 + hp.eps_high), w))


def _aspo(w, log_w, advantages, regions, hp):
    pos_floor, neg_cap = 1.0 - hp.aspo_eps_low, 1.0 + hp.aspo_eps_high
    positive = torch.where(w < pos_floor, pos_floor, (-log_w).exp())  # 1/w, never 1/0
    negative = torch.where(w > neg_cap, neg_cap, w)
    f = torch.where(advantages > 0, positive, torch.where(advantages < 0, negative, w))
    return torch.where(regions.LN | regions.HP, torch.zeros_like(w), f)


def _dgpo(w, log_w, advantages, regions, hp):
    # LN: W = C_left sg[pi]^n with C_left = (1-eps_low)^-n pi_old^-(n+1), so F = W pi =
    #     w^(n+1) / (1-eps_low)^n; equals w at w = 1-eps_low and -> 0 as w -> 0.
    # HP: W = C_right sg[pi]^(-1/m) with C_right = (1+eps_high)^(1/m) pi_old^(1/m-1), so
    #     F = (1+eps_high)^(1/m) w^(1-1/m); equals w at w = 1+eps_high, grows sub-linearly.
    log_lo, log_hi = math.log(1.0 - hp.eps_low), math.log(1.0 + hp.eps_high)
    left = ((hp.n + 1) * log_w.clamp(max=log_lo) - hp.n * log_lo).exp()
    right = (log_hi / hp.m + (1.0 - 1.0 / hp.m) * log_w.clamp(min=log_hi)).exp()
    return torch.where(regions.LN, left, torch.where(regions.HP, right, w))


COEFFICIENTS = {"grpo": _grpo, "cispo": _cispo, "gppo": _gppo, "ce_gppo": _ce_gppo,
                "aspo": _aspo, "dgpo": _dgpo}
"""method -> F(w, log_w, advantages, regions, hp): the table of the module docstring. A new
method is one function here (and its objective value in ``_objective`` if it is not F A)."""
assert tuple(COEFFICIENTS) == METHODS


def check_method(method: str, hp: LossHyperparams | None = None) -> None:
    """Raise ``ValueError`` unless ``method`` is known and takes the options set in ``hp``."""
    if method not in COEFFICIENTS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if hp is not None and hp.dual_clip is not None and method not in DUAL_CLIP_METHODS:
        raise ValueError(f"dual_clip (algorithm.loss.dual_clip = {hp.dual_clip}) applies to "
                         f"method {' or '.join(DUAL_CLIP_METHODS)} only (dual-clip PPO), not "
                         f"{method!r}: set it to null")


def coefficient(method: str, log_w: Tensor, advantages: Tensor, hp: LossHyperparams) -> Tensor:
    """F of the table in the module docstring, from (already clamped) log-ratios ``log_w``.

    Pure and differentiable-free: callers pass detached tensors. Every power is taken in
    log space from a log-ratio clamped into its own region, so no branch overflows.
    """
    check_method(method, hp)
    regions = Regions.classify(log_w, advantages, hp.eps_low, hp.eps_high)
    return COEFFICIENTS[method](log_w.exp(), log_w, advantages, regions, hp)


def _objective(method, f, log_w, advantages, logprobs, hp: LossHyperparams) -> Tensor:
    """Per-token value J_t of each paper's objective (docs/losses.md); detached inputs."""
    if method == "grpo":
        w = log_w.exp()
        clipped = w.clamp(1.0 - hp.eps_low, 1.0 + hp.eps_high)
        ppo = torch.minimum(w * advantages, clipped * advantages)
        if hp.dual_clip is None:
            return ppo
        return torch.where(advantages < 0, torch.maximum(ppo, hp.dual_clip * advantages), ppo)
    if method == "cispo":
        return f * advantages * logprobs
    return f * advantages


def policy_loss(method: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                mask: Tensor, hp: LossHyperparams | None = None, *,
                num_tokens=None, weights: Tensor | None = None) -> tuple[Tensor, LossMetrics]:
    """Loss of ``method`` whose gradient is the paper's unified estimator with that method's F.

    Args:
        method: one of ``METHODS``.
        hp: the hyper-parameters (a recipe's ``algorithm.loss``); default the paper's.
        logprobs: [T] or [B, T] log pi_theta of the sampled tokens; requires grad.
        old_logprobs, advantages, mask: same shape; ``mask`` is bool or 0/1 (valid tokens).
            Values under ``mask == 0`` may be any finite garbage: they never reach the result.
        num_tokens: the global normaliser N (int or scalar tensor): the number of valid tokens
            of the whole mini-batch across ranks and micro-batches. Default: ``mask.sum()``.
            With ``weights`` pass the matching normaliser (``sum_t mask_t c_t`` over the
            mini-batch for aggregation weights c; ``train_step`` does).
        weights: optional per-token multipliers c_t >= 0, same shape, no gradient taken through
            them: aggregation weights (``sample_loss_weights``) times truncated importance
            weights (``truncated_is_weights``). Default: every c_t = 1.

    Returns:
        ``(loss, metrics)``: ``loss = -(1/N) sum_t mask_t c_t s_t`` (module docstring), so that
        ``d loss / d logprobs[t] = -mask[t] * c[t] * F[t] * A[t] / N``; ``metrics`` holds detached
        float64 sums, counts, minima and maxima over this call's valid tokens (see
        ``loss_metrics``); reduce them with ``reduce_metrics`` and read them with
        ``summarize_metrics``.

    Computed in float32, or float64 when ``logprobs`` is float64.
    """
    hp = hp if hp is not None else LossHyperparams()
    check_method(method, hp)
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages,
               "mask": mask}
    if weights is not None:
        tensors["weights"] = weights
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has "
                             f"{tuple(logprobs.shape)}: all must match")
    if not logprobs.is_floating_point():
        raise TypeError(f"logprobs must be a floating tensor, got {logprobs.dtype}")

    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    valid = mask.bool()
    if num_tokens is None:
        num_tokens = valid.sum().clamp(min=1).to(dtype)
    else:
        if not torch.as_tensor(num_tokens).numel() == 1 or not float(num_tokens) > 0:
            raise ValueError(f"num_tokens must be a positive scalar, got {num_tokens!r}")
        num_tokens = torch.as_tensor(num_tokens, dtype=dtype, device=logprobs.device)

    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    logp = logprobs.to(dtype)
    with torch.no_grad():
        logp_d = torch.where(valid, logp, zero)
        adv = torch.where(valid, advantages.to(dtype), zero)
        log_w = torch.where(valid, logp_d - old_logprobs.to(dtype), zero)
        log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        f = coefficient(method, log_w, adv, hp)
        value = torch.where(valid, _objective(method, f, log_w, adv, logp_d, hp), zero)
        slope = torch.where(valid, f * adv, zero)
        if weights is not None:
            c = torch.where(valid, weights.detach().to(dtype), zero)
            value, slope = value * c, slope * c

    # Linear in logp: d/d logp = slope exactly; at masked positions slope is 0 and logp - logp
    # is 0 for any finite garbage.
    surrogate = value + slope * (logp - logp.detach())
    loss = -surrogate.sum() / num_tokens
    return loss, loss_metrics(f, log_w, adv, valid, hp)


def sample_loss_weights(response_lengths: Tensor, group_size: int, aggregation: str,
                        keep: Tensor | None = None) -> Tensor | None:
    """Per-sample aggregation weights c_i [B] float64 (every token of sample i gets c_i), or
    None when every weight is 1 (``token_mean`` with no sample left out: the unweighted path).

    Samples are laid out as consecutive prompt groups: sample i is response ``i % G`` of group
    ``i // G`` (``group_size`` = G). With L_i = |o_i| the response lengths and T_g = sum of L_i
    over group g, the loss ``sum_t c_t s_t / sum_t c_t`` over a mini-batch of whole groups is

        token_mean            c_i = 1:       (1 / sum_i L_i)  sum_i sum_t s_it         (DAPO)
        group_token_mean      c_i = 1/T_g:   (1 / #groups) sum_g (1 / T_g) sum_{i in g} sum_t s_it
                                             (the paper's Eq. 1, averaged over prompts)
        seq_mean_token_mean   c_i = 1/L_i:   (1 / #samples) sum_i (1 / L_i) sum_t s_it

    since sum_t c_t = sum_i L_i c_i is the number of tokens, groups or samples. T_g and L_i
    come from the whole group / sample, so the weights do not depend on how samples are later
    cut into micro-batches or spread over DP ranks. ``keep`` [B] bool: samples left out of the
    update (the degenerate-group filter, whole groups; the overlong filter, single samples) get
    c_i = 0, which removes them from the normaliser, and the loss is the one of the kept samples
    alone: T_g sums the kept samples of group g only, and a group with none left counts for
    nothing (c = 0 on all of it), so the normaliser is the kept tokens, groups or samples.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of "
                         f"{', '.join(AGGREGATIONS)}")
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    if lengths.dim() != 1 or group_size < 1 or lengths.numel() % group_size:
        raise ValueError(f"response_lengths of shape {tuple(lengths.shape)} do not split into "
                         f"groups of {group_size}")
    if lengths.numel() and not bool((lengths >= 1).all()):
        raise ValueError("every response needs at least one token to be weighted")
    if aggregation == "token_mean" and keep is None:
        return None
    if keep is None:
        keep = torch.ones_like(lengths, dtype=torch.bool)
    keep = torch.as_tensor(keep, dtype=torch.bool)
    if keep.shape != lengths.shape:
        raise ValueError(f"keep has shape {tuple(keep.shape)}, expected {tuple(lengths.shape)}")
    if aggregation == "token_mean":
        weights = torch.ones_like(lengths)
    elif aggregation == "group_token_mean":  # T_g over the group's kept samples (> 0 if any)
        totals = torch.where(keep, lengths, 0.0).view(-1, group_size).sum(dim=1)
        weights = (1.0 / totals.clamp(min=1.0)).repeat_interleave(group_size)
    else:
        weights = 1.0 / lengths
    return torch.where(keep, weights, 0.0)


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                         cap: float) -> tuple[Tensor, LossMetrics]:
    """Truncated importance sampling (TIS) against the rollout engine's sampler, per token:

        v_t = min(pi_old(o_t) / pi_rollout(o_t), C),      C = ``cap``,

    the weight verl and NeMo-RL multiply each token's loss term by (no gradient through it):
    the samples came from the engine's distribution, the loss's ratios are taken against the
    trainer's pi_old. Formed in log space (never overflows); 0 under ``mask == 0``.

    Args: old_logprobs, rollout_logprobs, mask: same shape ([T] or [B, T]); cap >= 1.
    Returns ``(v, metrics)`` with ``v`` detached float64 and mergeable metrics over the valid
    tokens: sums ``tis_weight_sum``, ``tis_clipped_count`` (tokens whose ratio exceeds C),
    ``tis_tokens_count``; ``tis_ratio_max`` / ``tis_ratio_min`` (the untruncated ratio, log
    clamped to +-LOG_RATIO_CLAMP). ``summarize_metrics`` turns them into ``tis/weight_mean``,
    ``tis/clip_frac``, ``tis/ratio_max``, ``tis/ratio_min``.
    """
    if not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(f"the TIS cap must be finite and >= 1, got {cap!r}")
    if not (old_logprobs.shape == rollout_logprobs.shape == mask.shape):
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} differ")
    valid = mask.bool()
    with torch.no_grad():
        log_r = torch.where(valid, old_logprobs.double() - rollout_logprobs.double(), 0.0)
        log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        weight = torch.where(valid, log_r.clamp(max=math.log(cap)).exp(), 0.0)
        ratio = log_r.exp()
        metrics = LossMetrics(
            sums={"tis_weight_sum": weight.sum(), "tis_tokens_count": valid.sum().double(),
                  "tis_clipped_count": (valid & (log_r > math.log(cap))).sum().double()},
            mins={"tis_ratio_min": torch.where(valid, ratio, math.inf).min()},
            maxs={"tis_ratio_max": torch.where(valid, ratio, -math.inf).max()})
    return weight, metrics


@dataclass
class LossMetrics(Mapping):
    """Mergeable float64 scalar statistics, grouped by how they combine across micro-batches
    and ranks: ``sums`` add (counts and sums), ``mins`` take the minimum, ``maxs`` the maximum.

    Read-only mapping over all three groups (``metrics["F_LN_max"]``); names are unique across
    groups. ``merge_metrics`` and ``reduce_metrics`` combine them exactly.
    """

    sums: dict[str, Tensor] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)

    def groups(self):
        """``(group dict, torch op, distributed op name)`` for each reduction."""
        return ((self.sums, torch.add, "SUM"), (self.mins, torch.minimum, "MIN"),
                (self.maxs, torch.maximum, "MAX"))

    def __getitem__(self, key: str) -> Tensor:
        for group in (self.sums, self.mins, self.maxs):
            if key in group:
                return group[key]
        raise KeyError(key)

    def __iter__(self):
        yield from self.sums
        yield from self.mins
        yield from self.maxs

    def __len__(self) -> int:
        return len(self.sums) + len(self.mins) + len(self.maxs)


def loss_metrics(f: Tensor, log_w: Tensor, advantages: Tensor, valid: Tensor,
                 hp: LossHyperparams) -> LossMetrics:
    """Token-level statistics as mergeable float64 scalars.

    Sums: ``tokens_count``, ``region_<R>_count``, ``F_<R>_sum``, ``Fw_<R>_sum``,
    ``ratio_sum``, ``clipped_count``; maxima: ``F_<R>_max``, ``Fw_<R>_max``, ``ratio_max``;
    minimum: ``ratio_min``. ``Fw`` is F / w, the weight a token puts on grad pi_theta (in units
    of 1 / pi_old: F A grad log pi = (F / w) A grad pi / pi_old), the quantity of the paper's
    divergence argument: it grows without bound as w -> 0 in LN when F stays constant (GPPO,
    CE-GPPO, CISPO) and stays bounded for DGPO. Region fractions, mean F and F / w per region,
    ratio mean and the GRPO clip fraction (tokens whose PPO gradient is zero: LN or HP) follow
    from them in ``summarize_metrics``. With ``hp.dual_clip`` set, also the sum
    ``dual_clipped_count`` (A < 0 and w > c: the tokens whose F dual clip sets to 0, in HN
    when c >= 1+eps_high; not counted in ``clipped_count``), read as ``dual_clip_frac``
    (verl's ``pg_clipfrac_lower``).
    """
    regions = Regions.classify(log_w, advantages, hp.eps_low, hp.eps_high)
    f64, w64 = f.double(), log_w.double().exp()
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=f.device)
    pos_inf = torch.tensor(math.inf, dtype=torch.float64, device=f.device)
    out = LossMetrics(sums={"tokens_count": valid.sum().double()})
    for name in REGIONS:
        region = getattr(regions, name) & valid
        out.sums[f"region_{name}_count"] = region.sum().double()
        out.sums[f"F_{name}_sum"] = torch.where(region, f64, 0.0).sum()
        out.maxs[f"F_{name}_max"] = torch.where(region, f64, neg_inf).max()
        out.sums[f"Fw_{name}_sum"] = torch.where(region, f64 / w64, 0.0).sum()
        out.maxs[f"Fw_{name}_max"] = torch.where(region, f64 / w64, neg_inf).max()
    out.sums["ratio_sum"] = torch.where(valid, w64, 0.0).sum()
    out.mins["ratio_min"] = torch.where(valid, w64, pos_inf).min()
    out.maxs["ratio_max"] = torch.where(valid, w64, neg_inf).max()
    out.sums["clipped_count"] = ((regions.LN | regions.HP) & valid).sum().double()
    if hp.dual_clip is not None:
        dual = _dual_clipped(log_w, advantages, hp) & valid
        out.sums["dual_clipped_count"] = dual.sum().double()
    return out


def merge_metrics(parts: list[LossMetrics]) -> LossMetrics:
    """Combine the metrics of several micro-batches exactly (each by its reduction)."""
    merged = LossMetrics()
    for part in parts:
        for (into, combine, _), (group, _, _) in zip(merged.groups(), part.groups()):
            for key, value in group.items():
                into[key] = (value.detach().clone() if key not in into
                             else combine(into[key], value))
    return merged


def reduce_metrics(metrics: LossMetrics, group=None) -> LossMetrics:
    """All-reduce ``metrics`` across ``group`` exactly, each by its reduction (collective)."""
    from megatron_dgpo.runtime import comm

    if comm.size(group) == 1:
        return metrics
    out = LossMetrics()
    for (values, _, op), (into, _, _) in zip(metrics.groups(), out.groups()):
        keys = sorted(values)
        if not keys:
            continue
        flat = comm.reduce_values(torch.stack([values[k].detach().double() for k in keys]), op.lower(), group)
        into.update(zip(keys, flat.unbind()))
    return out


def summarize_metrics(metrics: LossMetrics) -> dict[str, float]:
    """Readable numbers from (reduced) metrics: fractions, means, extremes; NaN where empty.
    Sums a train step adds (``entropy_sum``, ``loss_sum``) become per-token ``entropy`` and
    ``loss`` (the loss per unit of ``weight_sum`` when a weighted aggregation adds it); TIS sums
    (``truncated_is_weights``) become ``tis/*``; ``dual_clipped_count`` (only with
    ``dual_clip`` set) becomes ``dual_clip_frac``."""
    tokens = float(metrics["tokens_count"])

    def ratio(num, den):
        return float(num) / den if den > 0 else math.nan

    def extreme(value):
        value = float(value)
        return value if math.isfinite(value) else math.nan

    out = {"tokens": tokens}
    for name in REGIONS:
        count = float(metrics[f"region_{name}_count"])
        out[f"region/{name}_frac"] = ratio(count, tokens)
        out[f"F/{name}_mean"] = ratio(metrics[f"F_{name}_sum"], count)
        out[f"F/{name}_max"] = extreme(metrics[f"F_{name}_max"])
        out[f"F_over_w/{name}_mean"] = ratio(metrics[f"Fw_{name}_sum"], count)
        out[f"F_over_w/{name}_max"] = extreme(metrics[f"Fw_{name}_max"])
    out["ratio/mean"] = ratio(metrics["ratio_sum"], tokens)
    out["ratio/min"] = extreme(metrics["ratio_min"])
    out["ratio/max"] = extreme(metrics["ratio_max"])
    out["clip_frac"] = ratio(metrics["clipped_count"], tokens)
    if "dual_clipped_count" in metrics:
        out["dual_clip_frac"] = ratio(metrics["dual_clipped_count"], tokens)
    if "entropy_sum" in metrics:
        out["entropy"] = ratio(metrics["entropy_sum"], tokens)
    if "loss_sum" in metrics:  # weighted aggregations divide by the weights' sum, not tokens
        out["loss"] = ratio(metrics["loss_sum"], float(metrics.get("weight_sum", tokens)))
    if "tis_weight_sum" in metrics:
        tis_tokens = float(metrics["tis_tokens_count"])
        out["tis/weight_mean"] = ratio(metrics["tis_weight_sum"], tis_tokens)
        out["tis/clip_frac"] = ratio(metrics["tis_clipped_count"], tis_tokens)
        out["tis/ratio_max"] = extreme(metrics["tis_ratio_max"])
        out["tis/ratio_min"] = extreme(metrics["tis_ratio_min"])
    return out
