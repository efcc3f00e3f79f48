"""Rollout engines: ``RolloutEngine`` interface, ``VLLMEngine`` (default), ``HFEngine`` (fallback).

vLLM is imported lazily (only when a ``VLLMEngine`` is built), so importing this package is cheap.
"""

from megatron_dgpo.rollout.base import Completion, RolloutEngine


def __getattr__(name):
    if name in ("VLLMEngine", "VLLMConfig"):
        from megatron_dgpo.rollout import vllm_engine

        return getattr(vllm_engine, name)
    if name == "HFEngine":
        from megatron_dgpo.rollout.hf_engine import HFEngine

        return HFEngine
    raise AttributeError(name)


__all__ = ["RolloutEngine", "Completion", "VLLMEngine", "VLLMConfig", "HFEngine"]

# Bucketed weight refit: cheap to import (torch only).
from megatron_dgpo.rollout.refit import RefitStats, bucket_groups  # noqa: E402

__all__ += ["RefitStats", "bucket_groups"]
