"""Megatron-Core's optimizer for the policy: AdamW, constant LR, global grad-norm clip.

One code path on CPU and GPU: ``megatron.core.optimizer.get_megatron_optimizer`` (on CPU made
to run by ``megatron_dgpo.runtime.cpu``). Its ``step()`` computes the gradient norm over every
model-parallel shard (TP duplicates counted once, PP stages summed), clips to
``clip_grad``, steps Adam and copies fp32 main weights back into bf16 parameters; with the
distributed optimizer the Adam states and main weights are sharded over data parallel.

Non-finite gradients: ``step_if_finite`` checks the gradient buffers of every rank before
stepping (one all-reduce of one flag) and skips the update if any value is NaN or inf, so a
bad batch never reaches the weights or the Adam moments (fp32 training has no loss scaler to
catch it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from megatron_dgpo.runtime import comm
from megatron_dgpo.runtime.config import Bounds, check_bounds


@dataclass
class OptimizerConfig:
    """AdamW with a constant learning rate (Megatron-Core's optimizer)."""

    lr: Annotated[float, Bounds(gt=0)] | Literal["auto"] = 1e-6
    """Learning rate, or ``auto``: lr_reference * sqrt(lr_reference_params / N) with N the
    model's size (``model.nominal_params``), the paper's constant total-gradient-variance rule."""
    lr_reference: Annotated[float, Bounds(gt=0)] = 1e-6
    """The learning rate known to work at ``lr_reference_params`` (paper: 1e-6 at 1.5B)."""
    lr_reference_params: Annotated[float, Bounds(gt=0)] = 1.5e9
    """Model size of ``lr_reference``."""
    weight_decay: Annotated[float, Bounds(ge=0)] = 0.01
    """Decoupled (AdamW) weight decay on matrices; biases and norms are not decayed."""
    adam_beta1: Annotated[float, Bounds(ge=0, lt=1)] = 0.9
    """Adam's first-moment decay."""
    adam_beta2: Annotated[float, Bounds(ge=0, lt=1)] = 0.95
    """Adam's second-moment decay."""
    adam_eps: Annotated[float, Bounds(gt=0)] = 1e-8
    """Adam's denominator epsilon."""
    clip_grad: Annotated[float, Bounds(ge=0)] = 1.0
    """Global gradient-norm clip over all model-parallel shards (0 disables)."""
    use_distributed_optimizer: bool | None = None
    """Shard optimizer states over data parallel (Megatron's distributed optimizer). None: on
    with a GPU, off on CPU (where it runs too, through ``megatron_dgpo.runtime.cpu``)."""

    def __post_init__(self):
        check_bounds(self)

    def learning_rate(self, num_params: float) -> float:
        """The constant learning rate for a model of ``num_params`` parameters."""
        if self.lr != "auto":
            return float(self.lr)
        if not num_params > 0:
            raise ValueError(f"lr: auto needs a positive parameter count, got {num_params}")
        return self.lr_reference * math.sqrt(self.lr_reference_params / num_params)


def use_distributed_optimizer(config: OptimizerConfig) -> bool:
    """The config's choice, or: on with a GPU (where its memory saving matters), off on CPU
    (where the CPU tests' reference runs use the plain one). Both run on either: on CPU through
    ``megatron_dgpo.runtime.cpu`` (patches 11-12)."""
    if config.use_distributed_optimizer is None:
        return torch.cuda.is_available()
    return config.use_distributed_optimizer


def build_optimizer(config: OptimizerConfig, models: list, *, lr: float, bf16: bool):
    """Megatron ``MegatronOptimizer`` over the DDP-wrapped ``models`` (see ``wrap_ddp``).

    Weight decay applies to matrices only (Megatron's default: no decay on biases and norms,
    put into the param groups by ``_apply_constant_schedule``). ``overlap_param_gather``
    follows the models' DDP config (Megatron wants the two to agree); with it, read weights
    only after ``sync_params``.
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_dgpo.runtime.cpu import apply_cpu_compat

    apply_cpu_compat()
    megatron_config = MegatronOptimizerConfig(
        optimizer="adam",  # Megatron's "adam" is AdamW (decoupled weight decay)
        lr=lr,
        min_lr=lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer(config),
        overlap_param_gather=_overlap_param_gather(models),
    )
    optimizer = get_megatron_optimizer(megatron_config, models)
    _apply_constant_schedule(optimizer, lr, config.weight_decay)
    return optimizer


def _apply_constant_schedule(optimizer, lr: float, weight_decay: float) -> None:
    """Write the constant LR and weight decay into the param groups through Megatron's own
    scheduler, which is what applies each group's ``wd_mult`` (0 for biases and norms): without
    it every group keeps the raw weight decay and norm weights would be decayed."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    OptimizerParamScheduler(optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0,
                            lr_decay_steps=1, lr_decay_style="constant", start_wd=weight_decay,
                            end_wd=weight_decay, wd_incr_steps=1, wd_incr_style="constant")


def _overlap_param_gather(models: list) -> bool:
    ddp = getattr(models[0], "ddp_config", None)
    return bool(ddp is not None and ddp.overlap_param_gather)


def sync_params(models: list) -> None:
    """Collective over DP: make every rank's parameters the updated ones now.

    With overlapped parameter gathering (``gpu_flags.ddp_flags``: CUDA and the distributed
    optimizer), ``optimizer.step()`` updates only this rank's shard of the main weights and
    leaves the all-gather of the new parameters to the forward pre-hooks of the next forward
    pass. Code that reads the weights without a forward in between (refit of the rollout
    engine, checkpoint save) calls this first: Megatron's synchronous all-gather of every
    bucket (``start_param_sync(force_sync=True)``, as Megatron-LM does before saving). The
    next forward's pre-hooks then find nothing left to gather. No-op without the overlap.
    """
    if not _overlap_param_gather(models):
        return
    for model in models:
        model.start_param_sync(force_sync=True)


def gradients_finite(models: list) -> bool:
    """True when every gradient buffer on every rank is finite (one MAX all-reduce)."""
    bad = torch.zeros(1, dtype=torch.float32, device=_device(models))
    for model in models:
        for param in model.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is not None:  # accumulate on the device: no host sync per parameter
                bad = torch.maximum(bad, (~torch.isfinite(grad)).any().float())
    comm.all_reduce_(bad, "max")
    return bool(bad.item() == 0)


def step_if_finite(optimizer, models: list, loss: float) -> tuple[bool, float]:
    """One optimizer step unless the loss or any gradient is non-finite.

    Returns (stepped, grad_norm before clipping; NaN when skipped). ``loss`` is the mini-batch
    loss every rank agrees on (``train_step`` returns it reduced).
    """
    finite = gradients_finite(models) and math.isfinite(loss)
    if not finite:
        optimizer.zero_grad()
        for model in models:
            model.zero_grad_buffer()
        return False, float("nan")
    stepped, grad_norm, _ = optimizer.step()
    if not stepped:  # a loss scaler (fp16) found an overflow
        return False, float("nan")
    return True, float(grad_norm) if grad_norm is not None else float("nan")


def _device(models) -> torch.device:
    return next(models[0].parameters()).device
