"""The pieces the trainer wires together, each built from its own config section.

Functions marked *collective* must be called on every rank; the others run on rank 0 only
(rollout, rewards, prompts and files the run writes once).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dgpo.config import to_dict
from megatron_dgpo.losses import summarize_metrics
from megatron_dgpo.recipe import DataConfig, ModelConfig, OptimizerConfig, RolloutConfig, RunConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------ model, optimizer

def initial_model(config: ModelConfig, run_dir: Path, seed: int) -> Path:
    """Collective: the HF folder of the initial policy. ``model.tiny`` creates one once under
    ``<run_dir>/initial_model`` (kept for resuming); a hub id is downloaded on rank 0."""
    target = None
    if dist.get_rank() == 0:
        target = _materialise_model(config, run_dir, seed)
    box = [str(target) if target else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _materialise_model(config: ModelConfig, run_dir: Path, seed: int) -> Path:
    if config.tiny is not None:
        from megatron_dgpo.tiny import make_tiny_model

        target = run_dir / "initial_model"
        if not (target / "config.json").is_file():
            staging = run_dir / ".initial_model.incomplete"
            shutil.rmtree(staging, ignore_errors=True)
            make_tiny_model(staging, **{"seed": seed, **config.tiny})
            os.replace(staging, target)
        return target
    if Path(config.path).is_dir():
        if not (Path(config.path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {config.path} has no config.json")
        return Path(config.path)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"model.path: {config.path} is not a folder and HF_HUB_OFFLINE=1")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(config.path, allow_patterns=["*.json", "*.safetensors",
                                                                "*.model", "*.txt", "*.jinja"]))


def policy(config: ModelConfig, hf_dir: Path, optimizer: OptimizerConfig):
    """Collective: this rank's DDP-wrapped model chunks loaded from ``hf_dir``, the HF config
    and the parameter dtype. bf16 models get Megatron's Float16Module (fp32 logits out)."""
    from megatron_dgpo.convert.safetensors_io import read_hf_config
    from megatron_dgpo.convert import load_model
    from megatron_dgpo.optimizer import use_distributed_optimizer
    from megatron_dgpo.train_step import wrap_ddp

    dtype = _DTYPES[config.dtype]
    overrides = {"bf16": True} if dtype == torch.bfloat16 else {}
    if config.recompute_activations:
        overrides.update(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    chunks = load_model(str(hf_dir), dtype=dtype, **overrides)
    if dtype == torch.bfloat16:
        from megatron.core.transformer.module import Float16Module

        chunks = [_keep_spec(Float16Module(c.config, c), c) for c in chunks]
    models = wrap_ddp(chunks, use_distributed_optimizer=use_distributed_optimizer(optimizer))
    return models, read_hf_config(str(hf_dir)), dtype


def _keep_spec(wrapper, chunk):
    wrapper.hf_spec = chunk.hf_spec
    return wrapper


def count_parameters(hf_dir: Path) -> float:
    """Parameters of the HF checkpoint (for ``optimizer.lr: auto`` without nominal_params)."""
    from megatron_dgpo.convert.safetensors_io import LazyHFReader

    reader = LazyHFReader(str(hf_dir))
    return float(sum(math.prod(reader.shape_dtype(name)[0]) for name in reader.names()))


def padded_vocab(models: list) -> int:
    from megatron_dgpo.model import unwrap_model

    return int(unwrap_model(models[0]).vocab_size)


# --------------------------------------------------------------------------------- rank 0 only

def save_resolved_config(cfg: RunConfig, run_dir: Path) -> None:
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def run_record(cfg: RunConfig, lr: float) -> dict:
    """What a checkpoint records about the run (the layout decides whether RNG is restored)."""
    from megatron.core import parallel_state as ps

    return {"layout": {"tensor_parallel": ps.get_tensor_model_parallel_world_size(),
                       "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
                       "data_parallel": ps.get_data_parallel_world_size()},
            "learning_rate": lr, "config": to_dict(cfg)}


def prompts(data: DataConfig, rollout: RolloutConfig, hf_dir: Path):
    """(records, tokenizer): the training prompts, each with ``token_ids`` rendered by the
    policy's chat template; prompts longer than ``rollout.max_prompt_tokens`` are dropped."""
    from transformers import AutoTokenizer

    from megatron_dgpo.data import (boxed_instruction, builtin_prompts, load_prompt_dataset,
                                    render_prompt)

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    if data.source == "builtin":
        records = builtin_prompts(data.builtin_families)
    else:
        records = load_prompt_dataset(data.source, prompt_key=data.prompt_field,
                                      answer_key=data.answer_field)
    if data.boxed_instruction:
        records = [boxed_instruction(r) for r in records]
    rendered = [(r, render_prompt(tokenizer, r)) for r in records]
    kept = [(r, ids) for r, ids in rendered if len(ids) <= rollout.max_prompt_tokens]
    if not kept:
        raise ValueError(f"data.source {data.source!r}: no prompt fits in "
                         f"rollout.max_prompt_tokens={rollout.max_prompt_tokens}")
    return kept, tokenizer


def rollout_engine(config: RolloutConfig, hf_dir: Path):
    """The rollout engine on ``hf_dir`` (vLLM, or transformers' generate)."""
    if config.engine == "hf":
        from megatron_dgpo.rollout import HFEngine

        return HFEngine(str(hf_dir))
    from megatron_dgpo.rollout import VLLMConfig, VLLMEngine

    return VLLMEngine(VLLMConfig(
        model=str(hf_dir), dtype=config.dtype, seed=0,
        max_model_len=config.max_prompt_tokens + config.max_response_tokens,
        max_num_seqs=config.max_num_seqs, tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes, engine_kwargs=config.engine_kwargs))


def reward_pool():
    from megatron_dgpo.rewards import RewardPool

    return RewardPool(num_workers=max(1, min(8, (os.cpu_count() or 2) // 2)))


def rollout(engine, pool, tokenizer, prompts, indices: list[int], config: RolloutConfig, *,
            seed: int):
    """Generate ``group_size`` responses for each prompt of ``indices`` and grade them."""
    from megatron_dgpo.experience import Experience

    groups = engine.generate([prompts[i][1] for i in indices], n=config.group_size,
                             temperature=config.temperature, top_p=config.top_p,
                             max_tokens=config.max_response_tokens, seed=seed)
    samples = [s for g in groups for s in g]
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    truths = [prompts[i][0].ground_truth for i in indices for _ in range(config.group_size)]
    rewards = pool.score(texts, truths, grader="train")
    return Experience(prompt_tokens=[list(prompts[i][1]) for i in indices
                                     for _ in range(config.group_size)],
                      response_tokens=[list(s.token_ids) for s in samples],
                      rollout_logprobs=[list(s.logprobs) for s in samples],
                      rewards=[float(r) for r in rewards],
                      truncated=[s.finish_reason == "length" for s in samples])


def progress_bar(cfg: RunConfig, done: int, *, enabled: bool):
    if not (enabled and cfg.logging.progress_bar):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=done, desc="dgpo", unit="step", dynamic_ncols=True)


def advance(bar, metrics: dict) -> None:
    if bar is None:
        return
    bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:+.3f}",
                    acc=f"{metrics['rollout/accuracy']:.3f}",
                    s=f"{metrics['time/step']:.1f}")
    bar.update(1)


def export_final(checkpoint: Path, out_dir: Path, dtype_name: str | None, convert) -> None:
    """The final checkpoint as an HF folder, written next to ``out_dir`` then renamed in."""
    staging = out_dir.with_name(out_dir.name + ".incomplete")
    shutil.rmtree(staging, ignore_errors=True)
    convert(str(checkpoint), str(staging), dtype=_DTYPES[dtype_name] if dtype_name else None)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(staging, out_dir)


# ------------------------------------------------------------------------------------ metrics

def mismatch_metrics(rows, group=None) -> dict[str, float]:
    """Collective over ``group`` (the DP group; None: no reduction): rollout-engine vs trainer log-probs of the sampled tokens.

    mean/max |d|, mean d, exp(mean|d|) - 1 per token, and per sequence the mean of
    exp(sum_t |d_t|) - 1 (``rollout.logprob_mismatch``'s definitions, with packed rows split
    into their sequences), d = trainer - rollout log-prob.
    """
    sums = torch.zeros(5, dtype=torch.float64)  # sum|d|, sum d, tokens, sum seq err, sequences
    largest = torch.zeros(1, dtype=torch.float64)
    for row in rows:
        d = (row.per_token["old_logprobs"].double() - row.per_token["rollout_logprobs"].double())
        d = torch.where(row.loss_mask, d, 0.0)
        per_seq = torch.zeros(len(row.cu_seqlens) - 1, dtype=torch.float64)
        per_seq.scatter_add_(0, row.segment_ids(), d.abs())
        sums += torch.stack([d.abs().sum(), d.sum(), row.loss_mask.sum().double(),
                             torch.expm1(per_seq.clamp(max=50.0)).sum(),
                             torch.tensor(float(len(per_seq)), dtype=torch.float64)])
        largest = torch.maximum(largest, d.abs().max().reshape(1))
    if group is not None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        sums, largest = sums.to(device), largest.to(device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    abs_sum, signed_sum, tokens, seq_err, sequences = sums.tolist()
    mean_abs = abs_sum / max(tokens, 1.0)
    return {"mismatch/mean_abs_diff": mean_abs, "mismatch/max_abs_diff": float(largest.item()),
            "mismatch/mean_diff": signed_sum / max(tokens, 1.0),
            "mismatch/token_mult_error": math.expm1(mean_abs),
            "mismatch/seq_mult_error": seq_err / max(sequences, 1.0)}


def update_metrics(merged: dict, grad_norms: list[float], skipped: int, lr: float) -> dict:
    """The mini-batch updates of one step: the loss's region fractions and F statistics over
    all of them (the paper's Fig. 4 analysis), entropy, grad norms, skips, learning rate."""
    summary = summarize_metrics(merged)
    tokens = float(merged["tokens_count"])
    out = {f"train/{k}": v for k, v in summary.items()}
    out["train/entropy"] = float(merged["entropy_sum"]) / tokens if tokens else math.nan
    out["train/loss"] = float(merged["loss_sum"]) / tokens if tokens else math.nan
    finite = [g for g in grad_norms if math.isfinite(g)]
    out["train/grad_norm"] = sum(finite) / len(finite) if finite else math.nan
    out["train/grad_norm_max"] = max(finite) if finite else math.nan
    out["train/updates"] = float(len(grad_norms))
    out["train/skipped_updates"] = float(skipped)
    out["train/lr"] = lr
    return out

