"""Rank functions for tests/training/test_context_parallel.py: one mini-batch of packed rows at
CP = 1 (the reference), CP = 2, TP = 2, TP = 2 x CP = 2, CP = 2 x DP = 2 and PP = 2 x CP = 2, for each
aggregation, every rollout correction (``geometric_mask`` with GSPO) and GSPO: every option on a
real tiny Megatron model in the launches that already compare the layouts."""

from __future__ import annotations

import math

import torch

from tests._rank_fns_model import TINY_QWEN2, hf_model, hf_to_megatron_full, load_full_state
from tests._rank_fns_train import _grads

LENGTHS = (9, 14, 6, 11, 13, 7, 10, 5)  # none a multiple of 2 CP = 4, nor of 8
PROMPTS = (4, 5, 3, 4, 6, 3, 4, 2)
GROUP_SIZE = 2  # sample i is response i % 2 of prompt group i // 2
PAD = 8  # gpu_flags.pad_multiple(2, 2): the rows every layout runs on
BUDGET = 40
TIS_CAP = 1.2
TIS = dict(rollout_correction="tis", rollout_correction_cap=TIS_CAP)
CASES = {  # name -> (aggregation, groups left out (all-zero loss weights), other LossConfig keys)
    "token_mean": ("token_mean", (), {}),
    "token_mean_drop_tis": ("token_mean", (1,), TIS),
    "group_token_mean": ("group_token_mean", (), {}),
    "seq_mean_token_mean_drop": ("seq_mean_token_mean", (2,), {}),
    "token_mask_drop": ("token_mean", (2,), dict(rollout_correction="token_mask")),
    "sequence_tis": ("seq_mean_token_mean", (), dict(rollout_correction="sequence_tis",
                                                     rollout_correction_cap=1.5)),
    # a sample's product of ratios, over its tokens on both CP ranks, masks some samples
    "sequence_mask": ("group_token_mean", (), dict(rollout_correction="sequence_mask")),
    # GSPO's sample ratio over both CP ranks' shards; the geometric mask on top
    "gspo_drop_geometric_mask": ("seq_mean_token_mean", (1,), dict(
        method="gspo", rollout_correction="geometric_mask", rollout_correction_low=0.8,
        rollout_correction_high=1.3)),
}
LAYOUTS = {2: ((1, 1, 2), (2, 1, 1)), 4: ((2, 1, 2), (1, 1, 2), (1, 2, 2))}
"""world -> (TP, PP, CP) layouts; DP = world / (TP PP CP)."""


def samples(case: str):
    """The mini-batch's ``packing.Sample`` list with the loss fields of ``case``."""
    from megatron_dgpo.algorithm.losses import sample_loss_weights
    from megatron_dgpo.algorithm.packing import Sample

    aggregation, dropped, _ = CASES[case]
    gen = torch.Generator().manual_seed(3)
    vocab = TINY_QWEN2["vocab_size"]
    responses = torch.tensor([n - p for n, p in zip(LENGTHS, PROMPTS)])
    keep = torch.tensor([i // GROUP_SIZE not in dropped for i in range(len(LENGTHS))])
    weights = sample_loss_weights(responses, GROUP_SIZE, aggregation, keep if dropped else None)
    out = []
    for i, (n, prompt) in enumerate(zip(LENGTHS, PROMPTS)):
        r = n - prompt
        old = -math.log(vocab) + 0.4 * torch.randn(r, generator=gen)
        per_token = dict(old_logprobs=old,
                         advantages=torch.full((r,), (1.0 if i % 3 else -1.0) * (0.5 + 0.1 * i)),
                         rollout_logprobs=old + 0.5 * torch.randn(r, generator=gen))
        if weights is not None:
            per_token["loss_weights"] = torch.full((r,), float(weights[i]), dtype=torch.float64)
        out.append(Sample(tokens=torch.randint(0, vocab, (n,), generator=gen),
                          response_start=prompt, per_token=per_token))
    return out


def rows(case: str, dp_rank: int = 0, dp_size: int = 1):
    """This DP rank's packed rows (every DP rank at least one)."""
    from megatron_dgpo.algorithm.packing import pack

    packed = pack(samples(case), BUDGET, PAD)
    return packed[dp_rank::dp_size]


def _loss_config(case: str):
    from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams

    aggregation, _, extra = CASES[case]
    return LossConfig(**{"method": "dgpo", **extra},
                      loss=LossHyperparams(eps_low=0.2, eps_high=0.28, gspo_eps_low=0.1,
                                           gspo_eps_high=0.12),
                      loss_aggregation=aggregation)


def _build(tp: int, pp: int, cp: int):
    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training.policy import wrap_ddp

    initialize_parallel(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp,
                                       context_parallel=cp), seed=5)
    chunks = build_model(TINY_QWEN2)
    load_full_state(chunks, hf_to_megatron_full(hf_model(TINY_QWEN2).state_dict(), TINY_QWEN2))
    return wrap_ddp(chunks)


def run_layout(tp: int, pp: int, cp: int) -> dict:
    """Log-probs and entropy of every row (whole rows, from ``forward_logprobs``), and per case
    the loss, token count, summary and every gradient of this rank's stage; the supervised
    step's loss and grads."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.runtime.parallel import destroy_parallel
    from megatron_dgpo.training.train_step import forward_logprobs, sft_step, train_step

    models = _build(tp, pp, cp)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    vocab = TINY_QWEN2["vocab_size"]
    mine = rows("token_mean", dp_rank, dp_size)
    out = dict(dp_rank=dp_rank, dp_size=dp_size,
               forward=[torch.stack(pair) for pair in forward_logprobs(models, mine)], cases={})
    for case in CASES:
        res = train_step(models, rows(case, dp_rank, dp_size), _loss_config(case))
        out["cases"][case] = dict(loss=res.loss, num_tokens=res.num_tokens, summary=res.summary,
                                  grads=_grads(models, vocab)[0])
    loss, n = sft_step(models, mine)
    out["sft"] = dict(loss=loss, num_tokens=n, grads=_grads(models, vocab)[0])
    destroy_parallel()
    return out


def reference_fn(rank, world_size):
    """CP = 1 on one rank (the local attention's block-diagonal mask)."""
    return run_layout(1, 1, 1)


def layouts_fn(rank, world_size):
    """Every layout of ``LAYOUTS[world_size]``, in order."""
    return [dict(layout=layout, **run_layout(*layout)) for layout in LAYOUTS[world_size]]
