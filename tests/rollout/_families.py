"""A family registered by a test: Qwen2's maps under other HF names (another checkpoint layout
of the same Megatron model), to show that refit groups come from the family map."""

from __future__ import annotations


def renamed(name: str) -> str:
    """Another checkpoint layout's names for the same tensors (GPT-style blocks)."""
    for hf, other in ((".self_attn.q_proj.", ".attn.wq."), (".self_attn.k_proj.", ".attn.wk."),
                      (".self_attn.v_proj.", ".attn.wv."), (".self_attn.o_proj.", ".attn.wo."),
                      (".mlp.gate_proj.", ".ffn.w1."), (".mlp.up_proj.", ".ffn.w3."),
                      (".mlp.down_proj.", ".ffn.w2."), ("model.layers.", "blocks."),
                      ("model.embed_tokens.", "tok_embeddings."), ("model.norm.", "final_norm."),
                      ("lm_head.", "output.")):
        name = name.replace(hf, other)
    return name


def renamed_family(monkeypatch, base: str = "qwen2"):
    """A family registered under ``renamed_<base>`` whose maps are ``base``'s with every HF name
    ``renamed``: the same Megatron model, another checkpoint's names."""
    from dataclasses import replace

    from megatron_dgpo.models import families

    family = families.FAMILIES[base]
    params = tuple(replace(pm, hf=tuple(renamed(n) for n in pm.hf)) for pm in family.params)
    other = replace(family, name=f"renamed_{base}", architectures=("RenamedForCausalLM",),
                    params=params)
    monkeypatch.setitem(families.FAMILIES, other.name, other)
    return other
