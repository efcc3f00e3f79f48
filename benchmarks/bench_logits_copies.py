"""Benchmark: how many copies of the logits shard one training micro-batch holds at its peak.

The planner (``memory_terms.logits_bytes``) counts two copies of the last stage's [S, V_pad / TP]
logits: the output layer's result, which the log-prob kernel saves, and its gradient, plus the
kernel's float32 chunk buffers. A third copy would come from Megatron's ``Float16Module``
upcasting the output to fp32 (``fp32_output=True``, its default) or from ``GPTModel``'s
``logits.transpose(0, 1).contiguous()`` with more than one sequence per micro-batch. This
script runs the project's own ``train_step`` (real Megatron-Core ``GPTModel``, one gloo rank)
on a model whose logits dominate its memory, one packed row of S tokens, and reports the peak
extra resident memory of the step in multiples of the logits shard:

* bf16 parameters inside ``Float16Module`` (the GPU recipe's path; ``train_step`` asks for
  ``fp32_output=False``), and the same model called with Float16Module's default
  (``fp32_output=True``) for comparison;
* float32 parameters (the CPU recipe's path).

Method as ``bench_logprob.py``: ``/proc/self/clear_refs`` resets VmHWM before the step, the peak
extra is ``VmHWM - RSS_before``; glibc returns large freed blocks (``MALLOC_MMAP_THRESHOLD_``
is set to 1 MiB below), so RSS follows live tensors. The weights, their fp32 gradients and the
optimizer-free step's other buffers are small next to the logits (h = 64, V = 131072).

    python benchmarks/bench_logits_copies.py [--tokens 2048] [--vocab 131072]
"""

from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "1048576":  # before the allocator starts
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_logprob import _hwm_kib, _reset_hwm, _rss_kib  # noqa: E402


def _micro_batch(tokens: int, vocab: int):
    from megatron_dgpo.algorithm.packing import MicroBatch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    return MicroBatch(tokens=ids, position_ids=torch.arange(tokens), targets=ids.roll(-1),
                      loss_mask=torch.ones(tokens, dtype=torch.bool),
                      cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32),
                      advantages=torch.ones(tokens),
                      old_logprobs=torch.full((tokens,), -float(torch.log(torch.tensor(vocab)))))


def _peak_copies(models, mb, shard_bytes: int, fp32_output: bool | None) -> float:
    """Peak extra memory of one ``train_step`` in logits shards. ``fp32_output`` True replaces
    the kwargs ``train_step`` gives a Float16Module (``fp32_output=False``) with its default."""
    import megatron_dgpo.training.train_step as ts
    from megatron_dgpo.algorithm.losses import LossConfig
    from megatron_dgpo.training.train_step import train_step

    original = ts._forward_kwargs
    if fp32_output:
        ts._forward_kwargs = lambda model: {}
    try:
        train_step(models, [mb], LossConfig(method="dgpo"))  # warm-up: lazy buffers, caches
        before = _rss_kib()
        _reset_hwm()
        train_step(models, [mb], LossConfig(method="dgpo"))
        peak = _hwm_kib() - before
    finally:
        ts._forward_kwargs = original
    return peak * 1024 / shard_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=131072)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron_dgpo.models.builder import build_model, padded_vocab_of
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training.policy import wrap_policy

    initialize_parallel(ParallelConfig())
    hf = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=args.vocab,
              hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=args.tokens, rms_norm_eps=1e-6, rope_theta=10000.0,
              hidden_act="silu", tie_word_embeddings=False)
    from transformers import AutoConfig

    config = AutoConfig.for_model(**hf)
    mb = _micro_batch(args.tokens, args.vocab)
    rows = []
    for name, dtype, fp32_output in (
            ("bf16, Float16Module(fp32_output=False): train_step", torch.bfloat16, False),
            ("bf16, Float16Module's default fp32_output=True", torch.bfloat16, True),
            ("float32 (the CPU recipe)", torch.float32, False)):
        overrides = {"bf16": True} if dtype == torch.bfloat16 else {}
        chunks = build_model(config, dtype=dtype, seed=0, **overrides)
        models = wrap_policy(chunks, use_distributed_optimizer=False)
        shard = args.tokens * padded_vocab_of(models) * (2 if dtype == torch.bfloat16 else 4)
        rows.append((name, shard / 2**20, _peak_copies(models, mb, shard, fp32_output)))
        del models, chunks
    print(f"S = {args.tokens} tokens, V = {args.vocab}, h = 64, one gloo rank (TP1)")
    print(f"{'path':<55} {'shard MiB':>9} {'peak / shard':>12}")
    for name, mib, copies in rows:
        print(f"{name:<55} {mib:>9.0f} {copies:>12.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
