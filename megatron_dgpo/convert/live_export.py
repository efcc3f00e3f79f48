"""Live model -> HF ``(name, tensor)`` pairs: ``export_hf_groups`` yields them in the family
map's fused groups (the vLLM refit's unit), ``export_hf_weights`` one by one (the HF export).

Collective over the model-parallel group: per tensor, the owning pipeline stage all-gathers its
TP shards, undoes the Megatron layouts (``transforms.hf_from_megatron``) and sends the result
to the consumers. One fused group's full tensors in memory at a time. Under context
parallelism the CP ranks hold identical weights: ``consumer="first"`` exports from CP rank 0
only (the others join just the expert gathers that span CP ranks), ``consumer="all"`` lets
each CP slice feed its own ranks (a local TP gather costs no more than a CP broadcast would).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_dgpo.convert.transforms import hf_from_megatron, megatron_shape, tp_unshard
from megatron_dgpo.models import Family, describe, fused_groups, megatron_param_key
from megatron_dgpo.models.builder import unwrap_model
from megatron_dgpo.runtime import comm, parallel


def _local_params(chunks, family: Family, tied: bool):
    """{(checkpoint key, global layer or None): (map, parameter)} of this rank's chunks; an
    expert map's entry holds this rank's experts stacked, [local experts, ...]."""
    out, experts = {}, {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            found = megatron_param_key(family, name)
            if found is None:
                raise KeyError(f"parameter {name!r} has no HF mapping in family {family.name!r}")
            pm, local, expert = found
            if tied and pm.megatron == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            layer = None if local is None else chunk.decoder.layers[local].layer_number - 1
            if pm.expert:
                experts.setdefault((pm.key(), layer), (pm, {}))[1][expert] = param
            else:
                out[(pm.key(), layer)] = (pm, param)
    for key, (pm, by_index) in experts.items():
        out[key] = (pm, torch.stack([by_index[i].detach() for i in sorted(by_index)]))
    return out


def _gather_full(pm, shard: torch.Tensor, groups) -> torch.Tensor:
    """The global tensor of ``pm`` from this rank's shard: TP shards joined (expert TP for an
    expert map), then every expert-parallel rank's experts."""
    tp_group, expert_tp_group, ep_group = groups
    group = expert_tp_group if pm.expert else tp_group
    if dist.get_world_size(group) > 1:
        shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        comm.all_gather_(shards, shard, group=group)
        shard = tp_unshard(pm, shards)
    if pm.expert and dist.get_world_size(ep_group) > 1:
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(ep_group))]
        comm.all_gather_(parts, shard.contiguous(), group=ep_group)
        shard = torch.cat(parts)
    return shard


def export_hf_weights(model_chunks, *, consumer: str = "all", dtype: torch.dtype | None = None,
                      hf_config: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``export_hf_groups``' pairs one by one, in HF order (same arguments and contract)."""
    for group in export_hf_groups(model_chunks, consumer=consumer, dtype=dtype,
                                  hf_config=hf_config):
        yield from group


def export_hf_groups(model_chunks, *, consumer: str = "all", dtype: torch.dtype | None = None,
                     hf_config: dict | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``(hf_name, full tensor)`` pairs of a live model, in HF order, one fused group at a time:
    a list per group of the family map (``models.fused_groups``: a layer's q/k/v weights and
    biases, its gate/up, all its routed experts; any other tensor alone), which a refit must
    load whole.

    Collective over the replica (TP x CP x PP) and the expert groups: *every* rank of them
    must exhaust the generator.
    Per tensor, the pipeline stage that owns it all-gathers its TP shards (undoing the QKV /
    gate-up / vocab-padding layouts via the family map; an MoE layer's experts are gathered
    from every expert-parallel rank, all of a layer's experts in one collective, and come out
    expert by expert) and, for ``consumer="all"``, broadcasts it over the pipeline group: every
    model-parallel rank then receives every group. With ``consumer="first"`` only the
    replica's first rank (TP 0, CP 0, PP 0) receives them (a point-to-point send from the owning
    stage); the others yield nothing, and CP ranks other than 0 neither gather nor send (except
    to join an expert gather whose group holds a CP rank 0). Tensors are on the model's device, in each parameter's
    dtype unless ``dtype`` is given (floating tensors are cast to it). They may be views of
    per-step buffers: copy what you keep. ``hf_config`` is only needed for models not built by
    ``megatron_dgpo.models.builder.build_model``.
    """
    if consumer not in ("all", "first"):
        raise ValueError(f"consumer must be 'all' or 'first', got {consumer!r}")
    chunks = [unwrap_model(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple))
                                   else [model_chunks])]
    cfg = hf_config or chunks[0].hf_spec.hf_config
    description = describe(cfg, padded_vocab=chunks[0].vocab_size)
    family, dims = description.family, description.dims
    groups = (parallel.tensor_parallel_group(), parallel.expert_tensor_parallel_group(),
              parallel.expert_parallel_group())
    pp_group = parallel.pipeline_parallel_group()
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    pp_ranks = dist.get_process_group_ranks(pp_group)
    tp_rank = parallel.tensor_parallel_rank()
    # consumer "first": CP rank 0's slice exports; another CP rank only joins the expert gathers
    # of a group that holds a CP rank 0 (experts are split over ranks that CP folds in)
    exports = consumer == "all" or parallel.context_parallel_rank() == 0
    joins_experts = exports or (description.dims.moe
                                and parallel.expert_group_has_context_parallel_leader())
    first = tp_rank == 0 and pp_rank == 0 and exports
    params = family.active(cfg)
    local = _local_params(chunks, family, description.tie_word_embeddings)
    mine = sorted((key, str(param.dtype)) for key, (_, param) in local.items())
    owned = comm.gather_objects(mine, group=pp_group)
    owner, dtypes = {}, {}
    for stage, keys in enumerate(owned):
        for key, dtype_name in keys:
            owner.setdefault(tuple(key), stage)
            dtypes[tuple(key)] = getattr(torch, dtype_name.replace("torch.", ""))
    device = next(iter(local.values()))[1].device
    for members in fused_groups(params, dims.layers):
        group = []
        for pm, layer in members:
            src = owner.get((pm.key(), layer))
            if src is None:
                raise KeyError(f"no pipeline stage holds {pm.key()!r} (layer {layer})")
            full = None
            if not (exports or (pm.expert and joins_experts)):
                continue
            if pp_rank == src:
                full = _gather_full(pm, local[(pm.key(), layer)][1].detach().contiguous(), groups)
            if not exports:
                continue
            if pp_size > 1 and consumer == "all":
                if full is None:
                    full = torch.empty(megatron_shape(pm, dims), dtype=dtypes[(pm.key(), layer)],
                                       device=device)
                comm.broadcast_(full, src=pp_ranks[src], group=pp_group)
            elif pp_size > 1 and src != 0 and tp_rank == 0:
                if pp_rank == src:
                    comm.send(full.contiguous(), dst=pp_ranks[0], group=pp_group)
                elif pp_rank == 0:
                    full = torch.empty(megatron_shape(pm, dims), dtype=dtypes[(pm.key(), layer)],
                                       device=device)
                    comm.recv_(full, src=pp_ranks[src], group=pp_group)
            if consumer == "all" or first:
                for name, tensor in hf_from_megatron(pm, layer, full, dims):
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    group.append((name, tensor))
        if group:
            yield group
