"""Policy-gradient losses of the DGPO paper's unified estimator (its Eq. 1).

Every method here is one choice of the coefficient F in

    grad J = 1/N * sum_t  F_t * A_t * grad log pi_theta(o_t),      w_t = pi_theta / pi_old,

where N is the number of valid tokens of the whole mini-batch. F depends on the region a token
falls in (paper, Table 1), set by the ratio w and the sign of the advantage A:

    LN: w < 1-eps_low  and A < 0        HP: w > 1+eps_high and A > 0
    LP: w < 1-eps_low  and A > 0        HN: w > 1+eps_high and A < 0
    M : everything else (A = 0 included)

    method    F
    grpo      0 in LN and HP; w elsewhere                                     (PPO clip)
    cispo     clip(w, 1-eps_low, 1+eps_high) everywhere
    gppo      1-eps_low in LN; 1+eps_high in HP; w elsewhere
    ce_gppo   beta1*(1-eps_low) in LN; beta2*(1+eps_high) in HP; w elsewhere
    aspo      0 in LN and HP; else A > 0: 1-eps'_low if w < 1-eps'_low, else 1/w
                                     A < 0: 1+eps'_high if w > 1+eps'_high, else w
    dgpo      w^(n+1) / (1-eps_low)^n in LN; (1+eps_high)^(1/m) * w^(1-1/m) in HP; w elsewhere

How the loss is built. ``policy_loss`` returns ``-(1/N) sum_t mask_t * s_t`` with the per-token
surrogate

    s_t = J_t + F_t * A_t * (log pi_t - sg[log pi_t]),

where J_t (the value of each paper's objective, below) and F_t are computed from detached,
masked and clamped log-ratios. The only differentiable operation is linear in log pi, so
``d loss / d logprobs[t] = -mask[t] * F[t] * A[t] / num_tokens`` holds exactly, and no branch a
``torch.where`` discards can leak a NaN into the gradient (the failure of ``0 * inf`` in the
gradient of an unselected ``exp`` branch). Log-ratios are clamped to +-LOG_RATIO_CLAMP (w in
[2e-9, 4.9e8]) before F is formed: F is the table above for every ratio a trust region could
still care about, and F * A stays finite in float32 sums over millions of tokens.

The objective values J_t (what the loss reports; the gradient does not depend on them):
    grpo      min(w A, clip(w, 1-eps_low, 1+eps_high) A)                    (PPO)
    cispo     sg[clip(w, 1-eps_low, 1+eps_high)] A log pi                  (MiniMax-M1)
    others    F A: the paper's probability-weight form J = sg[W] A pi with F = W pi (Eq. 9 for
              DGPO; for gppo/ce_gppo this equals their clipped objective's value).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from numbers import Integral

import torch
from torch import Tensor

METHODS = ("grpo", "cispo", "gppo", "ce_gppo", "aspo", "dgpo")
REGIONS = ("LN", "HP", "LP", "HN", "M")

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


def coefficient(method: str, log_w: Tensor, advantages: Tensor, hp: LossHyperparams) -> Tensor:
    """F of the table in the module docstring, from (already clamped) log-ratios ``log_w``.

    Pure and differentiable-free: callers pass detached tensors. Every power is taken in
    log space from a log-ratio clamped into its own region, so no branch overflows.
    """
    w = log_w.exp()
    regions = Regions.classify(log_w, advantages, hp.eps_low, hp.eps_high)
    lo, hi = 1.0 - hp.eps_low, 1.0 + hp.eps_high
    outside = regions.LN | regions.HP

    if method == "grpo":
        return torch.where(outside, torch.zeros_like(w), w)
    if method == "cispo":
        return w.clamp(lo, hi)
    if method == "gppo":
        return torch.where(regions.LN, lo, torch.where(regions.HP, hi, w))
    if method == "ce_gppo":
        return torch.where(regions.LN, hp.beta1 * lo, torch.where(regions.HP, hp.beta2 * hi, w))
    if method == "aspo":
        pos_floor, neg_cap = 1.0 - hp.aspo_eps_low, 1.0 + hp.aspo_eps_high
        positive = torch.where(w < pos_floor, pos_floor, (-log_w).exp())  # 1/w, never 1/0
        negative = torch.where(w > neg_cap, neg_cap, w)
        f = torch.where(advantages > 0, positive, torch.where(advantages < 0, negative, w))
        return torch.where(outside, torch.zeros_like(w), f)
    if method == "dgpo":
        # LN: W = C_left sg[pi]^n with C_left = (1-eps_low)^-n pi_old^-(n+1), so F = W pi =
        #     w^(n+1) / (1-eps_low)^n; equals w at w = 1-eps_low and -> 0 as w -> 0.
        # HP: W = C_right sg[pi]^(-1/m) with C_right = (1+eps_high)^(1/m) pi_old^(1/m-1), so
        #     F = (1+eps_high)^(1/m) w^(1-1/m); equals w at w = 1+eps_high, grows sub-linearly.
        log_lo, log_hi = math.log(lo), math.log(hi)
        left = ((hp.n + 1) * log_w.clamp(max=log_lo) - hp.n * log_lo).exp()
        right = (log_hi / hp.m + (1.0 - 1.0 / hp.m) * log_w.clamp(min=log_hi)).exp()
        return torch.where(regions.LN, left, torch.where(regions.HP, right, w))
    raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")


def _objective(method, f, log_w, advantages, logprobs, hp: LossHyperparams) -> Tensor:
    """Per-token value J_t of each paper's objective (module docstring); detached inputs."""
    if method == "grpo":
        w = log_w.exp()
        clipped = w.clamp(1.0 - hp.eps_low, 1.0 + hp.eps_high)
        return torch.minimum(w * advantages, clipped * advantages)
    if method == "cispo":
        return f * advantages * logprobs
    return f * advantages


def policy_loss(method, logprobs, old_logprobs, advantages, mask, *, eps_low=0.2, eps_high=0.2,
                n=1, m=2, beta1=0.75, beta2=1.0, aspo_eps_low=0.33, aspo_eps_high=3.0,
                num_tokens=None) -> tuple[Tensor, dict]:
    """Loss of ``method`` whose gradient is the paper's unified estimator with that method's F.

    Args:
        method: one of ``METHODS``.
        logprobs: [T] or [B, T] log pi_theta of the sampled tokens; requires grad.
        old_logprobs, advantages, mask: same shape; ``mask`` is bool or 0/1 (valid tokens).
            Values under ``mask == 0`` may be any finite garbage: they never reach the result.
        num_tokens: the global normaliser N (int or scalar tensor): the number of valid tokens
            of the whole mini-batch across ranks and micro-batches. Default: ``mask.sum()``.

    Returns:
        ``(loss, metrics)``: ``loss = -(1/N) sum_t mask_t s_t`` (module docstring), so that
        ``d loss / d logprobs[t] = -mask[t] * F[t] * A[t] / N``; ``metrics`` holds detached
        float64 sums, counts, minima and maxima over this call's valid tokens (see
        ``loss_metrics``); reduce them with ``reduce_metrics`` and read them with
        ``summarize_metrics``.

    Computed in float32, or float64 when ``logprobs`` is float64.
    """
    hp = LossHyperparams(eps_low=eps_low, eps_high=eps_high, n=n, m=m, beta1=beta1,
                         beta2=beta2, aspo_eps_low=aspo_eps_low, aspo_eps_high=aspo_eps_high)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages,
               "mask": mask}
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has "
                             f"{tuple(logprobs.shape)}: all four must match")
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

    # Linear in logp: d/d logp = slope exactly; at masked positions slope is 0 and logp - logp
    # is 0 for any finite garbage.
    surrogate = value + slope * (logp - logp.detach())
    loss = -surrogate.sum() / num_tokens
    return loss, loss_metrics(f, log_w, adv, valid, hp)


def loss_metrics(f: Tensor, log_w: Tensor, advantages: Tensor, valid: Tensor,
                 hp: LossHyperparams) -> dict[str, Tensor]:
    """Token-level statistics as mergeable float64 scalars.

    Keys end in ``_sum`` or ``_count`` (merge by addition), ``_max`` or ``_min``. Region
    fractions, mean F per region, ratio mean and the GRPO clip fraction (tokens whose PPO
    gradient is zero: LN or HP) follow from them in ``summarize_metrics``.
    """
    regions = Regions.classify(log_w, advantages, hp.eps_low, hp.eps_high)
    f64, w64 = f.double(), log_w.double().exp()
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=f.device)
    pos_inf = torch.tensor(math.inf, dtype=torch.float64, device=f.device)
    out = {"tokens_count": valid.sum().double()}
    for name in REGIONS:
        region = getattr(regions, name) & valid
        out[f"region_{name}_count"] = region.sum().double()
        out[f"F_{name}_sum"] = torch.where(region, f64, 0.0).sum()
        out[f"F_{name}_max"] = torch.where(region, f64, neg_inf).max()
    out["ratio_sum"] = torch.where(valid, w64, 0.0).sum()
    out["ratio_min"] = torch.where(valid, w64, pos_inf).min()
    out["ratio_max"] = torch.where(valid, w64, neg_inf).max()
    out["clipped_count"] = ((regions.LN | regions.HP) & valid).sum().double()
    return out


def merge_metrics(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Combine metric dicts of several micro-batches exactly (sum, max or min by key suffix)."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key not in merged:
                merged[key] = value.detach().clone()
            elif key.endswith("_max"):
                merged[key] = torch.maximum(merged[key], value)
            elif key.endswith("_min"):
                merged[key] = torch.minimum(merged[key], value)
            else:
                merged[key] = merged[key] + value
    return merged


def reduce_metrics(metrics: dict[str, Tensor], group=None) -> dict[str, Tensor]:
    """All-reduce a metric dict across ``group`` exactly, by key suffix (collective call)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return metrics
    keys = sorted(metrics)
    out = {}
    for op, picked in ((dist.ReduceOp.MAX, [k for k in keys if k.endswith("_max")]),
                       (dist.ReduceOp.MIN, [k for k in keys if k.endswith("_min")]),
                       (dist.ReduceOp.SUM, [k for k in keys if not k.endswith(("_max", "_min"))])):
        if not picked:
            continue
        flat = torch.stack([metrics[k].detach().double() for k in picked])
        dist.all_reduce(flat, op=op, group=group)
        out.update(zip(picked, flat.unbind()))
    return out


def summarize_metrics(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Readable numbers from (reduced) metrics: fractions, means, extremes; NaN where empty."""
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
    out["ratio/mean"] = ratio(metrics["ratio_sum"], tokens)
    out["ratio/min"] = extreme(metrics["ratio_min"])
    out["ratio/max"] = extreme(metrics["ratio_max"])
    out["clip_frac"] = ratio(metrics["clipped_count"], tokens)
    return out


# ----------------------------------------------------------------------------------------------
# Self-check CLI: `python -m megatron_dgpo.losses --check --plot F.png`


def _autograd_coefficients(method: str, w: Tensor, advantage: float, hp: LossHyperparams):
    """F recovered from autograd: d loss / d logprobs = -F A / N with N = len(w)."""
    logp = w.log().clone().requires_grad_(True)
    adv = torch.full_like(w, advantage)
    loss, _ = policy_loss(method, logp, torch.zeros_like(w), adv, torch.ones_like(w),
                          eps_low=hp.eps_low, eps_high=hp.eps_high, n=hp.n, m=hp.m,
                          beta1=hp.beta1, beta2=hp.beta2, aspo_eps_low=hp.aspo_eps_low,
                          aspo_eps_high=hp.aspo_eps_high)
    loss.backward()
    return -logp.grad * len(w) / advantage


def plot_coefficients(path: str, hp: LossHyperparams) -> None:
    """Draw the gradient weights of all six methods, as in the paper's Figure 2.

    Rows 1-2: F(w), the weight on grad log pi, for A > 0 and A < 0, with the trust-region
    regions shaded and the unbiased policy gradient F = w dotted. Row 3: the weight on grad pi,
    W * pi_old = F / w (log scale): the soft-clipping baselines grow without bound as w -> 0 in
    LN, DGPO's decays to 0 (the paper's Section 3.2 argument).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = torch.linspace(0.02, 2.0, 600, dtype=torch.float64)
    fig, axes = plt.subplots(3, len(METHODS), figsize=(3.0 * len(METHODS), 8.6), sharex=True,
                             sharey="row", constrained_layout=True)
    colors = {1.0: "tab:red", -1.0: "tab:blue"}
    for col, method in enumerate(METHODS):
        title = method.upper().replace("_", "-")
        for row, advantage in enumerate((1.0, -1.0)):
            ax = axes[row, col]
            f = _autograd_coefficients(method, w, advantage, hp)
            clipped_span = (1 + hp.eps_high, 2.0) if advantage > 0 else (0.0, 1 - hp.eps_low)
            ax.axvspan(*clipped_span, color=colors[advantage], alpha=0.12, lw=0,
                       label="HP" if advantage > 0 else "LN")
            ax.plot(w, w, ":", color="0.45", lw=1.2, label="w (unbiased PG)")
            ax.plot(w, f, color=colors[advantage], lw=2.2, label="F")
            ax.set_ylim(-0.05, 2.05)
            ax.grid(alpha=0.3)
            ax.set_title(f"{title}  (A {'>' if advantage > 0 else '<'} 0)", fontsize=9)
            if col == 0:
                ax.set_ylabel("F: weight on grad log pi")
                ax.legend(fontsize=8, loc="upper left")
            axes[2, col].plot(w, f / w, color=colors[advantage], lw=2.0,
                              label=f"A {'>' if advantage > 0 else '<'} 0")
        ax = axes[2, col]
        ax.set_yscale("log")
        ax.set_ylim(1e-2, 1e2)
        ax.grid(alpha=0.3, which="both")
        ax.set_xlabel("w = pi / pi_old")
        ax.set_title(f"{title}: weight on grad pi", fontsize=9)
        if col == 0:
            ax.set_ylabel("W * pi_old = F / w")
            ax.legend(fontsize=8, loc="upper right")
    axes[0, 0].set_xlim(0, 2.0)
    fig.suptitle(f"Gradient weights of the unified estimator (eps_low={hp.eps_low}, "
                 f"eps_high={hp.eps_high}, DGPO n={hp.n}, m={hp.m}; computed with autograd)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def self_check(hp: LossHyperparams) -> list[tuple[str, str, float]]:
    """Autograd F against the closed form on a grid covering every region; float64."""
    w = torch.linspace(0.05, 3.0, 400, dtype=torch.float64)
    rows = []
    for method in METHODS:
        for advantage in (1.0, -1.0):
            got = _autograd_coefficients(method, w, advantage, hp)
            want = coefficient(method, w.log(), torch.full_like(w, advantage), hp)
            rows.append((method, "A>0" if advantage > 0 else "A<0",
                         float((got - want).abs().max())))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="PNG", help="write the F(w) figure here")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--m", type=int, default=2)
    parser.add_argument("--eps-low", type=float, default=0.2)
    parser.add_argument("--eps-high", type=float, default=0.2)
    args = parser.parse_args(argv)
    hp = LossHyperparams(eps_low=args.eps_low, eps_high=args.eps_high, n=args.n, m=args.m)
    worst = 0.0
    print(f"{'method':8s} {'sign':4s} max|F_autograd - F_closed_form|")
    for method, sign, err in self_check(hp):
        print(f"{method:8s} {sign:4s} {err:.2e}")
        worst = max(worst, err)
    if args.plot:
        plot_coefficients(args.plot, hp)
        print(f"wrote {args.plot}")
    ok = worst < 1e-12
    print("self-check " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
