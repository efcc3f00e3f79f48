"""megatron_dgpo/planner/catalogue.py: the published models' parameter counts against their model
cards, and the model a recipe names when it is a local HF folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dgpo.planner.catalogue import PUBLISHED
from megatron_dgpo.planner.parameters import param_count
from tests._rank_fns_model import TINY_QWEN2
from tests.planner._inputs import run_main


@pytest.mark.parametrize("hub_id, published", [
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 7.62e9),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", 14.8e9),   # 14.77B
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 32.8e9),   # 32.76B
    ("meta-llama/Llama-3.1-70B", 70.6e9),                  # 70.55B
])
def test_formula_counts_match_published_totals(hub_id, published):
    """Model-card totals (safetensors parameter counts) to 3 significant digits."""
    count = param_count(PUBLISHED[hub_id].description)
    digits = 10 ** (len(str(count)) - 3)
    assert round(count / digits) * digits == published


def test_architecture_from_local_hf_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_QWEN2, num_key_value_heads=1)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: {tmp_path}\n")
    code, out, _ = run_main(capsys, [str(recipe), "--gpus-per-node", "4", "--gpu-memory-gb",
                                      "16", "--json"])
    data = json.loads(out)
    assert code == 0
    assert data["model"]["kv_heads"] == 1 and data["model"]["qkv_bias"] is True
    # KV groups = 1: TP must stay 1
    assert {row["layout"]["tp"] for row in data["layouts"]} == {1}


def test_a_tiny_recipe_is_planned_as_the_model_it_creates(capsys):
    """``model.tiny`` is planned from the config the tiny model is created with
    (``tasks.tiny.tiny_config``): the MoE recipe's routed experts included."""
    from megatron_dgpo.tasks.tiny import TINY_MOE

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_cpu.yaml")
    code, out, _ = run_main(capsys, [recipe, "--gpus-per-node", "2",
                                     "--gpu-memory-gb", "16", "--json"])
    model = json.loads(out)["model"]
    assert code in (0, 1)  # a plan (fitting or not), not a refused recipe (2)
    assert (model["experts"], model["layers"]) == (TINY_MOE["num_experts"], 2)
