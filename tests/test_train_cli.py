"""dgpo-train's command line: config errors name the key, --describe documents every key."""

from __future__ import annotations

import pytest

from megatron_dgpo.config import describe
from megatron_dgpo.recipe import RunConfig, load_recipe
from megatron_dgpo.train import main

RECIPE = "recipes/tiny_cpu.yaml"


@pytest.mark.parametrize("override, message", [
    ("algorithm.metod=grpo", "unknown key 'algorithm.metod'; did you mean 'algorithm.method'?"),
    ("train.steps=many", "train.steps: expected an integer, got 'many'"),
    ("algorithm.method=ppo", "method must be one of grpo, cispo, gppo, ce_gppo, aspo, dgpo"),
    ("optimizer.lr=fast", "optimizer.lr: expected float | 'auto', got 'fast'"),
    ("train.mini_batch_prompts=5", "rollout_batch_prompts (32) must be a multiple of mini_batch_prompts (5)"),
    ("algorithm.loss.n=0", "algorithm.loss: n must be a positive integer, got 0"),
    ("rollout.max_response_tokens=4096", "train.micro_batch_tokens (1024) must exceed rollout.max_response_tokens"),
    ("algorithm.loss_aggregation=sum", "algorithm.loss_aggregation: expected one of 'token_mean', "
     "'group_token_mean', 'seq_mean_token_mean', got 'sum'"),
    ("algorithm.rollout_correction=is", "algorithm.rollout_correction: expected one of 'none', 'tis'"),
    ("algorithm.rollout_correction_cap=0.9", "algorithm: rollout_correction_cap must be a finite number >= 1"),
    ("algorithm.drop_degenerate_groups=maybe", "algorithm.drop_degenerate_groups: expected true or false"),
    ("train.seed=8388608", "train: seed must be in [0, 2**23)"),
    ("algorithm.refill_rounds=2", "refill_rounds refills the groups drop_degenerate_groups drops"),
    ("algorithm.refill_rounds=-1", "refill_rounds must be an integer >= 0"),
])
def test_bad_overrides_fail_before_anything_starts_and_name_the_key(override, message, capsys):
    assert main([RECIPE, override]) == 2
    assert message in capsys.readouterr().err


def test_missing_recipe_and_misplaced_override_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["train.steps=3"])
    assert "must be a recipe file" in capsys.readouterr().err
    assert main(["recipes/nope.yaml"]) == 2
    assert "recipes/nope.yaml does not exist" in capsys.readouterr().err


def test_describe_documents_every_key(capsys):
    assert main(["--describe"]) == 0
    out = capsys.readouterr().out
    rows = describe(RunConfig)
    assert len(rows) > 50
    for key, _, doc in rows:
        assert doc, f"{key} has no documentation under its declaration"
        assert f"{key}  (" in out
    for key in ("algorithm.loss_aggregation", "algorithm.rollout_correction",  # issue 14
                "algorithm.rollout_correction_cap", "algorithm.drop_degenerate_groups"):
        assert f"{key}  (" in out


def test_new_algorithm_keys_default_to_todays_behaviour_and_match_losses():
    from typing import get_args, get_type_hints

    from megatron_dgpo.losses import AGGREGATIONS, ROLLOUT_CORRECTIONS
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

