"""MoE telemetry: how evenly each layer's router spreads tokens over its experts.

Forward hooks on every Megatron ``TopKRouter`` of the policy count, while ``recording()`` is
open (the trainer opens it around the mini-batch updates), the tokens routed to each expert
(a token counts once per expert of its top k) and the entropy of the router's softmax over
all experts. ``metrics()`` sums them over the data- and context-parallel ranks (each sees its
own tokens; TP ranks see the same ones), gathers the pipeline stages' layers, and returns:

    moe/load_max_over_mean            mean over layers of max_e(tokens_e) / mean_e(tokens_e)
                                      (1 = perfectly even; E / k = every token to the same k)
    moe/load_max_over_mean_worst      the same, the worst layer
    moe/router_entropy                mean over layers and tokens, in nats (ln E = uniform)
    moe/layer_<l>/load_max_over_mean, moe/layer_<l>/load_min_over_mean,
    moe/layer_<l>/router_entropy      per layer (<l> = global layer number, from 1)

No token is ever dropped here (no expert capacity is set), so there is no dropped-token count.
Every token the forward sees is counted, padding of packed rows included. Forwards that
activation recomputation repeats inside the backward are not counted twice.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_dgpo.runtime import comm, parallel


class ExpertLoad:
    """Routing statistics of ``models`` (this rank's chunks, wrapped or not)."""

    def __init__(self, models: list):
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_dgpo.models.builder import unwrap_model

        self._recording = False
        routers = [module for chunk in models for module in unwrap_model(chunk).modules()
                   if isinstance(module, TopKRouter)]
        # every local layer reports, routed or not, so that the DP reduction's shapes agree
        self._experts = {int(r.layer_number): int(r.config.num_moe_experts) for r in routers}
        self._stats: dict[int, list] = {}
        self._handles = [router.register_forward_hook(self._hook) for router in routers]

    @property
    def enabled(self) -> bool:
        """Whether the model has routers at all (a dense model's metrics are empty)."""
        return bool(self._handles)

    @contextlib.contextmanager
    def recording(self):
        """Count the routing of the forwards run inside the block."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _hook(self, router, inputs, output) -> None:
        if not self._recording or torch._C._current_graph_task_id() != -1:  # recompute
            return
        with torch.no_grad():
            routing_map = output[1]
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
            scores = torch.softmax(router.gating(hidden).float(), dim=-1)
            # kept on the device until metrics(): no host sync per layer and micro-batch
            counts = routing_map.sum(dim=0, dtype=torch.float64)
            entropy = torch.special.entr(scores).sum(dtype=torch.float64)
            stats = self._stats.get(int(router.layer_number))
            if stats is None:
                self._stats[int(router.layer_number)] = [counts, entropy, hidden.shape[0]]
            else:
                stats[0] += counts
                stats[1] += entropy
                stats[2] += hidden.shape[0]

    def metrics(self) -> dict[str, float]:
        """Collective over the world: the metrics of the module docstring since the last call
        (empty for a dense model)."""
        if not self.enabled:
            return {}
        layers = sorted(self._experts)
        local = []
        for layer in layers:
            if layer in self._stats:
                counts, entropy_sum, tokens = self._stats[layer]
                local.append(counts.tolist() + [float(entropy_sum), float(tokens)])
            else:
                local.append([0.0] * self._experts[layer] + [0.0, 0.0])
        self._stats.clear()
        # each DP x CP rank routed its own tokens (CP: its part of every sequence)
        summed = comm.reduce_values(local, group=parallel.data_parallel_group(
            with_context_parallel=True)).tolist()
        per_stage = comm.gather_objects(dict(zip(layers, summed)),
                                        group=parallel.pipeline_parallel_group())
        out, ratios, entropies = {}, [], []
        for layer, values in sorted(pair for stage in per_stage for pair in stage.items()):
            counts, entropy_sum, tokens = values[:-2], values[-2], values[-1]
            mean = sum(counts) / len(counts)
            if not tokens or not mean:
                continue
            ratio, entropy = max(counts) / mean, entropy_sum / tokens
            out[f"moe/layer_{layer}/load_max_over_mean"] = ratio
            out[f"moe/layer_{layer}/load_min_over_mean"] = min(counts) / mean
            out[f"moe/layer_{layer}/router_entropy"] = entropy
            ratios.append(ratio)
            entropies.append(entropy)
        if ratios:
            out["moe/load_max_over_mean"] = sum(ratios) / len(ratios)
            out["moe/load_max_over_mean_worst"] = max(ratios)
            out["moe/router_entropy"] = sum(entropies) / len(entropies)
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
