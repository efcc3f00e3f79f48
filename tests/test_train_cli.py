"""dgpo-train's command line: config errors name the key, --describe documents every key."""

from __future__ import annotations

import pytest

from megatron_dgpo.recipe import RunConfig, load_recipe
from megatron_dgpo.runtime.config import describe
from megatron_dgpo.train import main

RECIPE = "recipes/tiny_cpu.yaml"


@pytest.mark.parametrize("override, message", [
    ("algorithm.metod=grpo", "unknown key 'algorithm.metod'; did you mean 'algorithm.method'?"),
    ("train.steps=many", "train.steps: expected an integer, got 'many'"),
    ("algorithm.method=ppo", "method must be one of grpo, cispo, gppo, ce_gppo, aspo, dgpo, gspo"),
    ("algorithm.method=gspo", "method gspo spreads each sample's gradient over its tokens as GSPO's"),
    ("optimizer.lr=fast", "optimizer.lr: expected float > 0 | 'auto', got 'fast'"),
    ("optimizer.lr=-1", "optimizer.lr: expected float > 0 | 'auto', got -1"),
    ("optimizer.lr=.nan", "optimizer.lr: expected float > 0 | 'auto', got nan"),
    # values outside their meaning: each bound declared beside its field (runtime/config.Bounds)
    ("optimizer.clip_grad=-1", "optimizer.clip_grad must be >= 0, got -1.0"),
    ("optimizer.adam_beta2=1", "optimizer.adam_beta2 must be in [0, 1), got 1.0"),
    ("optimizer.weight_decay=.inf", "optimizer.weight_decay must be a finite number >= 0, got inf"),
    ("optimizer.adam_eps=0", "optimizer.adam_eps must be > 0, got 0.0"),
    ("train.steps=0", "train.steps must be >= 1, got 0"),
    ("train.max_minutes=0", "train.max_minutes must be > 0, got 0.0"),
    ("train.log_prob_chunk_size=0", "train.log_prob_chunk_size must be >= 1, got 0"),
    ("parallel.tensor_parallel=0", "parallel.tensor_parallel must be >= 1, got 0"),
    ("parallel.watchdog_minutes=0.01", "parallel.watchdog_minutes must be >= 0.05, got 0.01"),
    ("model.moe_aux_loss_coeff=-1", "model.moe_aux_loss_coeff must be >= 0, got -1.0"),
    ("model.nominal_params=0", "model.nominal_params must be > 0, got 0.0"),
    ("algorithm.advantage_eps=-1", "algorithm.advantage_eps must be >= 0, got -1.0"),
    ("train.mini_batch_prompts=5", "rollout_batch_prompts (32) must be a multiple of mini_batch_prompts (5)"),
    ("algorithm.loss.n=0", "algorithm.loss.n must be >= 1, got 0"),
    ("algorithm.loss.gspo_eps_low=0", "algorithm.loss.gspo_eps_low must be in (0, 1), got 0"),
    ("rollout.max_response_tokens=4096", "train.micro_batch_tokens (1024) cannot hold the longest "
     "sample: rollout.max_prompt_tokens (96) + rollout.max_response_tokens (4096), padded for "
     "TP x CP, is 4192 tokens; set train.micro_batch_tokens=4192 or more"),
    ("algorithm.loss_aggregation=sum", "algorithm.loss_aggregation: expected one of 'token_mean', "
     "'group_token_mean', 'seq_mean_token_mean', got 'sum'"),
    ("algorithm.rollout_correction=is", "algorithm.rollout_correction: expected one of 'none', 'tis', "
     "'token_mask', 'sequence_tis', 'sequence_mask', 'geometric_mask'"),
    ("algorithm.rollout_correction_cap=0.9", "algorithm.rollout_correction_cap must be >= 1, got 0.9"),
    ("algorithm.rollout_correction_high=0.5", "algorithm.rollout_correction_high must be >= 1"),
    ("algorithm.rollout_correction_low=0.5", "algorithm: rollout_correction_low/high bound the "
     "masking corrections (token_mask, sequence_mask, geometric_mask), not rollout_correction: none"),
    ("algorithm.old_logprobs=engine", "algorithm.old_logprobs: expected one of 'trainer', 'rollout'"),
    ("algorithm.old_logprobs_check_every=-2", "algorithm.old_logprobs_check_every must be >= 0"),
    ("algorithm.drop_degenerate_groups=maybe", "algorithm.drop_degenerate_groups: expected true or false"),
    ("train.seed=8388608", "train.seed must be in [0, 8388608), got 8388608"),
    ("algorithm.refill_rounds=2", "refill_rounds refills the groups drop_degenerate_groups drops"),
    ("algorithm.refill_rounds=-1", "algorithm.refill_rounds must be >= 0, got -1"),
    ("algorithm.overlong_filter=maybe", "algorithm.overlong_filter: expected true or false"),
    ("algorithm.overlong_penalty_window=-1", "algorithm.overlong_penalty_window must be >= 0, got -1"),
    ("algorithm.overlong_penalty_window=4", "algorithm.overlong_penalty_window (4) must be below "
     "rollout.max_response_tokens (4)"),
    ("algorithm.overlong_penalty_factor=0", "algorithm.overlong_penalty_factor must be > 0, got 0.0"),
    ("algorithm.overlong_penalty_factor=.inf", "algorithm.overlong_penalty_factor must be a finite "
     "number > 0, got inf"),
    ("eval.evry=2", "unknown key 'eval.evry'; did you mean 'eval.every'?"),
    ("eval.every=-1", "eval.every must be >= 0, got -1"),
    ("eval.every=2", "eval: benchmarks must name at least one benchmark or held-out file"),
    ("eval.at_end=true", "eval: benchmarks must name at least one benchmark or held-out file"),
    ("eval.benchmarks=aime24", "eval.benchmarks: expected a list, got 'aime24'"),
    ("eval.n=0", "eval.n must be >= 1, got 0"),
    ("eval.max_tokens=0", "eval.max_tokens must be >= 1, got 0"),
    ("eval.max_tokens=100", "eval.max_tokens (100) leaves no room for a prompt in the engines' context"),
    ("eval.temperature=0", "eval.temperature must be > 0, got 0.0"),
    ("eval.top_p=1.5", "eval.top_p must be in (0, 1], got 1.5"),
    ("eval.limit=0", "eval.limit must be >= 1, got 0"),
    ("eval.seed=-1", "eval.seed must be in [0, 4611686018427387904), got -1"),
])
def test_bad_overrides_fail_before_anything_starts_and_name_the_key(override, message, capsys):
    assert main([RECIPE, override]) == 2
    assert message in capsys.readouterr().err


def test_micro_batch_budget_holds_the_longest_sample_padded_for_context_parallelism():
    """Prompt + response, padded to 2 x CP x TP (Megatron's zigzag split), must fit one row: at
    CP = 2, 1020 + 4 = 1024 tokens fit a 1024-token budget, 1021 + 4 pads to 1028 and is refused
    at load (on the old code: only max_response_tokens + 1 was checked, and the sample failed
    packing mid-run)."""
    cp2 = ["parallel.context_parallel=2", "train.micro_batch_tokens=1024"]
    assert load_recipe(RECIPE, cp2 + ["rollout.max_prompt_tokens=1020"]).train.micro_batch_tokens == 1024
    with pytest.raises(ValueError, match="is 1028 tokens; set train.micro_batch_tokens=1028"):
        load_recipe(RECIPE, cp2 + ["rollout.max_prompt_tokens=1021"])


def test_missing_recipe_and_misplaced_override_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["train.steps=3"])
    assert "must be a recipe file" in capsys.readouterr().err
    assert main(["recipes/nope.yaml"]) == 2
    assert "recipes/nope.yaml does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["rollout.top_p=0.9"], "which rollout.top_p = 0.9 < 1 makes those of a truncated distribution"),
    (["rollout.max_staleness=1", "rollout.placement=dedicated", "rollout.num_gpus=1"],
     "rollout.max_staleness = 1 needs pi_prox, the trainer's policy at the start of the step"),
    (["rollout.dtype=bfloat16"], "rollout.dtype 'bfloat16' is not the trainer's model.dtype "
     "'float32' ('auto' follows the checkpoint): set rollout.dtype: float32, or accept"),
    (["rollout.dtype=auto"], "rollout.dtype 'auto' is not the trainer's model.dtype"),
    (["algorithm.rollout_correction=tis"], "rollout_correction tis would do nothing; set it to none"),
])
def test_the_bypass_is_refused_where_the_engines_log_probs_are_not_pi_old(overrides, message,
                                                                          capsys):
    assert main([RECIPE, "algorithm.old_logprobs=rollout", *overrides]) == 2
    assert message in capsys.readouterr().err
    accepted = load_recipe(RECIPE, ["algorithm.old_logprobs=rollout", "rollout.dtype=bfloat16",
                                    "algorithm.old_logprobs_accept_dtype_mismatch=true"])
    assert accepted.algorithm.old_logprobs == "rollout"
    assert load_recipe(RECIPE, ["algorithm.old_logprobs=rollout"]).rollout.dtype == "float32"


def test_describe_documents_every_key(capsys):
    assert main(["--describe"]) == 0
    out = capsys.readouterr().out
    rows = describe(RunConfig)
    assert len(rows) > 50
    for key, _, doc in rows:
        assert doc, f"{key} has no documentation under its declaration"
        assert f"{key}  (" in out
    for key in ("algorithm.loss_aggregation", "algorithm.rollout_correction",
                "algorithm.rollout_correction_cap", "algorithm.rollout_correction_low",
                "algorithm.rollout_correction_high", "algorithm.old_logprobs",
                "algorithm.old_logprobs_check_every", "algorithm.loss.gspo_eps_low",
                "algorithm.old_logprobs_accept_dtype_mismatch", "algorithm.drop_degenerate_groups",
                "eval.every", "eval.at_end", "eval.benchmarks", "eval.n", "eval.max_tokens",
                "eval.temperature", "eval.top_p", "eval.limit", "eval.seed"):
        assert f"{key}  (" in out


def test_new_algorithm_keys_default_to_todays_behaviour_and_match_losses():
    from typing import get_args, get_type_hints

    from megatron_dgpo.algorithm.losses import AGGREGATIONS, ROLLOUT_CORRECTIONS
    from megatron_dgpo.recipe import AlgorithmConfig

    cfg = load_recipe(RECIPE, ["algorithm.loss_aggregation=group_token_mean",
                               "algorithm.rollout_correction=tis",
                               "algorithm.rollout_correction_cap=3",
                               "algorithm.drop_degenerate_groups=true"]).algorithm
    assert (cfg.loss_aggregation, cfg.rollout_correction, cfg.rollout_correction_cap,
            cfg.drop_degenerate_groups) == ("group_token_mean", "tis", 3, True)
    default = AlgorithmConfig()
    assert (default.loss_aggregation, default.rollout_correction, default.rollout_correction_cap,
            default.drop_degenerate_groups) == ("token_mean", "none", 2.0, False)
    hints = get_type_hints(AlgorithmConfig)  # the Literal the loader checks = losses' names
    assert get_args(hints["loss_aggregation"]) == AGGREGATIONS
    assert get_args(hints["rollout_correction"]) == ROLLOUT_CORRECTIONS


def test_the_tiny_recipe_loads_with_its_documented_values():
    cfg = load_recipe(RECIPE)
    assert (cfg.algorithm.method, cfg.algorithm.loss.n, cfg.algorithm.loss.m) == ("dgpo", 1, 2)
    assert cfg.train.rollout_batch_prompts // cfg.train.mini_batch_prompts == 4
    assert cfg.data.builtin_families == ["repeat"] and cfg.model.tiny is not None



def test_eval_is_off_by_default_and_due_on_its_schedule():
    from megatron_dgpo.recipe import EvalConfig

    assert not load_recipe(RECIPE).eval.enabled
    assert [s for s in range(1, 8) if EvalConfig().due(s, 7)] == []
    every = EvalConfig(every=3, benchmarks=["aime24"])  # at_end defaults to true with every
    assert [s for s in range(1, 8) if every.due(s, 7)] == [3, 6, 7]
    no_end = EvalConfig(every=3, at_end=False, benchmarks=["aime24"])
    assert [s for s in range(1, 8) if no_end.due(s, 7)] == [3, 6]
    end_only = EvalConfig(at_end=True, benchmarks=["x.jsonl"])
    assert end_only.enabled and [s for s in range(1, 8) if end_only.due(s, 7)] == [7]


def test_overlong_options_are_off_by_default_and_load():
    algorithm = load_recipe(RECIPE).algorithm
    assert (algorithm.overlong_filter, algorithm.overlong_penalty_window) == (False, 0)
    algorithm = load_recipe(RECIPE, ["algorithm.overlong_filter=true",
                                     "algorithm.overlong_penalty_window=3",
                                     "algorithm.overlong_penalty_factor=0.5"]).algorithm
    assert (algorithm.overlong_filter, algorithm.overlong_penalty_window,
            algorithm.overlong_penalty_factor) == (True, 3, 0.5)
