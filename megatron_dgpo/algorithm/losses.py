"""Policy-gradient losses of the DGPO paper's unified estimator (its Eq. 1), with a behaviour weight.

Every method here is one choice of the coefficient F in

    grad J = 1/W * sum_t  c_t v_t F_t A_t grad log pi_theta(o_t),     w_t = pi_theta / pi_prox,

c_t the aggregation weight (``sample_loss_weights``; W = sum_t c_t, the valid tokens N for
``token_mean``), v_t the behaviour weight of ``algorithm.rollout_correction`` computed from
pi_prox / pi_behav (``behaviour_weights``; 1 when off). F depends on the region a token falls
in (paper, Table 1), set by the ratio w and the sign of the advantage A:

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
    gspo      grpo's F of the sample's ratio s_i = exp(mean_t log w_t) with GSPO's eps

``policy_loss`` returns ``-(1/W) sum_t mask_t c_t v_t s_t`` with the per-token surrogate
s_t = J_t + F_t A_t (log pi_t - sg[log pi_t]): J_t (each objective's value) and F_t come from
detached, masked, clamped (+-LOG_RATIO_CLAMP) log-ratios, so the only differentiable operation
is linear in log pi and ``d loss / d logprobs[t] = -mask_t c_t v_t F_t A_t / W`` exactly, with no
NaN from an unselected ``torch.where`` branch. The objectives, the behaviour weights and how
they differ from the paper's official code and the anchors: docs/losses.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Integral
from typing import Annotated, Literal

import torch
from torch import Tensor

from megatron_dgpo.runtime.config import Bounds, check_bounds, require_choice

METHODS = ("grpo", "cispo", "gppo", "ce_gppo", "aspo", "dgpo", "gspo")
SEQUENCE_METHODS = ("gspo",)
"""Methods whose ratio is a sample's: ``policy_loss`` needs ``segments`` for them."""
TOKEN_METHODS = tuple(m for m in METHODS if m not in SEQUENCE_METHODS)
AGGREGATIONS = ("token_mean", "group_token_mean", "seq_mean_token_mean")
"""How token terms are averaged (``sample_loss_weights``)."""
ROLLOUT_CORRECTIONS = ("none", "tis", "token_mask", "sequence_tis", "sequence_mask",
                       "geometric_mask")
"""The behaviour weight v_t from pi_prox / pi_behav (``behaviour_weights``)."""
MASK_BANDS = {"token_mask": (0.5, 5.0), "sequence_mask": (0.5, 2.0),
              "geometric_mask": (0.999, 1.001)}
"""Each masking correction's default [low, high] (IcePop's; verl's ``decoupled_seq_is_rs`` and
``decoupled_geo_rs``)."""
OLD_LOGPROBS = ("trainer", "rollout")
REGIONS = ("LN", "HP", "LP", "HN", "M")
DUAL_CLIP_METHODS = ("grpo",)
"""Methods that accept ``LossHyperparams.dual_clip`` (dual-clip PPO: a cut of PPO's value)."""

# ln(4.9e8): past this a token's ratio has left any trust region by eight orders of magnitude.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossHyperparams:
    """Hyper-parameters of ``policy_loss``; the defaults are the paper's (Appendix B, Table 5)."""

    eps_low: Annotated[float, Bounds(gt=0, lt=1)] = 0.2
    """Lower clip range: the trust region's left edge is w = 1 - eps_low."""
    eps_high: Annotated[float, Bounds(gt=0)] = 0.2
    """Upper clip range: the trust region's right edge is w = 1 + eps_high."""
    n: Annotated[int, Bounds(ge=1)] = 1
    """DGPO left-boundary decay power: F = w^(n+1)/(1-eps_low)^n in LN. An integer."""
    m: Annotated[int, Bounds(ge=1)] = 2
    """DGPO right-boundary root: F = (1+eps_high)^(1/m) w^(1-1/m) in HP. An integer."""
    beta1: Annotated[float, Bounds(ge=0)] = 0.75
    """CE-GPPO scale of the LN gradient weight (F = beta1 (1-eps_low))."""
    beta2: Annotated[float, Bounds(ge=0)] = 1.0
    """CE-GPPO scale of the HP gradient weight (F = beta2 (1+eps_high))."""
    aspo_eps_low: Annotated[float, Bounds(gt=0, lt=1)] = 0.33
    """ASPO soft dual-clip for positive advantages: F = 1-aspo_eps_low when w < 1-aspo_eps_low."""
    aspo_eps_high: Annotated[float, Bounds(gt=0)] = 3.0
    """ASPO soft dual-clip for negative advantages: F = 1+aspo_eps_high when w > 1+aspo_eps_high."""
    gspo_eps_low: Annotated[float, Bounds(gt=0, lt=1)] = 3e-4
    """GSPO's clip of the sample's ratio s_i on the left, 1 - gspo_eps_low (GSPO's paper: 3e-4;
    method ``gspo`` takes these two instead of eps_low and eps_high)."""
    gspo_eps_high: Annotated[float, Bounds(gt=0)] = 4e-4
    """GSPO's clip of s_i on the right, 1 + gspo_eps_high (GSPO's paper: 4e-4)."""
    dual_clip: Annotated[float | None, Bounds(gt=1)] = None
    """Dual-clip PPO constant c (Ye et al. 2020; verl's ``clip_ratio_c``), method ``grpo`` only
    (the others refuse it). For A < 0 the token objective becomes max(min(w A, clip(w) A), c A):
    where A < 0 and w > c its value is the constant c A and its gradient 0 (logged as
    ``dual_clip_frac``); A >= 0 and w <= c are unchanged. 3.0 is verl's default and the GRPO
    baseline of the paper's official code. null (default): off, GRPO as the paper's Eq. 2."""

    def __post_init__(self):
        check_bounds(self)
        for name in ("n", "m"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), Integral):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.dual_clip is not None:
            object.__setattr__(self, "dual_clip", float(self.dual_clip))


@dataclass
class LossConfig:
    """The policy loss of one update: the method and its hyper-parameters, how token terms are
    aggregated over a mini-batch, the behaviour weight and where pi_old comes from. A recipe's
    ``algorithm`` section is one (``recipe.AlgorithmConfig`` adds the advantages and DAPO's
    filter), and ``train_step`` takes it as it is."""

    method: str = "dgpo"
    """One of dgpo, grpo, cispo, gppo, ce_gppo, aspo, gspo
    (``megatron_dgpo.algorithm.losses.METHODS``). ``gspo``: GSPO's sequence-level ratio and clip
    (``loss.gspo_eps_*``), with ``loss_aggregation: seq_mean_token_mean``."""
    loss: LossHyperparams = field(default_factory=LossHyperparams)
    """Clip ranges and each method's own constants (DGPO n, m; CE-GPPO beta1, beta2; ASPO;
    GSPO; GRPO's optional ``dual_clip``, which the other methods refuse). How they and the
    log-ratio clamp differ from the paper's official code: docs/losses.md."""
    loss_aggregation: Literal["token_mean", "group_token_mean",
                              "seq_mean_token_mean"] = "token_mean"
    """How token terms s are averaged over a mini-batch (``losses.sample_loss_weights``).
    ``token_mean``: sum_t s_t / (valid tokens of the whole mini-batch, over every micro-batch
    and DP rank), DAPO's token mean (not the official code's per-micro-batch mean:
    docs/losses.md). ``group_token_mean``: the paper's Eq. 1, each prompt group's token sum
    divided by that group's token count, then the mean over the mini-batch's groups.
    ``seq_mean_token_mean``: each response's token mean, averaged over the responses."""
    rollout_correction: Literal["none", "tis", "token_mask", "sequence_tis", "sequence_mask",
                                "geometric_mask"] = "none"
    """The behaviour weight v_t of each token, from r_t = pi_prox / pi_behav (the trainer's
    log-probs at the start of the step over the engine's), no gradient through it; masked
    tokens stay in the normaliser (docs/losses.md has each formula): ``tis`` min(r_t, cap);
    ``token_mask`` r_t inside [low, high], else 0 (IcePop); ``sequence_tis`` min(prod r, cap)
    over the sample; ``sequence_mask`` prod r inside [low, high], else 0 on the whole sample;
    ``geometric_mask`` 1 while the sample's geometric mean of r lies in [low, high], else 0.
    Logged as ``train/correction/*``. ``none``: v = 1 (the mismatch is still measured)."""
    rollout_correction_cap: Annotated[float, Bounds(ge=1)] = 2.0
    """C of ``tis`` and ``sequence_tis``: weights above it are cut to it."""
    rollout_correction_low: Annotated[float | None, Bounds(gt=0, le=1)] = None
    """low of the masking corrections' band [low, high] (<= 1). None: the option's default
    (token_mask 0.5, sequence_mask 0.5, geometric_mask 0.999)."""
    rollout_correction_high: Annotated[float | None, Bounds(ge=1)] = None
    """high of the band (>= 1). None: the option's default (token_mask 5, sequence_mask 2,
    geometric_mask 1.001)."""
    old_logprobs: Literal["trainer", "rollout"] = "trainer"
    """Where pi_old (pi_prox) comes from. ``trainer``: a forward of the policy at the start of
    the step over every sample (phase ``old_logprobs``). ``rollout``: the engine's log-probs
    (bypass: no such forward, ``time/old_logprobs`` 0; verl's ``bypass_mode``, slime's
    ``--use-rollout-logprobs``). Refused with top_p < 1, with ``rollout.max_staleness`` >= 1,
    with a rollout correction, and with ``rollout.dtype`` other than ``model.dtype`` unless
    ``old_logprobs_accept_dtype_mismatch``."""
    old_logprobs_check_every: Annotated[int, Bounds(ge=0)] = 10
    """With ``old_logprobs: rollout``: every this many steps (from step 1) the first
    mini-batch's trainer forward still runs (phase ``mismatch_check``) and logs the
    ``mismatch/*`` the bypass hides. 0: never."""
    old_logprobs_accept_dtype_mismatch: bool = False
    """With ``old_logprobs: rollout``: accept an engine whose ``rollout.dtype`` is not the
    trainer's ``model.dtype`` (the ratios are then taken against the engine's numerics)."""

    def __post_init__(self):
        check_bounds(self)
        require_choice("method", self.method, METHODS)
        check_method(self.method, self.loss)  # loss.dual_clip with a method that refuses it
        require_choice("loss_aggregation", self.loss_aggregation, AGGREGATIONS)
        require_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        require_choice("old_logprobs", self.old_logprobs, OLD_LOGPROBS)
        if self.method in SEQUENCE_METHODS and self.loss_aggregation != "seq_mean_token_mean":
            raise ValueError(f"method {self.method} spreads each sample's gradient over its tokens "
                             f"as GSPO's paper does (1/|y_i| per token, a mean over samples): set "
                             f"loss_aggregation: seq_mean_token_mean, not {self.loss_aggregation}")
        banded = (self.rollout_correction_low, self.rollout_correction_high) != (None, None)
        if banded and self.rollout_correction not in MASK_BANDS:
            raise ValueError(f"rollout_correction_low/high bound the masking corrections "
                             f"({', '.join(MASK_BANDS)}), not rollout_correction: "
                             f"{self.rollout_correction}: leave them null")
        if self.old_logprobs == "rollout" and self.rollout_correction != "none":
            raise ValueError(f"old_logprobs: rollout takes pi_old from the engine, so its behaviour "
                             f"weight pi_old / pi_rollout is 1: rollout_correction "
                             f"{self.rollout_correction} would do nothing; set it to none")

    def mask_band(self) -> tuple[float, float]:
        """[low, high] of a masking correction: the keys, or the option's default."""
        low, high = MASK_BANDS[self.rollout_correction]
        return (low if self.rollout_correction_low is None else self.rollout_correction_low,
                high if self.rollout_correction_high is None else self.rollout_correction_high)


@dataclass(frozen=True)
class Segments:
    """The sample each token belongs to, for a statistic over a sample's tokens: ``ids`` (the
    tokens' shape) in [0, ``count``); ``reduce`` adds the partial [..., count] totals of the
    ranks that share the samples (context parallelism; None: the samples are whole here)."""

    ids: Tensor
    count: int
    reduce: Callable[[Tensor], Tensor] | None = None

    def totals(self, values: Tensor) -> Tensor:
        """[k, count] sums over each sample's tokens of ``values`` [k, *ids.shape]."""
        flat = values.reshape(len(values), -1)
        out = torch.zeros(len(values), self.count, dtype=flat.dtype, device=flat.device)
        out.index_add_(1, self.ids.reshape(-1).to(flat.device), flat)
        return self.reduce(out) if self.reduce is not None else out

    def spread(self, per_sample: Tensor) -> Tensor:
        """Each token's value of ``per_sample`` [count], in the tokens' shape."""
        return per_sample[self.ids.to(per_sample.device)]


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


def trust_region(method: str, hp: LossHyperparams) -> tuple[float, float]:
    """(eps_low, eps_high) of ``method``'s regions: GSPO's own, the others' shared."""
    return (hp.gspo_eps_low, hp.gspo_eps_high) if method == "gspo" else (hp.eps_low, hp.eps_high)


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
                "aspo": _aspo, "dgpo": _dgpo, "gspo": _grpo}
"""method -> F(w, log_w, advantages, regions, hp): the table of the module docstring (gspo:
grpo's F of the sample's ratio, its regions from ``trust_region``). A new method is one function
here (and its objective value in ``_objective`` if it is not F A)."""
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
    """F of the table in the module docstring, from (already clamped, detached) log-ratios
    ``log_w`` (for ``gspo``: each token's sample's mean log-ratio). Every power is taken in log
    space from a log-ratio clamped into its own region, so no branch overflows."""
    check_method(method, hp)
    regions = Regions.classify(log_w, advantages, *trust_region(method, hp))
    return COEFFICIENTS[method](log_w.exp(), log_w, advantages, regions, hp)


def _objective(method, f, log_w, advantages, logprobs, hp: LossHyperparams) -> Tensor:
    """Per-token value J_t of each paper's objective (docs/losses.md); detached inputs."""
    if method in ("grpo", "gspo"):
        eps_low, eps_high = trust_region(method, hp)
        w = log_w.exp()
        ppo = torch.minimum(w * advantages, w.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages)
        if hp.dual_clip is None:
            return ppo
        return torch.where(advantages < 0, torch.maximum(ppo, hp.dual_clip * advantages), ppo)
    if method == "cispo":
        return f * advantages * logprobs
    return f * advantages


def sequence_log_ratio(log_w: Tensor, valid: Tensor, segments: Segments) -> Tensor:
    """Each token's sample's mean log-ratio, mean over the sample's valid tokens of ``log_w``
    (0 where masked), clamped to +-LOG_RATIO_CLAMP; 0 off ``valid``. float64 sums."""
    sums = segments.totals(torch.stack([log_w.double(), valid.double()]))
    mean = (sums[0] / sums[1].clamp(min=1.0)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(valid, segments.spread(mean).to(log_w.dtype), 0.0)


def policy_loss(method: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                mask: Tensor, hp: LossHyperparams | None = None, *, num_tokens=None,
                weights: Tensor | None = None,
                segments: Segments | None = None) -> tuple[Tensor, LossMetrics]:
    """Loss of ``method`` whose gradient is the unified estimator with that method's F.

    Args:
        method: one of ``METHODS``. hp: its hyper-parameters (default the paper's).
        logprobs: [T] or [B, T] log pi_theta of the sampled tokens; requires grad.
        old_logprobs (log pi_prox), advantages, mask: same shape; ``mask`` bool or 0/1. Values
            under ``mask == 0`` may be any finite garbage: they never reach the result.
        num_tokens: the normaliser W (int or scalar tensor) over the whole mini-batch;
            default ``mask.sum()``. ``train_step`` passes it.
        weights: optional per-token c_t v_t >= 0, no gradient taken through them: aggregation
            weights (``sample_loss_weights``) times behaviour weights (``behaviour_weights``).
        segments: which sample each token belongs to; required by ``SEQUENCE_METHODS``.

    Returns ``(loss, metrics)``: ``loss = -(1/W) sum_t mask_t c_t v_t s_t`` (module docstring)
    and detached float64 sums, counts, minima and maxima over this call's valid tokens
    (``loss_metrics``). Computed in float32, or float64 when ``logprobs`` is float64.
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
    if method in SEQUENCE_METHODS and (segments is None or segments.ids.shape != logprobs.shape):
        raise ValueError(f"method {method} takes each sample's ratio: pass segments whose ids "
                         f"have the shape of logprobs {tuple(logprobs.shape)}")

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
        if method in SEQUENCE_METHODS:
            log_w = sequence_log_ratio(log_w, valid, segments)
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
    return loss, loss_metrics(f, log_w, adv, valid, hp, method)


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


def behaviour_weights(config: LossConfig, prox_logprobs: Tensor, behav_logprobs: Tensor,
                      mask: Tensor, segments: Segments | None = None) -> tuple[Tensor, LossMetrics]:
    """The behaviour weight v_t of ``config.rollout_correction`` (not ``none``), per token, from
    r_t = pi_prox / pi_behav and, for the sequence options, each sample's
    log rho_i = sum_t log r_t (``sequence_*``) or log g_i = mean_t log r_t (``geometric_mask``)
    over its valid tokens:

        tis             min(r_t, C)                 sequence_tis    min(rho_i, C)
        token_mask      r_t   if low <= r_t <= high, else 0
        sequence_mask   rho_i if low <= rho_i <= high, else 0 (the whole sample)
        geometric_mask  1     if low <= g_i <= high, else 0 (the whole sample)

    The bands are compared in log space, inclusive; a weight is formed from its log clamped to
    +-LOG_RATIO_CLAMP, so none overflows. Args: [T] or [B, T] log-probs and mask, ``segments``
    (required by the sequence options; with it, samples are counted). Returns ``(v, metrics)``:
    ``v`` detached float64, 0 off the mask; metrics ``correction_*`` (``summarize_metrics``)."""
    option = config.rollout_correction
    if option not in ROLLOUT_CORRECTIONS[1:]:
        raise ValueError(f"behaviour_weights: rollout_correction {option!r} has no weight; "
                         f"expected one of {', '.join(ROLLOUT_CORRECTIONS[1:])}")
    if not (prox_logprobs.shape == behav_logprobs.shape == mask.shape):
        raise ValueError(f"prox_logprobs {tuple(prox_logprobs.shape)}, behav_logprobs "
                         f"{tuple(behav_logprobs.shape)} and mask {tuple(mask.shape)} differ")
    if segments is None and option != "tis" and option != "token_mask":
        raise ValueError(f"rollout_correction {option} is a sample's statistic: pass segments")
    valid = mask.bool()
    with torch.no_grad():
        log_r = torch.where(valid, prox_logprobs.double() - behav_logprobs.double(), 0.0)
        stat = log_r
        if option in ("sequence_tis", "sequence_mask", "geometric_mask"):
            sums = segments.totals(torch.stack([log_r, valid.double()]))
            per_sample = sums[0] / sums[1].clamp(min=1.0) if option == "geometric_mask" else sums[0]
            stat = torch.where(valid, segments.spread(per_sample), 0.0)
        clamped = stat.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if option in ("tis", "sequence_tis"):
            cut = math.log(config.rollout_correction_cap)
            weight, dropped = clamped.clamp(max=cut).exp(), stat > cut
        else:
            low, high = (math.log(b) for b in config.mask_band())
            dropped = (stat < low) | (stat > high)
            weight = torch.where(dropped, 0.0, torch.ones_like(clamped) if option == "geometric_mask"
                                 else clamped.exp())
        weight, dropped = torch.where(valid, weight, 0.0), dropped & valid
        ratio = clamped.exp()
        metrics = LossMetrics(
            sums={"correction_tokens_count": valid.sum().double(),
                  "correction_weight_sum": weight.sum(),
                  "correction_weight_sq_sum": weight.square().sum(),
                  ("correction_clipped_count" if option in ("tis", "sequence_tis")
                   else "correction_masked_count"): dropped.sum().double()},
            mins={"correction_weight_min": torch.where(valid, weight, math.inf).min(),
                  "correction_ratio_min": torch.where(valid, ratio, math.inf).min()},
            maxs={"correction_weight_max": torch.where(valid, weight, -math.inf).max(),
                  "correction_ratio_max": torch.where(valid, ratio, -math.inf).max()})
        if segments is not None and option not in ("tis", "sequence_tis"):
            counts = segments.totals(torch.stack([valid.double(), dropped.double()]))
            metrics.sums["correction_samples_count"] = (counts[0] > 0).sum().double()
            metrics.sums["correction_masked_samples_count"] = (counts[1] > 0).sum().double()
    return weight, metrics


def effective_sample_size(metrics: LossMetrics) -> LossMetrics:
    """The behaviour weights' effective sample size (sum v)^2 / sum v^2 of the (reduced)
    ``metrics`` of one mini-batch, and its share of the mini-batch's tokens, as sums over
    mini-batches (``correction_minibatches_count`` 1), so merged steps average them."""
    total, squares = float(metrics["correction_weight_sum"]), float(metrics["correction_weight_sq_sum"])
    ess = total * total / squares if squares > 0 else 0.0
    tokens = float(metrics["correction_tokens_count"])
    return LossMetrics(sums={name: torch.tensor(value, dtype=torch.float64) for name, value in (
        ("correction_ess_sum", ess), ("correction_ess_frac_sum", ess / tokens if tokens else 0.0),
        ("correction_minibatches_count", 1.0))})


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
                 hp: LossHyperparams, method: str = "dgpo") -> LossMetrics:
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
    regions = Regions.classify(log_w, advantages, *trust_region(method, hp))
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
    ``loss`` (the loss per unit of ``weight_sum`` when a weighted aggregation adds it); the
    behaviour weights' (``behaviour_weights``, ``effective_sample_size``) become
    ``correction/*``; ``dual_clipped_count`` (only with ``dual_clip``) ``dual_clip_frac``."""
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
    if "correction_weight_sum" in metrics:
        out.update(_correction_summary(metrics, ratio, extreme))
    return out


def _correction_summary(metrics: LossMetrics, ratio, extreme) -> dict[str, float]:
    """``correction/*``: the behaviour weights' mean, extremes, the ratio they came from, the
    share of tokens cut (``clip_frac``) or masked and of samples with a masked token, and the
    mean over mini-batches of the effective sample size and its share of the tokens."""
    tokens = float(metrics["correction_tokens_count"])
    out = {"correction/weight_mean": ratio(metrics["correction_weight_sum"], tokens),
           "correction/weight_min": extreme(metrics["correction_weight_min"]),
           "correction/weight_max": extreme(metrics["correction_weight_max"]),
           "correction/ratio_min": extreme(metrics["correction_ratio_min"]),
           "correction/ratio_max": extreme(metrics["correction_ratio_max"])}
    if "correction_clipped_count" in metrics:
        out["correction/clip_frac"] = ratio(metrics["correction_clipped_count"], tokens)
    if "correction_masked_count" in metrics:
        out["correction/token_masked_frac"] = ratio(metrics["correction_masked_count"], tokens)
    if "correction_samples_count" in metrics:
        out["correction/sample_masked_frac"] = ratio(metrics["correction_masked_samples_count"],
                                                     float(metrics["correction_samples_count"]))
    if "correction_minibatches_count" in metrics:
        batches = float(metrics["correction_minibatches_count"])
        out["correction/ess"] = ratio(metrics["correction_ess_sum"], batches)
        out["correction/ess_frac"] = ratio(metrics["correction_ess_frac_sum"], batches)
    return out
