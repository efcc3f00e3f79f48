"""Rank functions for tests/test_evaluate.py: the evaluation during training's split of the
problems over replicas and the reduction of their correct counts, on 1 or 2 gloo ranks."""

from __future__ import annotations

from megatron_dgpo.rollout.base import Completion, RolloutEngine

N = 4
SEED = 1000
# hand-made correct counts (of N) per problem, two benchmarks of 7 and 4 problems
PLAN = {"a": [0, 1, 4, 2, 3, 0, 4], "b": [2, 0, 1, 4]}


def benchmarks() -> dict:
    from megatron_dgpo.tasks.prompts import builtin_prompts

    return {"a": builtin_prompts(["add"])[:7], "b": builtin_prompts(["repeat"])[:4]}


class GenerateOnlyEngine(RolloutEngine):
    """A scripted engine's base: it generates, it is never refitted."""

    def update_weights(self, groups):
        raise NotImplementedError

    def update_weights_from_dir(self, hf_dir):
        raise NotImplementedError

    def shutdown(self):
        pass


class PlannedEngine(GenerateOnlyEngine):
    """Answers problem i of a benchmark correctly in its first PLAN[b][i] samples, whichever
    call or engine it lands in; records each prompt's seed."""

    def __init__(self, tokenizer, prompts: dict):
        self.tok, self.prompts, self.seeds, self.calls = tokenizer, prompts, {}, 0

    def generate(self, prompts_token_ids, *, n=1, temperature=1.0, top_p=1.0, max_tokens=256,
                 seed=None, seeds=None):
        self.calls += 1
        out = []
        for j, ids in enumerate(prompts_token_ids):
            (bench, i, truth) = self.prompts[tuple(ids)]
            self.seeds[(bench, i)] = seeds[j]
            texts = [f"so \\boxed{{{truth if s < PLAN[bench][i] else 'wrong'}}}" for s in range(n)]
            tokens = [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            out.append([Completion(j, t, [0.0] * len(t), "stop") for t in tokens])
        return out


class InProcessPool:
    """``RewardPool.score`` with the evaluation grader, in this process."""

    def score(self, texts, truths, grader):
        from megatron_dgpo.tasks.rewards import eval_correct

        assert grader == "eval"
        return [1.0 if eval_correct(t, g) else 0.0 for t, g in zip(texts, truths)]


class Replica:
    """What ``HeldOutEvaluation.run`` uses of a ``ReplicaRollout``: one engine per replica
    (rank), graded on that rank, its share of the problems as ``rollout_role`` splits them."""

    def __init__(self, engine, rank: int, world: int):
        from megatron_dgpo.rollout.placement import rollout_role

        self.engine, self.pool = engine, InProcessPool()
        self._role = lambda num: rollout_role(colocated=False, engine_tp=1, rank=rank,
                                              world_size=world, replica_ranks=[rank],
                                              dp_rank=rank, dp_size=world, num_prompts=num)

    def share(self, num_items: int) -> range:
        return self._role(num_items).prompts


def evaluate_replicas(rank: int, world: int, model_dir: str) -> dict:
    """Hand-made counts combined over ``world`` replicas (each filling its share's slots), and
    ``HeldOutEvaluation.run`` with a planned engine per replica (3 problems per engine call)."""
    from transformers import AutoTokenizer

    from megatron_dgpo.recipe import EvalConfig
    from megatron_dgpo.rollout import evaluation
    from megatron_dgpo.rollout.placement import shard_prompts

    # the reduction alone: replica r fills the slots of its problems, zeros elsewhere
    counts = PLAN["a"] + PLAN["b"]
    mine = shard_prompts(len(counts), world, rank)
    combined = evaluation.combine_counts(len(counts), {i: counts[i] for i in mine})

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = EvalConfig(every=1, benchmarks=["a", "b"], n=N, seed=SEED)
    held_out = evaluation.HeldOutEvaluation(config, benchmarks(), tokenizer, max_tokens=8,
                                            context=512)
    prompts = {tuple(ids): (b.name, i, b.ground_truths[i])
               for b in held_out.benchmarks for i, ids in enumerate(b.prompts)}
    engine = PlannedEngine(tokenizer, prompts)
    default, evaluation.PROBLEMS_PER_CALL = evaluation.PROBLEMS_PER_CALL, 3
    try:
        metrics = held_out.run(Replica(engine, rank, world))
    finally:
        evaluation.PROBLEMS_PER_CALL = default
    return {"combined": combined, "mine": list(mine), "metrics": metrics,
            "names": held_out.metric_names(), "seeds": engine.seeds, "calls": engine.calls}
