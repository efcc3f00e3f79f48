"""What the planner's tests share: the repository's recipes, small models whose terms they work
out by hand, workloads, round-number hardware, and ``dgpo-plan`` run in-process."""

from __future__ import annotations

import os
from dataclasses import replace

from megatron_dgpo.models import describe
from megatron_dgpo.plan import main
from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.inputs import GIB, Cluster, Layout, PlannedModel, Workload
from megatron_dgpo.planner.peak import estimate
from megatron_dgpo.planner.steptime import Hardware

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE_14B = os.path.join(ROOT, "recipes", "dgpo_14b.yaml")
RECIPE_14B_ASYNC = os.path.join(ROOT, "recipes", "dgpo_14b_async.yaml")
R1_14B = PUBLISHED["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"]

# h=64, L=4, a=4 heads of d=16, g=2 KV groups, f=96, V=1000, untied, QKV bias (Qwen2)
SMALL = describe(dict(model_type="qwen2", hidden_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      vocab_size=1000, tie_word_embeddings=False))
SMALL_MODEL = PlannedModel("small", SMALL)
# h=64, L=4, a=4 of d=16, g=2, E=8 experts of f_e=32, top-2, untied, q/k norms, no QKV bias
# (Qwen3-MoE)
SMALL_MOE = describe(dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                          vocab_size=1000, tie_word_embeddings=False, num_experts=8,
                          moe_intermediate_size=32, num_experts_per_tok=2))
SMALL_MOE_MODEL = PlannedModel("small_moe", SMALL_MOE)
# round numbers, so that the expected seconds are arithmetic on the page
ROUND = Hardware("round", peak_tflops=100, hbm_gb_per_s=1000, nvlink_gb_per_s=100,
                 network_gb_per_s=10, pcie_gb_per_s=20, train_mfu=0.5,
                 decode_hbm_efficiency=0.5, decode_mfu=0.5, prefill_mfu=0.5, wake_sleep_s=3.0,
                 decode_step_overhead_s=0.001, refit_gb_per_s=10, refit_s_per_tensor=0.001,
                 sampling_s_per_row_vocab=1e-9, seeded_sampling_s_per_row_vocab=1e-8)


def with_dims(desc, **changes):
    """``desc`` with some of its dimensions changed (a what-if)."""
    return replace(desc, dims=replace(desc.dims, **changes))


def small_work(**changes) -> Workload:
    """A colocated workload at SMALL's scale: 4096-token rows, 64 responses of 1024 tokens."""
    base = dict(micro_batch_tokens=4096, responses_per_update=64, max_sequence=1024,
                recompute=False, distributed_optimizer=True, dtype_bytes=2, grad_dtype_bytes=4,
                log_prob_chunk_size=256, colocated_rollout=True, rollout_tp=1,
                rollout_dtype_bytes=2, gpu_memory_utilization=0.5,
                kv_cache_memory_bytes=1 << 30, max_num_seqs=4, overhead_bytes=0)
    base.update(changes)
    return Workload(**base)


def dedicated_work(**changes) -> Workload:
    """The same rows with dedicated engines of 2 GPUs at 85% of their memory."""
    base = dict(micro_batch_tokens=4096, responses_per_update=64, max_sequence=1024,
                colocated_rollout=False, rollout_placement="dedicated",
                rollout_tp=2, gpu_memory_utilization=0.85, overhead_bytes=GIB)
    base.update(changes)
    return Workload(**base)


def moe_estimate(layout: Layout, **work):
    """SMALL_MOE's peak GPU at ``layout`` on 2 x 8 GPUs, no engine on them."""
    return estimate(SMALL_MOE_MODEL, Cluster(gpus_per_node=8, nodes=2, gpu_memory_gb=80), layout,
                    small_work(colocated_rollout=False, **work))


def run_main(capsys, argv):
    """``dgpo-plan argv``: (exit status, stdout, stderr)."""
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
