"""Evaluation on held-out problems: k samples per problem, Avg@k and unbiased Pass@k.

For a problem with n graded samples of which c are correct:

    Avg@n  = c / n                                  (expected accuracy of one sample)
    Pass@k = 1 - C(n - c, k) / C(n, k),  k <= n      (Chen et al. 2021, unbiased estimator of the
                                                      probability that k samples hold a correct one)

Both are averaged over the problems of a benchmark; k runs over 1, 2, 4, ..., n (``ks_up_to``).
Samples are graded with the conservative evaluation grader (``rewards.eval_correct``) in a
``RewardPool``. Problem i of a benchmark is sampled with seed ``seed + i n`` (``problem_seeds``;
vLLM gives sample j ``+ j``), whatever engine or call it lands in.

Two users share this code:

* ``dgpo-eval`` (``megatron_dgpo.evaluate``): one engine samples every problem, in chunks
  (``grade_problems``), then ``score_benchmark``;
* the trainer, with a recipe's ``eval`` section (``HeldOutEvaluation``): after a step's refit,
  each engine of the run samples and grades its share of every benchmark's problems (split as a
  batch's prompts are, ``ReplicaRollout.share``), and the per-problem correct counts are summed
  over the world into every rank (``combine_counts``: each problem is graded on exactly one
  rank). The same seeds and the whole benchmark's counts: the numbers do not depend on the
  number of engines or replicas, and equal ``dgpo-eval --seed eval.seed`` of that step's policy
  (exactly on CPU; on a GPU within sampling noise, since bf16 logits depend on the batch:
  docs/launching.md, "Reproducibility: CPU and GPU").
  Evaluation runs between the refit and the next rollout, when the refit has woken the engine
  (weights and KV cache); ``generate`` wakes whatever would still sleep. It leaves the engine
  awake, as the refit left it (a level-2 sleep would drop the weights the next rollout samples
  with; the rollout puts it to sleep after sampling, as without evaluation), and forgets the
  prompt KV it cached, so the next rollout finds the engine as it would without evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Protocol, Sequence

import torch

from megatron_dgpo.rollout.base import RolloutEngine
from megatron_dgpo.rollout.config import RolloutConfig
from megatron_dgpo.runtime import comm
from megatron_dgpo.runtime.config import Bounds, check_bounds
from megatron_dgpo.tasks.prompts import PromptRecord, render_prompts, resolve_benchmarks
from megatron_dgpo.tasks.rewards import RewardPool

PROBLEMS_PER_CALL = 32
"""Problems per engine call: bounds the completions held at once (n per problem)."""


class EvaluationEngines(Protocol):
    """What evaluation during training needs from the run's rollout: this rank's engine and
    grader workers, and the problems its engine samples. Colocated engines
    (``ReplicaRollout``) have them; dedicated engines refuse an ``eval`` section at start."""

    engine: RolloutEngine | None
    """This rank's engine; None on the ranks that feed an engine without holding it."""
    pool: RewardPool | None
    """The grader workers; None on the ranks that do not grade."""

    def share(self, num_items: int) -> range:
        """The items of ``num_items`` this rank's engine samples, split as a batch's prompts are."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (exact integers)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(k_max: int) -> list[int]:
    """1, 2, 4, ... up to k_max, with k_max itself included."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    ks, k = [], 1
    while k < k_max:
        ks.append(k)
        k *= 2
    return ks + [k_max]


@dataclass
class BenchmarkResult:
    """Metrics of one benchmark. correct[i]: number of correct samples of problem i (of n)."""

    name: str
    n: int
    correct: list[int]
    mean_response_tokens: float
    truncated_frac: float
    pass_at: dict[int, float] = field(default_factory=dict)

    @property
    def avg(self) -> float:
        return sum(self.correct) / (self.n * len(self.correct)) if self.correct else 0.0

    def as_dict(self) -> dict:
        return {
            "num_problems": len(self.correct),
            "n": self.n,
            f"avg@{self.n}": self.avg,
            "pass@k": {str(k): v for k, v in self.pass_at.items()},
            "mean_response_tokens": self.mean_response_tokens,
            "truncated_frac": self.truncated_frac,
            "correct_per_problem": self.correct,
        }


def score_benchmark(name: str, correct: Sequence[int], n: int, *, mean_response_tokens=0.0, truncated_frac=0.0) -> BenchmarkResult:
    """Avg@n and Pass@k (k in ``ks_up_to(n)``) of per-problem correct counts."""
    pass_at = {k: sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks_up_to(n)} if correct else {}
    return BenchmarkResult(name, n, list(correct), mean_response_tokens, truncated_frac, pass_at)


def problem_seeds(seed: int, indices, n: int) -> list[int]:
    """The sampling seeds of a benchmark's problems ``indices``: problem i gets ``seed + i n``
    (its sample j draws from ``seed + i n + j``: no two samples of a benchmark share a stream)."""
    return [int(seed) + int(i) * n for i in indices]


@dataclass
class Graded:
    """Problems sampled and graded: correct samples per problem, tokens per sample, and how
    many samples hit the token limit."""

    correct: list[int]
    lengths: list[int]
    truncated: int


def grade_problems(engine, pool, tokenizer, prompts: Sequence[Sequence[int]],
                   ground_truths: Sequence[str], seeds: Sequence[int], *, n: int,
                   max_tokens: int, temperature: float, top_p: float) -> Graded | None:
    """``n`` samples of each prompt (token ids; prompt i seeded ``seeds[i]``) with ``engine``,
    graded against ``ground_truths`` with the evaluation grader in ``pool``. None without a
    pool: the other ranks of a colocated engine only take part in generation (they must call
    this with the same prompts and seeds)."""
    groups = engine.generate(list(prompts), n=n, temperature=temperature, top_p=top_p,
                             max_tokens=max_tokens, seeds=list(seeds)) if prompts else []
    if pool is None:
        return None
    texts, truths, lengths, truncated = [], [], [], 0
    for truth, group in zip(ground_truths, groups):
        for sample in group:
            texts.append(tokenizer.decode(sample.token_ids, skip_special_tokens=True))
            truths.append(truth)
            lengths.append(len(sample.token_ids))
            truncated += sample.finish_reason == "length"
    scores = pool.score(texts, truths, grader="eval") if texts else []
    correct = [int(sum(scores[i * n:(i + 1) * n])) for i in range(len(groups))]
    return Graded(correct, lengths, truncated)


def combine_counts(num_slots: int, counts: dict[int, int], group=None) -> list[int]:
    """Every problem's correct count, on every rank of ``group`` (default: the world): each rank
    writes the counts of the problems it graded (slot -> count) into a zero vector of
    ``num_slots`` problem slots, and one sum over the ranks fills every slot (each problem is
    graded on exactly one rank). Collective."""
    slots = torch.zeros(num_slots, dtype=torch.float64)
    for slot, count in counts.items():
        slots[slot] = float(count)
    return [int(round(v)) for v in comm.reduce_values(slots, "sum", group).tolist()]


@dataclass
class EvalConfig:
    """Evaluation on held-out problems during training (NeMo-RL's ``val_period``, verl's
    ``test_freq``): after a step's refit the run's own engines, holding the just-trained
    weights, sample ``n`` responses per problem, each engine its share of the problems, graded
    as ``dgpo-eval`` grades (``megatron_dgpo.rollout.evaluation``). Logged in that step's
    metrics line: ``eval/<benchmark>/avg@<n>``, ``eval/<benchmark>/pass@<k>`` (k = 1, 2, 4, ...,
    n) and ``time/eval`` (not part of ``time/step`` nor of the throughputs). Training is the
    same with or without it (its samples, seeds and random streams are untouched)."""

    every: Annotated[int, Bounds(ge=0)] = 0
    """Evaluate after every this many steps. 0: off (the default)."""
    at_end: bool | None = None
    """Also evaluate after the run's last step (``train.steps``). None: true when ``every`` > 0;
    true with ``every: 0`` evaluates only at the end."""
    benchmarks: list[str] = field(default_factory=list)
    """What to evaluate on: names of the published benchmarks ``dgpo-eval`` knows (aime24,
    aime25, amc23, math500, minerva_math, olympiadbench; read from ``benchmarks_dir``) and/or
    paths to held-out files (.jsonl/.json/.parquet in a layout ``prompts.load_benchmark`` reads,
    e.g. rows {"problem", "answer"}; named by the file's stem). Required when evaluation is on."""
    benchmarks_dir: str | None = None
    """Folder of the named benchmarks (aime24.jsonl, ...). None: $DGPO_BENCHMARKS_DIR, else
    ../shared/benchmarks next to the repository (as ``dgpo-eval``)."""
    n: Annotated[int, Bounds(ge=1)] = 8
    """Samples per problem: the k of Avg@k and the largest k of Pass@k."""
    max_tokens: Annotated[int | None, Bounds(ge=1)] = None
    """Response limit of an evaluation sample. None: ``rollout.max_response_tokens``. Every
    prompt plus this must fit the engines' context, ``rollout.max_prompt_tokens`` +
    ``rollout.max_response_tokens`` (checked at start)."""
    temperature: Annotated[float, Bounds(gt=0)] = 1.0
    """Sampling temperature of the evaluation samples."""
    top_p: Annotated[float, Bounds(gt=0, le=1)] = 1.0
    """Nucleus sampling mass of the evaluation samples, in (0, 1]."""
    limit: Annotated[int | None, Bounds(ge=1)] = None
    """Only the first this many problems of each benchmark. None: all of them."""
    seed: Annotated[int, Bounds(ge=0, lt=1 << 62)] = 0
    """Problem i of a benchmark is sampled with seed ``seed + i n`` (sample j: ``+ j``) at every
    evaluation, whatever the number of engines: the seeds of ``dgpo-eval --seed``, so the
    numbers equal ``dgpo-eval`` of that step's policy with the same settings. In [0, 2**62)."""

    def __post_init__(self):
        check_bounds(self)
        if any(not spec.strip() for spec in self.benchmarks):
            raise ValueError(f"benchmarks must be names or paths, got an empty one in "
                             f"{self.benchmarks!r}")
        if self.enabled and not self.benchmarks:
            raise ValueError("benchmarks must name at least one benchmark or held-out file when "
                             "evaluation is on (every > 0 or at_end: true)")

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates at all."""
        return self.every > 0 or bool(self.at_end)

    def due(self, step: int, last_step: int) -> bool:
        """Whether to evaluate after ``step``: every ``every`` steps, and after ``last_step``
        when ``at_end`` (None: when ``every`` > 0)."""
        at_end = self.every > 0 if self.at_end is None else self.at_end
        return bool(self.every) and step % self.every == 0 or at_end and step == last_step


@dataclass
class _Benchmark:
    name: str
    first_slot: int  # this benchmark's problems take slots first_slot .. first_slot + len - 1
    prompts: list[list[int]]
    ground_truths: list[str]


class HeldOutEvaluation:
    """The recipe's ``eval`` section at run time: its benchmarks rendered with the policy's chat
    template, and ``run`` (collective: world) to evaluate the engines' current weights.

        evaluation = HeldOutEvaluation.from_recipe(cfg.eval, hf_dir, cfg.rollout)  # every rank
        if cfg.eval.due(step, cfg.train.steps): metrics = evaluation.run(rollout)  # after refit
    """

    def __init__(self, config: EvalConfig, benchmarks: dict[str, list[PromptRecord]], tokenizer,
                 *, max_tokens: int, context: int):
        """``benchmarks``: problems by name; ``max_tokens``: the response limit; ``context``: the
        engines' prompt + response limit (every prompt plus ``max_tokens`` must fit in it)."""
        self.config, self.tokenizer, self.max_tokens = config, tokenizer, max_tokens
        self.benchmarks: list[_Benchmark] = []
        slot = 0
        for name, records in benchmarks.items():
            prompts = render_prompts(tokenizer, records)
            for record, ids in zip(records, prompts):
                if len(ids) + max_tokens > context:
                    raise ValueError(
                        f"eval.benchmarks: problem {record.id!r} of {name!r} has a prompt of "
                        f"{len(ids)} tokens; with eval.max_tokens={max_tokens} it does not fit the "
                        f"engines' context of {context} (rollout.max_prompt_tokens + "
                        f"rollout.max_response_tokens): raise rollout.max_prompt_tokens, or lower "
                        f"eval.max_tokens")
            self.benchmarks.append(_Benchmark(name, slot, prompts, [r.ground_truth for r in records]))
            slot += len(records)
        self.num_slots = slot

    @classmethod
    def from_recipe(cls, config: EvalConfig, hf_dir, rollout: RolloutConfig) -> HeldOutEvaluation:
        """The benchmarks of ``config`` read and rendered with the tokenizer of ``hf_dir`` (on
        every rank, before the engines start: a bad benchmark fails every rank alike)."""
        from transformers import AutoTokenizer

        try:
            benchmarks = resolve_benchmarks(config.benchmarks, config.benchmarks_dir,
                                            limit=config.limit)
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"eval.benchmarks: {exc}") from None
        return cls(config, benchmarks, AutoTokenizer.from_pretrained(str(hf_dir)),
                   max_tokens=config.max_tokens or rollout.max_response_tokens,
                   context=rollout.max_prompt_tokens + rollout.max_response_tokens)

    def metric_names(self) -> list[str]:
        """The keys ``run`` returns: ``eval/<benchmark>/avg@<n>``, ``eval/<benchmark>/pass@<k>``."""
        n = self.config.n
        return [key for b in self.benchmarks for key in
                [f"eval/{b.name}/avg@{n}"] + [f"eval/{b.name}/pass@{k}" for k in ks_up_to(n)]]

    def run(self, rollout: EvaluationEngines) -> dict[str, float]:
        """Evaluate the policy the engines of ``rollout`` hold: each engine
        samples its share of every benchmark's problems (``rollout.share``), its grading rank
        grades them, and the counts are combined over the world. Returns the same metrics on
        every rank (``metric_names``). Collective (world): every rank calls it."""
        n = self.config.n
        work = []  # (slot, prompt, ground truth, seed) of this engine's problems
        for b in self.benchmarks:
            share = rollout.share(len(b.prompts))
            work += [(b.first_slot + i, b.prompts[i], b.ground_truths[i], seed)
                     for i, seed in zip(share, problem_seeds(self.config.seed, share, n))]
        counts: dict[int, int] = {}
        if rollout.engine is not None and work:
            for start in range(0, len(work), PROBLEMS_PER_CALL):
                chunk = work[start:start + PROBLEMS_PER_CALL]
                graded = grade_problems(rollout.engine, rollout.pool, self.tokenizer,
                                        [w[1] for w in chunk], [w[2] for w in chunk],
                                        [w[3] for w in chunk], n=n, max_tokens=self.max_tokens,
                                        temperature=self.config.temperature, top_p=self.config.top_p)
                if graded is not None:
                    counts.update(zip((w[0] for w in chunk), graded.correct))
            rollout.engine.reset_prefix_cache()  # the next rollout finds it as the refit left it
        totals = combine_counts(self.num_slots, counts)
        metrics = {}
        for b in self.benchmarks:
            result = score_benchmark(b.name, totals[b.first_slot:b.first_slot + len(b.prompts)], n)
            metrics[f"eval/{b.name}/avg@{n}"] = result.avg
            metrics.update({f"eval/{b.name}/pass@{k}": v for k, v in result.pass_at.items()})
        return metrics
