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
