"""Rollout routing replay (R3, ``algorithm.routing_replay: r3``): the trainer's MoE layers route
each token to the experts the rollout engine chose for it, through Megatron-Core's
``RouterReplay`` (``megatron/core/transformer/moe/router_replay.py``).

Replay replaces only the top-k indices; the gate probabilities come from the current router
scores, so the router still gets its gradient. Why replay at all (a flipped expert choice moves
a token's log-prob by far more than the kernels' rounding): docs/moe.md.

    replay = RoutingReplay(models)          # routers of models built with moe_enable_routing_replay
    train_step(models, rows, loss, routing_replay=replay)      # rows carry routed_experts
    replay.metrics()                        # collective: the diff fractions since the last call

Per micro-batch ``train_step`` calls ``replay.set(model_chunk, micro_batch)`` right before the
chunk's forward: each router of that chunk gets the column of ``MicroBatch.routed_experts``
([S, num_hidden_layers, topk] global expert ids, see ``packing``) of its own global layer, so a
pipeline stage and a virtual chunk pass only their own layers, and with expert parallelism the
ids are global (Megatron's dispatcher maps them to EP ranks). Megatron's action is chosen per
router call by a forward pre-hook: ``REPLAY_FORWARD`` in a forward, ``REPLAY_BACKWARD`` when
activation recomputation re-runs the forward inside the backward (Megatron then takes the
micro-batches' ids in the order their forwards set them, which is the order the schedules run
their backwards). ``done()`` after the schedule clears every router's ids and action. With
sequence parallelism (GPU, TP > 1) a router sees its TP rank's contiguous slice of the row's
tokens, so it gets that slice of the ids (never run: no GPU here).

Metric: a forward hook compares the router's free routing (Megatron's own top-k of the same
scores, ``topk_routing_with_score_function`` without replay) with the replayed one. A
token-layer differs when the two expert sets differ; counted over the positions whose log-prob
enters the loss (``MicroBatch.loss_mask``), per forward (recomputation not counted twice).
``metrics()`` sums the counts over DP x CP and the pipeline stages (TP ranks see the same tokens;
under sequence parallelism each counts its own slice and the sum covers TP rank r's slices,
a sample of the tokens) and returns ``{prefix + "routing_replay_diff_frac": differing / token-layers}`` for each
prefix the counts were recorded under (``recording(prefix)``).

Megatron keeps every ``RouterReplay`` in a class-level list that model builds only append to;
``clear_instances()`` empties it before a build (``policy.build_policy`` calls it), so the list
holds the current policy's routers only. This module addresses routers directly, never through
that list.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_dgpo.runtime import comm, parallel

ROUTING_REPLAYS = ("off", "r3")
"""``algorithm.routing_replay`` values: ``off`` (free routing) or ``r3``."""


def clear_instances() -> None:
    """Empty Megatron's class-level list of ``RouterReplay`` instances (before a model build)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


class RoutingReplay:
    """Replays ``MicroBatch.routed_experts`` through the routers of ``models`` (this rank's
    chunks, wrapped or not), which must be built with ``moe_enable_routing_replay=True``."""

    def __init__(self, models: list):
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_dgpo.models.builder import unwrap_model

        self._chunks = []  # per model chunk: its routers
        for chunk in models:
            routers = [m for m in unwrap_model(chunk).modules() if isinstance(m, TopKRouter)]
            self._chunks.append((unwrap_model(chunk), routers))
        # a pipeline stage may hold no MoE layer; a dense model is refused before it is built
        # (policy.model_overrides)
        routers = [r for _, routers in self._chunks for r in routers]
        missing = [int(r.layer_number) for r in routers if r.router_replay is None]
        if missing:
            raise ValueError(f"routing replay: the routers of layers {missing} have no "
                             f"RouterReplay; build the model with moe_enable_routing_replay=True "
                             f"(policy.model_overrides(..., routing_replay='r3'))")
        self._active: dict[int, torch.Tensor] = {}  # id(router) -> loss-mask of its current row
        self._prefix: str | None = None
        self._counts: dict[str, torch.Tensor] = {}
        self._handles = []
        for router in routers:
            self._handles.append(router.register_forward_pre_hook(self._choose_action))
            self._handles.append(router.register_forward_hook(self._count))

    def set(self, model, mb) -> None:
        """Before the forward of ``mb`` (a ``packing.MicroBatch``) on the chunk ``model``: each
        of its routers gets its layer's ids."""
        from megatron_dgpo.models.builder import unwrap_model

        ids = mb.routed_experts
        if ids is None:
            raise ValueError("routing replay: the micro-batch carries no routed_experts (the "
                             "rollout engine recorded none)")
        target = unwrap_model(model)
        routers = next((r for chunk, r in self._chunks if chunk is target), None)
        if routers is None:
            raise ValueError("routing replay: a model chunk this RoutingReplay was not built on")
        mask = mb.loss_mask
        if routers and routers[0].config.sequence_parallel:  # the TP rank's slice of the row
            tp, rank = parallel.tensor_parallel_size(), parallel.tensor_parallel_rank()
            width = ids.shape[0] // tp
            ids, mask = ids[rank * width:(rank + 1) * width], mask[rank * width:(rank + 1) * width]
        for router in routers:
            layer = int(router.layer_number) - 1
            if not 0 <= layer < ids.shape[1]:
                raise ValueError(f"routing replay: routed_experts has {ids.shape[1]} layers, the "
                                 f"model's router of layer {layer + 1} has none")
            if ids.shape[2] != router.topk:
                raise ValueError(f"routing replay: routed_experts holds top-{ids.shape[2]} ids, "
                                 f"the router of layer {layer + 1} routes top-{router.topk}")
            router.router_replay.set_target_indices(ids[:, layer].long())
            self._active[id(router)] = mask

    def done(self) -> None:
        """After a schedule: every router back to free routing, ids dropped."""
        self._active.clear()
        for _, routers in self._chunks:
            for router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    @contextlib.contextmanager
    def recording(self, prefix: str):
        """Count the diff fraction of the forwards inside the block under ``prefix``. Every rank
        opens the same blocks, so every rank reports the same prefixes (zeros on a stage
        without MoE layers) and the reductions of ``metrics()`` line up."""
        self._counts.setdefault(prefix, torch.zeros(2, dtype=torch.float64))
        self._prefix = prefix
        try:
            yield
        finally:
            self._prefix = None

    def _choose_action(self, router, inputs) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if id(router) not in self._active:
            router.router_replay.clear_router_replay_action()
            return
        recompute = torch._C._current_graph_task_id() != -1  # a forward re-run by the backward
        router.router_replay.set_router_replay_action(
            RouterReplayAction.REPLAY_BACKWARD if recompute else RouterReplayAction.REPLAY_FORWARD)

    def _count(self, router, inputs, output) -> None:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        mask = self._active.get(id(router))
        if mask is None or self._prefix is None or torch._C._current_graph_task_id() != -1:
            return
        with torch.no_grad():
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
            config = router.config
            _, free = topk_routing_with_score_function(
                router.gating(hidden).view(-1, config.num_moe_experts), router.topk,
                use_pre_softmax=config.moe_router_pre_softmax,
                num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                scaling_factor=config.moe_router_topk_scaling_factor,
                score_function=router.score_function, expert_bias=router.expert_bias)
            replayed = output[1]
            valid = mask.to(free.device).reshape(-1).bool()
            differs = (free != replayed).any(dim=-1) & valid
            counts = torch.stack([differs.sum(dtype=torch.float64), valid.sum(dtype=torch.float64)])
            self._counts[self._prefix] = self._counts[self._prefix].to(counts.device) + counts

    def metrics(self) -> dict[str, float]:
        """Collective over the world: ``{prefix + "routing_replay_diff_frac": ...}`` of the
        forwards recorded since the last call, summed over DP x CP and the pipeline stages."""
        prefixes = sorted(self._counts)
        local = [self._counts[p].tolist() for p in prefixes]
        self._counts.clear()
        if not local:
            return {}
        # each DP x CP rank routed its own tokens (CP: its part of every sequence)
        summed = comm.reduce_values(local, "sum", parallel.data_parallel_group(
            with_context_parallel=True))
        summed = comm.reduce_values(summed, "sum", parallel.pipeline_parallel_group())
        return {f"{p}routing_replay_diff_frac": float(d / n) if n else 0.0
                for p, (d, n) in zip(prefixes, summed.tolist())}

    def close(self) -> None:
        self.done()
        for handle in self._handles:
            handle.remove()
        self._handles = []
