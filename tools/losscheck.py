"""Self-check and figure of the losses' gradient weights F (``megatron_dgpo.algorithm.losses``).

    python tools/losscheck.py [--n 1 --m 2 --eps-low 0.2 --eps-high 0.2] [--plot F.png]

recovers F of every method from autograd (d loss / d logprobs = -F A / N) on a grid of ratios
covering every region, compares it with the closed form (``losses.coefficient``; exit status 1
when they differ by more than 1e-12) and, with ``--plot``, draws the paper's Figure 2
(docs/figures/loss_coefficients.png is this script's output).
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from megatron_dgpo.algorithm.losses import TOKEN_METHODS as METHODS
from megatron_dgpo.algorithm.losses import LossHyperparams, coefficient, policy_loss


def _autograd_coefficients(method: str, w: Tensor, advantage: float, hp: LossHyperparams):
    """F recovered from autograd: d loss / d logprobs = -F A / N with N = len(w)."""
    logp = w.log().clone().requires_grad_(True)
    adv = torch.full_like(w, advantage)
    loss, _ = policy_loss(method, logp, torch.zeros_like(w), adv, torch.ones_like(w), hp)
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
