"""Tiny Qwen3 / Qwen3-MoE checkpoints and rank functions for tests/models/test_moe.py (gloo ranks).

The reference is transformers' own model: its logits, and its gradients written out by its own
``save_pretrained`` (so that fused in-memory experts come out under the per-expert names the
converter uses). Megatron's side is the project's builder, converter and train step.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from tests._rank_fns_model import causal_mask, hf_model

VOCAB = 512
# head_dim 64 != hidden / heads (32) on purpose: Qwen3 decouples them
_BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
             rope_theta=10000.0, hidden_act="silu", vocab_size=VOCAB, tie_word_embeddings=False)
QWEN3 = dict(_BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
QWEN3_MOE = dict(_BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True, router_aux_loss_coef=0.0)
EXPERT_MARK = ".mlp.experts."
SEQ = 16
LR = 1e-3


def save_models(root: str) -> dict:
    """{name: HF folder} of the tiny models (fp32, norms perturbed away from 1)."""
    dirs = {}
    for name, cfg in (("qwen3", QWEN3), ("qwen3_moe", QWEN3_MOE),
                      ("qwen3_moe_unnormed", dict(QWEN3_MOE, norm_topk_prob=False))):
        dirs[name] = os.path.join(root, name)
        hf_model(cfg).save_pretrained(dirs[name])
    return dirs


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [2, SEQ], loss weights [2, SEQ, VOCAB]) of batch ``index``; tokens start at 1
    (HF zeroes the gradient of its padding row 0, Megatron does not)."""
    gen = torch.Generator().manual_seed(100 + index)
    return (torch.randint(1, VOCAB, (2, SEQ), generator=gen),
            torch.randn(2, SEQ, VOCAB, generator=gen))


def read_safetensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def hf_reference(hf_dir: str, index: int) -> tuple[torch.Tensor, dict]:
    """transformers' (logits, {saved name: gradient of sum(logits * w)}) on batch ``index``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float()
    tokens, weights = batch(index)
    logits = model(tokens).logits
    (logits * weights).sum().backward()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.grad if param.grad is not None else torch.zeros_like(param))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return logits.detach(), read_safetensors(tmp)


def _megatron_logits_and_grads(chunks, index: int) -> tuple[torch.Tensor, dict]:
    """Full-vocabulary logits and HF-named gradients (gathered over TP and EP by the export)."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.convert import export_hf_weights

    model = chunks[0]
    tokens, weights = batch(index)
    local = model(tokens, torch.arange(SEQ).expand(2, -1), causal_mask(SEQ))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    cols = local.shape[-1]
    shard = weights.new_zeros(2, SEQ, cols * tp)
    shard[..., :VOCAB] = weights
    (local * shard[..., tp_rank * cols:(tp_rank + 1) * cols]).sum().backward()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    for name, param in model.named_parameters():
        # each TP rank normalises only its heads: Megatron's finalize_model_grads sums these
        # over TP in training (train_fn covers that path)
        if "q_layernorm" in name or "k_layernorm" in name:
            dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.grad if param.grad is not None else torch.zeros_like(param))
    grads = {name: tensor.clone() for name, tensor in export_hf_weights(chunks)}
    return torch.cat(parts, dim=-1)[..., :VOCAB], grads


def _relative(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12))
               for k in want) if want else 0.0


def parity_fn(rank, world_size, dirs: dict, references: dict):
    """Logits and gradients vs transformers at each layout; every rank runs its own batch
    (``rank``) unless TP ties the two ranks to one batch. Expert gradients then hold both
    ranks' tokens (each expert lives on one EP rank and sees every rank's tokens routed to it):
    the reference for them is the sum of the two batches' gradients."""
    from megatron_dgpo.convert import load_model
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    layouts = [  # (model, tp, ep, overrides)
        ("qwen3", 2, 1, {}),
        ("qwen3", 1, 1, {}),
        ("qwen3_moe", 1, 1, {}),
        ("qwen3_moe", 1, 2, {}),
        ("qwen3_moe", 1, 2, {"moe_token_dispatcher_type": "allgather"}),
        ("qwen3_moe_unnormed", 1, 2, {}),
        # activation recomputation (each layer's forward re-run in the backward; on CPU with
        # cpu.py's RNG-state patch)
        ("qwen3_moe", 1, 2, {"recompute_granularity": "full", "recompute_method": "uniform",
                             "recompute_num_layers": 1}),
        # a router that renormalises where HF does not: must fail the comparison
        ("qwen3_moe_unnormed", 1, 2, {"moe_router_pre_softmax": False}),
    ]
    out = []
    for name, tp, ep, overrides in layouts:
        initialize_parallel(ParallelConfig(tensor_parallel=tp, expert_parallel=ep,
                                           expert_tensor_parallel=1), seed=3)
        index = 0 if tp == 2 else rank
        chunks = load_model(dirs[name], **overrides)
        logits, grads = _megatron_logits_and_grads(chunks, index)
        want_logits, want_grads = references[name][index]
        if ep == 2:  # experts saw both ranks' batches
            other = references[name][1 - index][1]
            want_grads = {k: v + other[k] if EXPERT_MARK in k else v
                          for k, v in want_grads.items()}
        out.append(dict(
            name=name, tp=tp, ep=ep, overrides=overrides,
            logits_err=float((logits - want_logits).abs().max()),
            grad_rel=_relative(grads, want_grads),
            expert_grad_rel=_relative(grads, {k: v for k, v in want_grads.items()
                                              if EXPERT_MARK in k}),
            names_equal=set(grads) == set(want_grads),
            dispatcher=chunks[0].config.moe_token_dispatcher_type,
            local_experts=sum(".local_experts." in n for n, _ in chunks[0].named_parameters())))
        destroy_parallel()
    return out


def convert_fn(rank, world_size, dirs: dict, out_root: str):
    """Converter round trips: HF -> torch_dist written at EP=2 and at TP=2 (MoE; experts split
    over expert TP 2 there) and TP=2 (Qwen3), loaded at EP=2, EP=1 and PP=2 / TP=2 and TP=1,
    exported back: each export vs the HF files, bitwise. Checkpoints land in
    ``out_root/<label>_mcore``. An MoE at TP 2 on CPU (no sequence parallelism: the builder
    refuses it for training) is loaded with an explicit ``sequence_parallel=False``, as the
    converter builds it; nothing runs forward."""
    from megatron_dgpo.convert import export_hf_weights, hf_to_megatron, load_model
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    no_sp = dict(sequence_parallel=False)
    cases = [("qwen3_moe", "qwen3_moe", dict(ep=2),
              [(dict(expert_parallel=2, expert_tensor_parallel=1), {}),
               (dict(expert_parallel=1), {}), (dict(pipeline_parallel=2), {})]),
             ("qwen3_moe_tp2", "qwen3_moe", dict(tp=2),
              [(dict(tensor_parallel=2), no_sp), (dict(tensor_parallel=1), {})]),
             ("qwen3", "qwen3", dict(tp=2), [(dict(tensor_parallel=2), {}),
                                             (dict(tensor_parallel=1), {})])]
    out = {}
    for label, name, write_layout, read_layouts in cases:
        ckpt = os.path.join(out_root, f"{label}_mcore")
        initialize_parallel(ParallelConfig(**read_layouts[0][0]))
        hf_to_megatron(dirs[name], ckpt, **write_layout)
        destroy_parallel()
        disk = read_safetensors(dirs[name])
        for layout, overrides in read_layouts:
            initialize_parallel(ParallelConfig(**layout))
            for source in (ckpt, dirs[name]):
                exported = dict(export_hf_weights(load_model(source, **overrides)))
                out[(label, tuple(sorted(layout.items())), source == ckpt)] = (
                    set(exported) == set(disk)
                    # exact: converting and sharding copy the weights (no arithmetic)
                    and all(torch.equal(exported[k], v) for k, v in disk.items()))
            destroy_parallel()
    return out


def train_fn(rank, world_size, dirs: dict, ckpt_root: str):
    """Three DGPO steps of the MoE model with Megatron's optimizer, each at a different layout
    and resumed from the previous step's checkpoint: 1 rank throughout (world_size 1), or
    EP=2 x DP=2 -> EP=1 x DP=2 -> EP=2 on 2 ranks; then one step of dense Qwen3 at TP=world
    (its q/k-norm gradients are partial per TP rank until finalize_model_grads sums them).
    Returns per-step (loss, grad norm) and the final weights of each model."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams
    from megatron_dgpo.algorithm.packing import padded_micro_batch
    from megatron_dgpo.convert import export_hf_weights, load_model
    from megatron_dgpo.convert.safetensors_io import read_hf_config
    from megatron_dgpo.training.policy import wrap_ddp
    from megatron_dgpo.recipe import OptimizerConfig
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_dgpo.training.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from megatron_dgpo.training.optimizer import build_optimizer
    from megatron_dgpo.training.train_step import train_step

    eps = (2, 1, 2) if world_size == 2 else (1, 1, 1)
    layouts = [("qwen3_moe", dict(expert_parallel=ep, expert_tensor_parallel=1)) for ep in eps]
    layouts.append(("qwen3", dict(tensor_parallel=world_size)))
    steps, weights = [], {}
    for step, (name, layout) in enumerate(layouts):
        hf_dir = dirs[name]
        initialize_parallel(ParallelConfig(**layout), seed=5)
        models = wrap_ddp(load_model(hf_dir))
        optimizer = build_optimizer(OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0),
                                    models, lr=LR, bf16=False)
        if 0 < step < len(eps):
            load_checkpoint(os.path.join(ckpt_root, f"step_{step:06d}"), models, optimizer)
        gen = torch.Generator().manual_seed(step)
        seqs = []
        for i in range(4):
            n = 9 + 3 * i
            seqs.append((torch.randint(1, VOCAB, (n,), generator=gen), torch.arange(n) >= 3,
                         -6.2 + 0.3 * torch.randn(n, generator=gen),
                         torch.full((n,), 1.0 if i % 2 else -0.7)))
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        mine = seqs[dp_rank * 4 // dp:(dp_rank + 1) * 4 // dp]
        mbs = [padded_micro_batch(*zip(*mine[k::2])) for k in range(2) if mine[k::2]]
        result = train_step(models, mbs, LossConfig(method="dgpo",
                                                    loss=LossHyperparams()))
        _, grad_norm, _ = optimizer.step()
        steps.append((result.loss, float(grad_norm)))
        if step < len(eps) - 1:
            save_checkpoint(ckpt_root, TrainerState(step=step + 1), models, optimizer,
                            hf_config=read_hf_config(hf_dir), padded_vocab_size=VOCAB,
                            dtype=torch.float32)
        else:
            weights[name] = {k: v.clone() for k, v in export_hf_weights(models)}
        destroy_parallel()
    return dict(steps=steps, weights=weights)
