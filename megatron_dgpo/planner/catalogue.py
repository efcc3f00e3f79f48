"""The published models the planner knows by hub id (``PUBLISHED``, from the architecture
fields of their config.json), and the model a recipe names (``architecture_for``)."""

from __future__ import annotations

import json
import os

from megatron_dgpo.planner.inputs import PlannedModel

_QWEN2 = dict(model_type="qwen2", vocab_size=152064, tie_word_embeddings=False)
_LLAMA31_70B = dict(model_type="llama", hidden_size=8192, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
                    vocab_size=128256, tie_word_embeddings=False, attention_bias=False)
# every Qwen3 model: head_dim 128 whatever h / a is (Qwen3-32B: 5120 / 64 = 80), untied
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, tie_word_embeddings=False,
              attention_bias=False)
# both released MoE models: 128 experts, top-8, renormalised top-k, every layer MoE (their
# intermediate_size is that of the dense MLP they do not have)
_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  router_aux_loss_coef=0.001)
PUBLISHED_CONFIGS: dict[str, dict] = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(
        _QWEN2, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": dict(
        _QWEN2, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": dict(
        _QWEN2, hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=13824),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": dict(
        _QWEN2, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=27648),
    # Llama-3.3-70B-Instruct and DeepSeek-R1-Distill-Llama-70B (distilled from it) have the
    # same config.json shape as Llama-3.1-70B
    **{hub_id: _LLAMA31_70B for hub_id in (
        "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct", "deepseek-ai/DeepSeek-R1-Distill-Llama-70B")},
    "Qwen/Qwen3-8B": dict(
        _QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=12288),
    "Qwen/Qwen3-14B": dict(
        _QWEN3, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=17408),
    "Qwen/Qwen3-32B": dict(
        _QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=25600),
    "Qwen/Qwen3-30B-A3B": dict(
        _QWEN3_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768),
    "Qwen/Qwen3-235B-A22B": dict(
        _QWEN3_MOE, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536),
}
"""The architecture fields of published config.json files
(huggingface.co/<id>/blob/main/config.json)."""
PUBLISHED: dict[str, PlannedModel] = {
    hub_id: PlannedModel.from_hf_config(cfg, name=hub_id.split("/")[1])
    for hub_id, cfg in PUBLISHED_CONFIGS.items()}
"""The planner's built-in architectures by hub id; the family registry supplies the quirks
(Qwen2: QKV bias; Llama: none; Qwen3: q/k norms; Qwen3-MoE: router and experts)."""

LLAMA31_8B = PlannedModel.from_hf_config(dict(
    model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
    tie_word_embeddings=False, attention_bias=False), name="Llama-3.1-8B")
"""meta-llama/Llama-3.1-8B(-Instruct)'s config.json (not in ``PUBLISHED``: no recipe trains
it; the published step times do)."""


def architecture_for(run, hf_config: str | dict | None = None) -> PlannedModel:
    """The recipe's model shape: ``hf_config`` if given (a config.json, its folder, or a dict such
    as ``tasks.tiny.tiny_config``'s for ``model.tiny``); else ``model.path`` when it is a local
    folder with config.json; else ``PUBLISHED`` by hub id."""
    if isinstance(hf_config, dict):
        return PlannedModel.from_hf_config(hf_config, name="tiny")
    if hf_config:
        return PlannedModel.from_hf_config(_read_config(hf_config, "--hf-config"),
                                           name=os.path.basename(hf_config.rstrip("/")))
    if run.model.tiny is not None:
        raise ValueError("model.tiny: the planner needs the tiny model's config "
                         "(tasks.tiny.tiny_config(**model.tiny)) as hf_config")
    path = run.model.path
    if os.path.isfile(os.path.join(path, "config.json")):
        return PlannedModel.from_hf_config(_read_config(path, "model.path"),
                                           name=os.path.basename(path.rstrip("/")))
    if path in PUBLISHED:
        return PUBLISHED[path]
    raise ValueError(f"model.path {path!r} is neither a local HF folder with config.json nor "
                     f"a hub id the planner knows ({', '.join(sorted(PUBLISHED))}); pass its "
                     f"config.json with --hf-config")


def _read_config(path: str, flag: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {file}: {exc}") from None
