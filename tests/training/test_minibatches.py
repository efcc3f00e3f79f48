"""The trainer's plumbing: prompt order, mini-batch/DP plans, prompts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.recipe import DataConfig
from megatron_dgpo.tasks.prompts import PromptRecord, boxed_instruction, load_prompts, prompt_order
from megatron_dgpo.training.minibatches import pack_update, plan_updates

DAPO = ("Solve the following math problem step by step. The last line of your response should "
        "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
        "problem.\n\n{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")


def test_prompt_order_visits_every_prompt_once_per_epoch_and_resumes():
    stream = prompt_order(7, seed=3, start=0, count=21)
    for epoch in range(3):
        assert sorted(stream[7 * epoch:7 * epoch + 7]) == list(range(7))
    assert stream[:7] != stream[7:14]  # reshuffled per epoch
    assert prompt_order(7, seed=3, start=5, count=9) == stream[5:14]  # a resumed run's view


def test_plan_updates_whole_groups_same_minibatches_whatever_the_replicas():
    """Each replica plans its own groups; mini-batch u's samples (as batch sample indices) are
    the same for 1, 2 or 3 replicas, whole groups, and cover the batch once."""
    from megatron_dgpo.rollout.placement import shard_prompts

    P, G, U = 12, 4, 3
    lengths = [5 + (i * 7) % 23 for i in range(P * G)]

    def global_plan(replicas):
        merged = [set() for _ in range(U)]
        for d in range(replicas):
            share = shard_prompts(P, replicas, d)
            local = lengths[share.start * G:share.stop * G]
            for u, members in enumerate(plan_updates(share.start, len(share), G, U, local)):
                assert members and sorted(members, key=lambda i: (-local[i], i)) == members
                merged[u] |= {share.start * G + i for i in members}
        return merged

    single = global_plan(1)
    assert sorted(i for update in single for i in update) == list(range(P * G))
    for u, update in enumerate(single):  # whole groups, strided over the batch's positions
        groups = {i // G for i in update}
        assert update == {g * G + j for g in groups for j in range(G)}
        assert groups == {p for p in range(P) if p % U == u}
    assert global_plan(2) == single and global_plan(3) == single
    with pytest.raises(ValueError, match="train.mini_batch_prompts"):
        plan_updates(0, 2, G, U, lengths[:2 * G])


def test_boxed_instruction_rewrites_dapo_prompts():
    record = PromptRecord(({"role": "user", "content": DAPO.format(problem="Find $x$: $2x=4$.")},), "2")
    text = boxed_instruction(record).messages[0]["content"]
    assert text.startswith("Find $x$: $2x=4$.") and text.endswith("within \\boxed{}.")
    assert "Answer:" not in text
    boxed = PromptRecord(({"role": "user", "content": "Put 3 in \\boxed{}."},), "3")
    assert boxed_instruction(boxed).messages[0]["content"] == "Put 3 in \\boxed{}."


def test_prompts_from_a_dapo_file_are_rewritten_rendered_and_length_filtered(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": DAPO.format(problem=p)}],
             "reward_model": {"ground_truth": a}}
            for p, a in (("What is 2+3?", "5"), ("Long " * 300 + "problem?", "1"))]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, tokenizer = load_prompts(DataConfig(source=str(path), boxed_instruction=True),
                                   tiny_model_dir, max_prompt_tokens=200)
    assert [record.ground_truth for record, _ in kept] == ["5"]  # the long one is dropped
    text = tokenizer.decode(kept[0][1])
    assert "\\boxed{}" in text and "Answer:" not in text and text.endswith("assistant\n")


def test_thd_params_carry_the_packers_cu_seqlens():
    from megatron_dgpo.training.train_step import _packed_seq_params

    batch = Experience(prompt_tokens=[[1, 2, 3], [4, 5], [6, 7, 8, 9]],
                       response_tokens=[[10, 11], [12, 13, 14, 15], [16]],
                       rollout_logprobs=[[0.0] * 2, [0.0] * 4, [0.0]], rewards=[0.0] * 3,
                       truncated=[False] * 3, advantages=torch.zeros(3))
    (row,) = pack_update(batch, [0, 1, 2], budget=64, pad_multiple=4)
    params = _packed_seq_params(row, "cpu")
    # exact: integer offsets
    assert torch.equal(params.cu_seqlens_q, row.cu_seqlens) and params.qkv_format == "thd"
    # exact: integers
    assert params.max_seqlen_q == int((row.cu_seqlens[1:] - row.cu_seqlens[:-1]).max())


def test_loss_weights_travel_from_the_batch_to_the_packed_rows():
    """The trainer's issue-14 hook: per-sample weights (group_token_mean, one group dropped)
    land on exactly the response targets of their sample; None stays None."""
    from megatron_dgpo.algorithm.advantages import drop_degenerate_groups
    from megatron_dgpo.algorithm.losses import sample_loss_weights

    batch = Experience(prompt_tokens=[[1, 2, 3], [4, 5], [6, 7, 8, 9], [1, 2]],
                       response_tokens=[[10, 11], [12, 13, 14, 15], [16], [17, 18, 19]],
                       rollout_logprobs=[[-1.0, -2.0], [-0.5, -0.1, -3.0, -1.5], [-0.2],
                                         [-1.0] * 3],
                       rewards=[1.0, -1.0, 1.0, 1.0], truncated=[False] * 4,
                       advantages=torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert all(row.loss_weights is None for row in pack_update(batch, [0, 1, 2, 3], 12, 1))
    kept = drop_degenerate_groups(batch.rewards, 2)
    batch.loss_weights = sample_loss_weights([len(r) for r in batch.response_tokens], 2,
                                             "group_token_mean", kept.keep)
    # exact: 1 / 6 is one correctly rounded IEEE division of integers in torch as in Python; 0
    # is torch.where's
    assert batch.loss_weights.tolist() == [1 / 6, 1 / 6, 0.0, 0.0]
    for row in pack_update(batch, [0, 1, 2, 3], budget=12, pad_multiple=1):
        ends = row.cu_seqlens.tolist()
        want = torch.zeros(len(row.tokens), dtype=torch.float64)
        for k, sample in enumerate(row.sample_indices):
            start = ends[k] + len(batch.prompt_tokens[sample]) - 1
            want[start:start + len(batch.response_tokens[sample])] = batch.loss_weights[sample]
        assert row.loss_weights.dtype == torch.float64
        # exact: copies of the sample weights
        assert torch.equal(row.loss_weights, want)
        assert torch.equal(row.loss_weights > 0, row.loss_mask & (want > 0))  # exact: booleans


def test_rollout_roles_split_whole_groups_over_engines_and_refuse_engines_across_replicas():
    from megatron_dgpo.rollout.placement import engine_tensor_parallel, rollout_role

    def roles(world, tp, pp, engine_tp, colocated=True, P=10):
        dp = world // (tp * pp)
        out = []
        for rank in range(world):  # Megatron's order tp-dp-pp: PP outermost
            d = (rank // tp) % dp
            members = [q * tp * dp + d * tp + k for q in range(pp) for k in range(tp)]
            out.append(rollout_role(colocated=colocated, engine_tp=engine_tp, rank=rank,
                                    world_size=world, replica_ranks=members, dp_rank=d,
                                    dp_size=dp, num_prompts=P))
        return out

    # DP=2 x TP=2, one TP=2 engine per replica: replica shares are the engines' shares.
    r = roles(4, 2, 1, engine_tp_default := engine_tensor_parallel(None, tensor_parallel=2,
                                                                    pipeline_parallel=1,
                                                                    data_parallel=2))
    assert engine_tp_default == 2 and [x.prompts for x in r] == [range(0, 5)] * 2 + [range(5, 10)] * 2
    assert [x.grades for x in r] == [True, False, True, False] and r[0].num_engines == 2
    # TP=2 trainer, engines of 1 rank: two engines per replica split its share.
    r = roles(4, 2, 1, 1)
    assert [x.prompts for x in r] == [range(0, 3), range(3, 5), range(5, 8), range(8, 10)]
    assert all(x.grades for x in r) and r[0].active_engines == 4
    # Separate engines: the replica leader only.
    r = roles(4, 2, 1, 1, colocated=False)
    assert [x.has_engine for x in r] == [True, False, True, False] and r[1].prompts == range(0)
    # PP=2, DP=2: the default engine is one per stage (TP); TP x PP would span replicas.
    assert engine_tensor_parallel(None, tensor_parallel=1, pipeline_parallel=2, data_parallel=2) == 1
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2.*parallel.tensor_parallel"):
        roles(4, 1, 2, 2)


def test_replace_groups_swaps_whole_groups_and_keeps_the_rest():
    """DAPO refill: groups 0 and 2 of a 3-group batch come from another batch, in order."""
    def batch(tag, groups, g=2):
        n = groups * g
        return Experience(prompt_tokens=[[tag, i // g] for i in range(n)],
                          response_tokens=[[tag, i] for i in range(n)],
                          rollout_logprobs=[[-float(i)] for i in range(n)],
                          rewards=[float(tag + i) for i in range(n)],
                          truncated=[bool(i % 2) for i in range(n)])

    old, fresh = batch(0, 3), batch(100, 2)
    out = old.replace_groups([0, 2], fresh, 2)
    assert out.response_tokens == [[100, 0], [100, 1], [0, 2], [0, 3], [100, 2], [100, 3]]
    assert out.rewards == [100.0, 101.0, 2.0, 3.0, 102.0, 103.0]
    assert out.prompt_tokens[4] == [100, 1] and out.truncated == [False, True] * 3
    assert old.response_tokens[0] == [0, 0]  # a copy: the original is unchanged


# Three groups of four under a cap of 8 tokens: group 1 is all truncated (a fully filtered
# group), group 0 has one truncated sample, group 2 none.
CAP, WINDOW, G = 8, 3, 4
OVERLONG_LENGTHS = [8, 5, 2, 7, 8, 8, 8, 8, 1, 3, 6, 4]
OVERLONG_REWARDS = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0]


def _overlong_batch() -> Experience:
    gen = torch.Generator().manual_seed(5)
    return Experience(prompt_tokens=[[1, 2]] * len(OVERLONG_LENGTHS),
                      response_tokens=[[3 + (i + t) % 20 for t in range(n)]
                                       for i, n in enumerate(OVERLONG_LENGTHS)],
                      rollout_logprobs=[(-torch.rand(n, generator=gen, dtype=torch.float64))
                                        .tolist() for n in OVERLONG_LENGTHS],
                      rewards=list(OVERLONG_REWARDS),
                      truncated=[n == CAP for n in OVERLONG_LENGTHS])


def _packed_loss(batch: Experience, logp_seed: int = 0):
    """The step's loss over the trainer's packed rows as train_step forms it (its valid mask
    and weights, normalised by the mini-batch's weight sum), with the gradient of every row's
    log-probs."""
    from megatron_dgpo.algorithm.losses import LossHyperparams, policy_loss
    from megatron_dgpo.training.train_step import _valid_and_weights

    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens)]
    (indices,) = plan_updates(0, len(batch) // G, G, 1, lengths)
    rows = pack_update(batch, indices, budget=24, pad_multiple=1)
    gen = torch.Generator().manual_seed(logp_seed)
    logps, total, weight_sum, terms = [], 0.0, 0.0, []
    for row in rows:
        row.old_logprobs = torch.where(row.loss_mask, row.rollout_logprobs.double() - 0.05, 0.0)
        valid, weights = _valid_and_weights(row)
        weights = torch.ones_like(row.old_logprobs) if weights is None else weights
        weight_sum += float(torch.where(valid, weights, 0.0).sum())
        logp = (row.old_logprobs + 0.3 * torch.randn(len(row.tokens), generator=gen,
                                                     dtype=torch.float64)).requires_grad_(True)
        logps.append(logp)
        terms.append((row, logp, valid, weights))
    for row, logp, valid, weights in terms:
        loss, _ = policy_loss("dgpo", logp, row.old_logprobs, row.advantages.double(), valid,
                              LossHyperparams(), num_tokens=weight_sum, weights=weights)
        total = total + loss
    total.backward()
    for row in rows:  # the rows name samples by their place in the packed list
        row.sample_indices = [indices[k] for k in row.sample_indices]
    return rows, logps, total.detach()


def _grads_of(batch, rows, logps, samples):
    """The gradient on the response targets of the batch's ``samples`` in the packed rows."""
    out = []
    for row, logp in zip(rows, logps):
        ends = row.cu_seqlens.tolist()
        for k, i in enumerate(row.sample_indices):
            start = ends[k] + len(batch.prompt_tokens[i]) - 1
            if i in samples:
                out.append(logp.grad[start:start + len(batch.response_tokens[i])])
    return torch.cat(out)


def _assign(batch, **algorithm) -> dict[str, float]:
    """The trainer's step: ``batch_advantages`` of the recipe section, set on the batch."""
    from megatron_dgpo.algorithm.advantages import batch_advantages
    from megatron_dgpo.recipe import AlgorithmConfig

    adv = batch_advantages(batch, AlgorithmConfig(**algorithm), group_size=G,
                           max_response_tokens=CAP)
    batch.advantages, batch.loss_weights = adv.advantages, adv.loss_weights
    return adv.stats


@pytest.mark.parametrize("aggregation", ["token_mean", "group_token_mean", "seq_mean_token_mean"])
def test_a_truncated_sample_contributes_nothing_to_the_loss_through_the_trainers_path(
        aggregation):
    """advantages.batch_advantages (the trainer's) -> plan_updates -> pack_update
    -> train_step's valid mask and weights -> policy_loss: with the overlong filter the
    truncated samples' tokens get no gradient and their log-probs, old log-probs and
    advantages can be anything without changing the loss; without it they do train. The
    penalty enters the rewards before the group advantages."""
    from megatron_dgpo.algorithm.advantages import group_advantages

    truncated = {i for i, n in enumerate(OVERLONG_LENGTHS) if n == CAP}
    batch = _overlong_batch()
    stats = _assign(batch, loss_aggregation=aggregation, overlong_filter=True,
                    overlong_penalty_window=WINDOW)
    # R_length by hand: 0 up to 5 tokens, then -1/3, -2/3, -1 at 6, 7, 8 tokens
    by_hand = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0, 6: -1 / 3, 7: -2 / 3, 8: -1.0}
    penalty = [by_hand[n] for n in OVERLONG_LENGTHS]
    shaped = torch.tensor(OVERLONG_REWARDS, dtype=torch.float64) + torch.tensor(
        penalty, dtype=torch.float64)
    torch.testing.assert_close(batch.advantages, group_advantages(shaped, G)[0], rtol=1e-6,
                               atol=1e-6)
    assert batch.rewards == OVERLONG_REWARDS  # the task rewards stay as graded
    assert stats["adv/overlong_filtered_frac"] == len(truncated) / len(OVERLONG_LENGTHS)
    assert stats["adv/overlong_penalized_frac"] == 7 / 12
    assert stats["adv/overlong_penalty_mean"] == pytest.approx(sum(penalty) / 12, rel=1e-15)
    assert stats["adv/reward_mean"] == pytest.approx(float(shaped.mean()), rel=1e-15)
    # exact: 0 is written for exactly the truncated samples
    zero = [i for i, c in enumerate(batch.loss_weights.tolist()) if c == 0]
    assert zero == sorted(truncated)

    rows, logps, loss = _packed_loss(batch)
    assert not _grads_of(batch, rows, logps, truncated).any()
    assert _grads_of(batch, rows, logps, set(range(len(batch))) - truncated).abs().min() > 0

    changed = _overlong_batch()
    for i in truncated:  # whatever the truncated samples hold, the loss is the same
        changed.rollout_logprobs[i] = [-5.0] * len(changed.rollout_logprobs[i])
    _assign(changed, loss_aggregation=aggregation, overlong_filter=True,
            overlong_penalty_window=WINDOW)
    changed.advantages[sorted(truncated)] = 7.0
    rows_changed, _, loss_changed = _packed_loss(changed)
    assert rows_changed[0].sample_indices == rows[0].sample_indices  # exact: integers
    # exact: the same kept terms in the same order; the filtered ones are masked to 0 either way
    assert loss_changed.item() == loss.item()

    unfiltered = _overlong_batch()  # the filter off: the same samples do train
    _assign(unfiltered, loss_aggregation=aggregation, overlong_penalty_window=WINDOW)
    rows_off, logps_off, _ = _packed_loss(unfiltered)
    assert _grads_of(unfiltered, rows_off, logps_off, {0}).abs().min() > 0
