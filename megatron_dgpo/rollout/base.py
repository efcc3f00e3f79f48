"""The two interfaces of the rollout: ``RolloutEngine`` (one engine: sample n responses per prompt
with their log-probs, refit weights) and ``Rollout`` (one DP replica's rollout as the trainer's
loop drives it, whatever the engines' placement).

Every engine returns, per prompt, ``n`` ``Completion`` objects (one sampled response each; the
trainer's sequences are ``packing.Sample``, built from them by ``batch.Experience``) with
    token_ids  [T_i]  the response tokens, the stop token included when the sample stopped;
    logprobs   [T_i]  log pi_sample(token_t | prompt, tokens_<t) in float, where pi_sample is the
                      distribution the token was drawn from (temperature and top-p applied; with
                      the paper's temperature 1.0 and top-p 1.0 it is the model's log-softmax);
    finish_reason     "stop" (a stop/eos token ended it) or "length" (max_tokens reached);
    routed_experts    [P + T_i - 1, num_hidden_layers, topk] int16 or None: the global expert
                      ids each MoE layer routed each input position to (the prompt's P tokens
                      and the response but its last token, which is sampled and never fed),
                      only from an engine asked to record them (routing replay,
                      ``algorithm.routing_replay: r3``); a dense layer's column holds zeros.

Seeds: ``generate(..., seed=s, n=n)`` gives prompt i the sampling seed ``s + i n`` (sample j
then draws from stream ``s + i n + j``: no two samples of a call share one), so the same call
on the same weights returns the same samples (on CPU; on a GPU the bf16 logits also depend on
the batch around a request, so the samples agree in distribution), and two identical prompts in
one call still get different samples. ``seeds=[...]`` gives each prompt its own (the trainer's
``placement.prompt_seeds``). ``seed=None`` draws fresh randomness.

Weight refit: ``update_weights(groups)`` takes an iterable of fused groups, lists of
``(hf_name, tensor)`` pairs in Hugging Face naming that a reload must take whole (what
``megatron_dgpo.convert.export_hf_groups`` yields; ``models.group_hf_tensors`` groups an HF state
dict so), covering the whole model, and returns its ``RefitStats`` (None from one that keeps
none, transformers');
``update_weights_from_dir(hf_dir)`` reloads from a saved HF folder. Neither restarts the engine;
both invalidate any cache computed with the old weights (prefix cache). An engine that reloads
bucket by bucket also takes a refit whose buckets arrive from elsewhere (a dedicated engine
receives them by broadcast): ``begin_refit``, ``load_bucket`` per bucket, ``end_refit`` (an
engine without them raises ``NotImplementedError``).

Request by request (the streaming schedule, ``rollout.partial``): ``add_requests`` queues
``ResponseRequest``s (one response each, its own seed; the prompt may end with the tokens a
response already has, which the engine prefills again), ``step`` runs one engine step and
returns each running request's new tokens as ``Progress``, ``abort`` drops requests, keeping
nothing of them in the engine. An engine without them raises ``NotImplementedError``.

Memory: ``sleep`` frees what the engine holds on the accelerator between generations, and
``reset_prefix_cache`` forgets cached prompt KV; an engine without either keeps what it holds.

The loop and the rollout meet in ``Rollout`` only: the trainer makes its weights current and
hands their export to ``Rollout.refit``, and takes each step's batch as a ``Sampled``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Literal, NamedTuple, Protocol, Sequence

import torch

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.refit import RefitStats


@dataclass
class Completion:
    """One sampled response (see the module docstring for the field contracts)."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    extra: dict = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"sample of prompt {self.prompt_index}: {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs"
            )


@dataclass
class ResponseRequest:
    """One response to sample, or to continue: the engine feeds ``prompt_token_ids`` (the
    prompt, then the tokens the response has so far) and samples up to ``max_tokens`` more
    from the stream ``seed``; ``key`` names it in ``Progress`` and ``abort``."""

    key: str
    prompt_token_ids: list[int]
    max_tokens: int
    seed: int


@dataclass
class Progress:
    """What one engine step added to request ``key``: its new tokens with their log-probs (the
    ``Completion`` contract), and ``finish_reason`` once it finished (None while it runs)."""

    key: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def check_generate_args(prompts_token_ids: Sequence[Sequence[int]], n: int, temperature: float, top_p: float, max_tokens: int) -> None:
    """Shared argument validation; errors name the argument."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding is not a sampling policy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for i, p in enumerate(prompts_token_ids):
        if len(p) == 0:
            raise ValueError(f"prompts_token_ids[{i}] is empty")


class RolloutEngine(ABC):
    """Generation backend of the RL loop. Use as a context manager or call ``shutdown()``."""

    @abstractmethod
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
    ) -> list[list[Completion]]:
        """``n`` samples for each prompt: result[i][j] is sample j of prompt i. ``seeds[i]``
        seeds prompt i (the trainer's ``placement.prompt_seeds``), else ``seed + i n``, else
        fresh randomness (see the module docstring)."""

    @abstractmethod
    def update_weights(self, groups: Iterable[list[tuple[str, torch.Tensor]]]) -> RefitStats | None:
        """Replace all weights with the given fused groups of (HF name, tensor) pairs; what the
        refit did, or None from an engine that keeps no statistics."""

    @abstractmethod
    def update_weights_from_dir(self, hf_dir: str) -> None:
        """Replace all weights with those saved in an HF model folder (safetensors)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Free the engine (processes, memory). Idempotent."""

    @property
    def holds_weights(self) -> bool:
        """Whether the engine can generate now; False while it waits for a refit to give it
        weights (a vLLM engine started from dummy weights, or after a level-2 sleep)."""
        return True

    def sleep(self, keep_weights: bool = False) -> None:
        """Free the engine's accelerator memory until the next ``generate`` or refit wakes it
        (``keep_weights``: the weights wait in host memory instead of being dropped). An engine
        that cannot sleep stays awake."""

    def reset_prefix_cache(self) -> None:
        """Forget the prompt KV cached by earlier calls. Nothing to forget by default."""

    def add_requests(self, requests: Sequence[ResponseRequest], *, temperature: float = 1.0,
                     top_p: float = 1.0) -> None:
        """Queue one response per request (sampled by later ``step`` calls)."""
        raise NotImplementedError(f"{type(self).__name__} does not sample request by request")

    def step(self) -> list[Progress]:
        """One engine step over the queued requests: the tokens each one gained."""
        raise NotImplementedError(f"{type(self).__name__} does not sample request by request")

    def abort(self, keys: Sequence[str]) -> None:
        """Drop the requests ``keys`` (their tokens so far are what ``step`` returned)."""
        raise NotImplementedError(f"{type(self).__name__} does not sample request by request")

    @property
    def num_requests(self) -> int:
        """Requests queued or running."""
        return 0

    def begin_refit(self) -> None:
        """Start a refit made of ``load_bucket`` calls; sampling is refused until ``end_refit``."""
        raise NotImplementedError(f"{type(self).__name__} has no bucketed refit")

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Reload one bucket of HF-named tensors holding whole fused groups
        (``refit.bucket_groups``)."""
        raise NotImplementedError(f"{type(self).__name__} has no bucketed refit")

    def end_refit(self) -> None:
        """Finish a refit of ``load_bucket`` calls: the engine samples with the new weights."""
        raise NotImplementedError(f"{type(self).__name__} has no bucketed refit")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class Sampled(NamedTuple):
    """A replica's batch of one step, as a ``Rollout`` hands it to the trainer."""

    batch: Experience
    """The replica's prompt groups, graded, identical on every rank of the replica."""
    metrics: dict[str, float]
    """``rollout/*``, ``throughput/*`` (and the dedicated engines' ``time/engine_*``), the same
    on every rank."""
    prompts_used: int
    """Prompts of the stream the step consumed (more than the batch after refill rounds)."""


class Rollout(Protocol):
    """One DP replica's rollout: ``ReplicaRollout`` (engines in the trainer's ranks) and
    ``DedicatedRollout`` (engines on GPUs of their own). Every trainer rank holds one and calls
    every method: they are collective over the trainer's world."""

    @property
    def replica_prompts(self) -> range:
        """The batch positions (whole prompt groups) this replica samples and trains on."""

    @property
    def leader(self) -> bool:
        """This rank leads its replica (the first rank of its replica group): it keeps
        the replica's batch generated ahead in a checkpoint."""

    @property
    def needs_first_refit(self) -> bool:
        """The engines hold no weights yet: ``refit`` before the first ``sample``."""

    @property
    def weight_consumer(self) -> Literal["all", "first"]:
        """Which ranks of the replica ``refit`` takes the weights on
        (``export_hf_groups``' ``consumer``)."""

    @property
    def submitted(self) -> bool:
        """A batch was submitted and not collected yet."""

    def sample(self, prompts_consumed: int, refill_rounds: int = 0) -> Sampled:
        """The batch that starts at stream position ``prompts_consumed``, with DAPO's
        ``refill_rounds``, sampled with the weights the engines hold."""

    def submit(self, prompts_consumed: int, refill_rounds: int = 0) -> None:
        """``sample``'s batch, started with the weights the engines hold now and collected
        later: one step ahead of the trainer (``rollout.max_staleness: 1``)."""

    def collect(self) -> Sampled:
        """The submitted batch; waits for it."""

    def take(self, step: int) -> Sampled:
        """The streaming schedule (dedicated engines): step ``step``'s groups from the buffer
        the engines fill, waiting until enough are eligible."""

    def buffer_state(self) -> dict | None:
        """The streaming schedule: the buffer as the last refit left it (the replica leader's,
        for a checkpoint; None elsewhere)."""

    def load_buffer(self, state: dict | None, prompts_consumed: int) -> None:
        """The streaming schedule: continue from a checkpoint's buffer (the leader's, None
        elsewhere) or from stream position ``prompts_consumed``; before the first refit."""

    def refit(self, weights: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """The engines take ``weights`` (the fused groups of step ``version``'s model,
        ``export_hf_groups``, exhausted on every rank) between batches; returns ``refit/*``
        metrics (largest over the engines)."""

    def sleep_engines(self) -> None:
        """Free the engines' accelerator memory, weights kept, until the next ``sample``."""

    def close(self) -> None:
        """Free the engines and the grader workers."""

