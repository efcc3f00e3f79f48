"""Parameter counts per layer, pipeline stage and model, as pure functions of a
``ModelDescription`` (notation: ``megatron_dgpo.planner``); Megatron's padded vocabulary."""

from __future__ import annotations

from megatron_dgpo.models import ModelDescription, padded_vocab_size


def padded_vocab(vocab: int, tp: int) -> int:
    """V_pad = ceil(V / (128 t)) 128 t (``megatron_dgpo.models.padded_vocab_size``)."""
    return padded_vocab_size(vocab, tp)


def layer_params(desc: ModelDescription, tp: int = 1) -> int:
    """One transformer layer's parameters on one TP rank, routed experts excluded
    (``expert_layer_params``); norms and router replicated over TP:

        (h (a d + 2 g d) + [bias] (a d + 2 g d) + a d h + [dense] 3 f h) / t
        + 2 h + [q/k norms] 2 d + [MoE] E h"""
    d = desc.dims
    qkv_out = d.q_dim + 2 * d.kv_dim
    mlp = 0 if d.moe else 3 * d.ffn * d.hidden
    sharded = (d.hidden * qkv_out + (qkv_out if desc.qkv_bias else 0)
               + d.q_dim * d.hidden + mlp)
    replicated = (2 * d.hidden + (2 * d.head_dim if desc.qk_norm else 0)
                  + d.experts * d.hidden)
    return sharded // tp + replicated


def expert_layer_params(desc: ModelDescription, ep: int = 1, etp: int = 1) -> int:
    """One layer's routed-expert parameters on one rank: (E / e) 3 f_e h / u; 0 for a dense
    model. Raises ``ValueError`` unless e | E."""
    d = desc.dims
    if not d.moe:
        return 0
    if d.experts % ep:
        raise ValueError(f"expert_parallel {ep} does not divide {d.experts} experts")
    return d.experts // ep * 3 * d.moe_ffn * d.hidden // etp


def embedding_params(desc: ModelDescription, vocab_rows: int, tp: int = 1) -> int:
    """One vocabulary matrix (input embedding or output layer) on one TP rank: V_rows h / t."""
    return vocab_rows * desc.dims.hidden // tp


def param_count(desc: ModelDescription, vocab_rows: int | None = None) -> int:
    """Unique parameters of the whole model: V h + L (layer_params + expert_layer_params) + h
    + (0 if tied else V h), V = ``vocab_rows`` (default the HF vocabulary, what model cards count;
    pass ``padded_vocab(V, t)`` for what Megatron builds)."""
    d = desc.dims
    rows = d.vocab if vocab_rows is None else vocab_rows
    vocab_mats = 1 if desc.tie_word_embeddings else 2
    return (vocab_mats * rows * d.hidden
            + d.layers * (layer_params(desc) + expert_layer_params(desc)) + d.hidden)


def stage_expert_params(desc: ModelDescription, pp: int, ep: int = 1, etp: int = 1) -> int:
    """The routed-expert parameters on one GPU of any stage: (L / p) (E / e) 3 f_e h / u, replicated
    over the D_e expert data-parallel ranks only."""
    return desc.dims.layers // pp * expert_layer_params(desc, ep, etp)


def stage_params(desc: ModelDescription, tp: int, pp: int, stage: int, ep: int = 1,
                 etp: int | None = None) -> int:
    """Parameters on one GPU of pipeline stage ``stage`` (0 .. p-1), expert TP u default t:

        (L / p) layer_params(t) + stage_expert_params + [stage 0] V_pad h / t
        + [stage p-1] (h + V_pad h / t, the output layer unless tied with p = 1)

    Raises ``ValueError`` unless p | L (and e | E)."""
    d = desc.dims
    if d.layers % pp:
        raise ValueError(f"pipeline_parallel {pp} does not divide {d.layers} layers")
    rows = padded_vocab(d.vocab, tp)
    count = d.layers // pp * layer_params(desc, tp) \
        + stage_expert_params(desc, pp, ep, tp if etp is None else etp)
    if stage == 0:
        count += embedding_params(desc, rows, tp)
    if stage == pp - 1:
        count += d.hidden
        if not desc.tie_word_embeddings or pp > 1:
            count += embedding_params(desc, rows, tp)
    return count
