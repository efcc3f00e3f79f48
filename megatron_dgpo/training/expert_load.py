"""MoE telemetry: forward hooks on every Megatron ``TopKRouter`` of the policy count, while
``recording()`` is open, the tokens routed to each expert (once per expert of a token's top k)
and the entropy of the router's softmax; ``metrics()`` returns, summed over the world:

    moe/load_max_over_mean            mean over layers of max_e(tokens_e) / mean_e(tokens_e)
    moe/load_max_over_mean_worst      the same, the worst layer
    moe/router_entropy                mean over layers and tokens, in nats
    moe/layer_<l>/load_max_over_mean, .../load_min_over_mean, .../router_entropy
                                      per layer (l the global layer number, from 1)

What is counted and how to read it: docs/moe.md, "Telemetry"."""

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
