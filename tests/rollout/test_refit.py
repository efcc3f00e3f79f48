"""Bucketed refit and colocated vLLM engines.

* ``bucket_groups`` never splits a fused group (q/k/v weights+biases, gate/up) of Qwen2 and
  Llama state dicts, tied and untied, grouped by the family map from HF and alphabetical
  (safetensors) order; a family registered with other HF names is grouped and bucketed alike;
* a refit in 128 KiB buckets gives the log-probs of transformers on the new weights and the
  samples of a full reload from the HF folder (separate engine, the session's);
* two colocated TP=1 engines on two gloo ranks (external_launcher): each engine's shard with
  global-index seeds equals the one-call samples; in-process bucketed refit; sleep is a no-op
  on CPU; shutdown keeps the trainer's group; then a TP=2 engine over both ranks;
* a rank arriving after ``parallel.timeout_minutes`` makes the others fail, not hang;
* the engine's GPU decisions (sleep mode, CUDA graphs, external_launcher) from the config.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_dgpo.models import group_hf_tensors
from megatron_dgpo.rollout.refit import RefitStats, bucket_groups, run_bucketed_refit
from megatron_dgpo.rollout.vllm_engine import VLLMConfig, engine_env, llm_kwargs, sleep_mode_enabled
from tests.conftest import hf_groups
from tests.distributed import free_port, run_ranks
from tests.rollout import _worker_logs
from tests.rollout._families import renamed, renamed_family

LOGPROB_ATOL = 1e-5
MAX_TOKENS = 10
# vLLM's warnings for the modules one reload call did not fill (reload/layerwise.py, inplace.py)
PARTIAL_LOAD_WARNINGS = r"Failed to load weights|were not loaded from checkpoint"
PROBE_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise: ProbeLayer: Failed to load weights"
PROBE_INPLACE = ("vllm.model_executor.model_loader.reload.inplace: Following weights were not "
                 "loaded from checkpoint: {'probe.weight'}")


# ------------------------------------------------------------------------------ pure bucketing

def _state_dict(arch: str, tied: bool) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(name, tensor) pairs as a saved HF checkpoint holds them (tied: no lm_head), and the
    HF config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    cls, cfg = ((Qwen2ForCausalLM, Qwen2Config(**common)) if arch == "qwen2"
                else (LlamaForCausalLM, LlamaConfig(**common)))
    sd = cls(cfg).state_dict()
    return [(k, v) for k, v in sd.items() if not (tied and k == "lm_head.weight")], cfg.to_dict()


def _expected_group(name: str) -> str:
    """Independent statement of vLLM's packed modules: per layer, {q,k,v}_proj.{weight,bias}
    and {gate,up}_proj.weight belong together; any other tensor is alone."""
    m = re.match(r"model\.layers\.(\d+)\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.", name)
    if not m:
        return name
    return f"{m.group(1)}/{'qkv' if m.group(2).startswith('self_attn') else 'gate_up'}"


def _nbytes(pairs) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


def _check_buckets(buckets, pairs, bucket_bytes, key=_expected_group):
    """Every tensor once, values unchanged, copies; each fused group (``key``) in one bucket;
    the size bound kept but by a bucket of one group; greedy packing."""
    got = [(n, t) for b in buckets for n, t in b]
    assert sorted(n for n, _ in got) == sorted(n for n, _ in pairs)
    source = dict(pairs)
    for n, t in got:
        assert torch.equal(t, source[n]) and t.data_ptr() != source[n].data_ptr()  # exact: copies
    where = {n: i for i, b in enumerate(buckets) for n, _ in b}
    members: dict[str, set[int]] = {}
    for n, _ in pairs:
        members.setdefault(key(n), set()).add(where[n])
    assert all(len(at) == 1 for at in members.values()), members
    for b in buckets:
        if _nbytes(b) > bucket_bytes:
            assert len({key(n) for n, _ in b}) == 1
    if bucket_bytes == 1:  # every group alone
        assert len(buckets) == len(members)
    if bucket_bytes == 1 << 30:
        assert len(buckets) == 1
    if bucket_bytes == 20000:  # greedy packing: no two neighbours would have fit together
        sizes = [_nbytes(b) for b in buckets]
        assert all(a + b > 20000 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)])
@pytest.mark.parametrize("order", ["hf", "alphabetical"])
@pytest.mark.parametrize("bucket_bytes", [1, 6000, 20000, 1 << 30])
def test_buckets_never_split_a_fused_group(arch, tied, order, bucket_bytes):
    pairs, cfg = _state_dict(arch, tied)
    if order == "alphabetical":  # safetensors' order: o_proj lands between k_proj and q_proj
        pairs = sorted(pairs)
    names = [n for n, _ in pairs]
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("lm_head.weight" in names) == (not tied)
    groups = group_hf_tensors(cfg, dict(pairs))
    assert sum(1 for g in groups if len(g) > 1) == 2 * 3  # q/k/v and gate/up of 3 layers
    _check_buckets(list(bucket_groups(groups, bucket_bytes)), pairs, bucket_bytes)


def test_a_family_with_other_hf_names_is_grouped_and_bucketed_by_its_map(monkeypatch):
    """The groups come from the family map, not from the names: a family whose HF names share
    nothing with Qwen2's (``blocks.0.attn.wq.weight``) groups and buckets as Qwen2 does."""
    family = renamed_family(monkeypatch)
    pairs, cfg = _state_dict("qwen2", tied=False)
    other = [(renamed(n), t) for n, t in pairs]
    assert not {n for n, _ in other} & {n for n, _ in pairs}
    back = {renamed(n): n for n, _ in pairs}
    groups = group_hf_tensors({**cfg, "model_type": family.name}, dict(sorted(other)))
    assert [[back[n] for n, _ in g] for g in groups] == [
        [n for n, _ in g] for g in group_hf_tensors(cfg, dict(pairs))]
    for bucket_bytes in (1, 6000, 20000):
        _check_buckets(list(bucket_groups(groups, bucket_bytes)), other, bucket_bytes,
                       key=lambda n: _expected_group(back[n]))


def test_bucketing_errors_and_stats():
    pairs, cfg = _state_dict("qwen2", False)
    groups = group_hf_tensors(cfg, dict(pairs))
    with pytest.raises(KeyError, match="model.layers.0.self_attn.rotary.weight"):
        group_hf_tensors(cfg, {**dict(pairs), "model.layers.0.self_attn.rotary.weight": pairs[0][1]})
    with pytest.raises(ValueError, match="given twice"):
        list(bucket_groups(groups[:2] + groups[:1], 1 << 20))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_groups(groups, 0))
    with pytest.raises(ValueError, match="empty"):
        run_bucketed_refit(iter(()), 100, lambda bucket: None)
    seen = []
    stats = run_bucketed_refit(iter(groups), 20000, seen.append)
    assert isinstance(stats, RefitStats) and stats.buckets == len(seen) > 1
    assert stats.tensors == len(pairs) and stats.total_bytes == _nbytes(pairs)
    assert stats.max_bucket_bytes == max(_nbytes(b) for b in seen) == max(stats.bucket_bytes)
    assert set(stats.as_metrics()) == {"refit/buckets", "refit/max_bucket_bytes", "refit/seconds"}
    assert stats.seconds > 0


# ------------------------------------------------------------------------- engine decisions

@pytest.mark.parametrize("cpu", [True, False])
@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_engine_kwargs_per_platform(cpu, placement):
    cfg = VLLMConfig(model="m", placement=placement, tensor_parallel_size=2)
    kw = llm_kwargs(cfg, cpu=cpu)
    assert kw["enforce_eager"] is cpu  # CUDA graphs on GPU unless configured
    assert ("distributed_executor_backend" in kw) == (placement == "colocated")
    if placement == "colocated":
        assert kw["distributed_executor_backend"] == "external_launcher" and kw["tensor_parallel_size"] == 2
    # vLLM refuses sleep mode on CPU: never ask for it there; on GPU by default when colocated
    assert kw.get("enable_sleep_mode", False) is (not cpu and placement == "colocated")
    assert sleep_mode_enabled(VLLMConfig(model="m", placement=placement, sleep_mode=True), cpu=cpu) is (not cpu)
    assert sleep_mode_enabled(VLLMConfig(model="m", placement=placement, sleep_mode=False), cpu=cpu) is False
    assert llm_kwargs(VLLMConfig(model="m", enforce_eager=True), cpu=cpu)["enforce_eager"] is True
    assert ("kv_cache_memory_bytes" in kw) is cpu
    # colocated on GPU as verl runs it: no custom all-reduce, dummy weights for the first refit
    gpu_colocated = not cpu and placement == "colocated"
    assert kw.get("disable_custom_all_reduce", False) is gpu_colocated
    # and no other all-reduce than NCCL beside the trainer's: the fused all-reduce + RMSNorm
    # compile pass (FlashInfer's workspace) off, FlashInfer and symmetric memory off
    assert kw.get("compilation_config") == ({"pass_config": {"fuse_allreduce_rms": False}}
                                            if gpu_colocated else None)
    assert engine_env(cfg, cpu=cpu) == ({"VLLM_ALLREDUCE_USE_FLASHINFER": "0",
                                         "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "0",
                                         "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
                                         "VLLM_USE_NCCL_SYMM_MEM": "0"} if gpu_colocated else {})
    assert (kw.get("load_format") == "dummy") is gpu_colocated
    assert "load_format" not in llm_kwargs(VLLMConfig(model="m", placement=placement, dummy_weights=False), cpu=cpu)
    assert llm_kwargs(VLLMConfig(model="m", placement=placement, dummy_weights=True), cpu=cpu)["load_format"] == "dummy"


def test_dedicated_engine_keeps_custom_all_reduce(monkeypatch):
    """An engine on dedicated GPUs (in process over the rollout ranks like a colocated one, but
    no trainer beside it) keeps vLLM's custom all-reduce; one on the trainer's GPUs turns it
    off. GPU decisions, checked from the configs build_engine makes."""
    from megatron_dgpo.recipe import RolloutConfig
    from megatron_dgpo.rollout import generate, vllm_engine

    configs = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", configs.append)
    for dedicated in (False, True):
        generate.build_engine(RolloutConfig(), "m", placement="colocated",
                              tensor_parallel_size=2, refitted=True, dedicated=dedicated)
    colocated, dedicated = (llm_kwargs(config, cpu=False) for config in configs)
    assert colocated["disable_custom_all_reduce"] is True
    assert "disable_custom_all_reduce" not in dedicated
    # nor does it narrow the other all-reduces to NCCL
    assert "compilation_config" not in dedicated and engine_env(configs[1], cpu=False) == {}
    assert engine_env(configs[0], cpu=False)["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert (dedicated["distributed_executor_backend"], dedicated["tensor_parallel_size"],
            dedicated["load_format"]) == ("external_launcher", 2, "dummy")
    assert "enable_sleep_mode" not in dedicated and colocated["enable_sleep_mode"] is True
    # on CPU neither asks (no custom all-reduce there)
    assert not any("disable_custom_all_reduce" in llm_kwargs(c, cpu=True) for c in configs)


class _RecordingLLM:
    """Stands in for ``vllm.LLM`` on a GPU platform (sleep mode cannot run on CPU): records the
    engine's calls so their order can be checked."""

    def __init__(self, **kwargs):
        from types import SimpleNamespace

        from transformers import AutoConfig

        self.kwargs, self.calls = kwargs, []
        # what the engine reads of vLLM's model config: whether the output layer is tied
        self.model_config = SimpleNamespace(hf_text_config=AutoConfig.from_pretrained(kwargs["model"]))
        # and which model runner vLLM chose (V2: vLLM 0.32's default on CUDA with Triton)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=True))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, args=(), kwargs=None):
        from megatron_dgpo.rollout import vllm_worker

        if method is vllm_worker.reload_weights_in_worker:  # the GPU path reloads through it too
            weights = kwargs["weights"]
            self.calls.append(("reload", len(weights)))
            return [{"tensors": len(weights), "loaded": sorted({self._packed(n) for n, _ in weights})}]
        self.calls.append((method if isinstance(method, str) else method.__name__,))
        if method is vllm_worker.parameter_names:
            return [sorted(self.PARAMETERS)]
        return [False]

    # the vLLM parameters of the test's stream: q/k/v packed into one, as vLLM does
    PARAMETERS = {"model.layers.0.self_attn.qkv_proj.weight", "model.norm.weight"}

    @staticmethod
    def _packed(name: str) -> str:
        return re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name)

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def test_gpu_sleep_wake_order_around_refit(monkeypatch, caplog, tiny_model_dir):
    import os

    import torch.distributed as dist
    import vllm

    from megatron_dgpo.rollout import vllm_engine

    monkeypatch.setattr(vllm, "LLM", _RecordingLLM)
    monkeypatch.setattr(vllm_engine, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(vllm_engine, "_check_colocation", lambda config: None)
    # the all-reduce variables the engine sets (restored after the test), one exported by the user
    for key in vllm_engine.NCCL_ONLY_ALL_REDUCE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_SYMM_MEM", "1")
    with caplog.at_level("WARNING", logger="megatron_dgpo.rollout.vllm_engine"):
        engine = vllm_engine.VLLMEngine(VLLMConfig(model=str(tiny_model_dir), placement="colocated",
                                                   refit_bucket_bytes=1))
    assert {k: os.environ[k] for k in vllm_engine.NCCL_ONLY_ALL_REDUCE_ENV} == {
        "VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "0",
        "VLLM_ALLREDUCE_USE_SYMM_MEM": "1", "VLLM_USE_NCCL_SYMM_MEM": "0"}
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM=1 from the environment kept" in caplog.text
    llm = engine.llm
    assert llm.kwargs["enable_sleep_mode"] and llm.kwargs["enforce_eager"] is False
    assert llm.kwargs["load_format"] == "dummy" and not engine.holds_weights
    with pytest.raises(RuntimeError, match="holds no weights"):
        engine.generate([[1, 2]], max_tokens=2)
    engine.sleep()
    engine.sleep()  # already asleep: no second call
    pairs = [(f"model.layers.0.self_attn.{p}_proj.weight", torch.zeros(2)) for p in "qkv"]
    groups = [pairs, [("model.norm.weight", torch.zeros(2))]]
    engine.update_weights(iter(groups))
    # untied: no refresh of the output layer (only a tied one needs it)
    assert llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("parameter_names",), ("reload", 3),
                         ("reload", 1), ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert engine.holds_weights
    llm.calls.clear()
    engine.update_weights(iter(groups))  # awake: no wake-up calls
    assert [c[0] for c in llm.calls] == ["parameter_names", "reload", "reload",
                                         "reset_prefix_cache"]
    # around a checkpoint save (offloaded training state comes back): level 1 whatever the
    # config says, the weights wait on the host and the next wake-up brings them back
    llm.calls.clear()
    engine.sleep(keep_weights=True)
    assert llm.calls == [("sleep", 1)] and engine.holds_weights
    engine._wake(None)
    assert llm.calls[-1] == ("wake_up", ("kv_cache", "weights"))
    engine.sleep()  # level 2 drops the weights: generating before the next refit is refused
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        engine.generate([[1, 2]], max_tokens=2)
    engine._closed = True  # nothing real to shut down
    assert not dist.is_initialized()


def test_engine_config_errors():
    with pytest.raises(ValueError, match="placement"):
        VLLMConfig(model="m", placement="remote")
    with pytest.raises(ValueError, match="refit_bucket_bytes"):
        VLLMConfig(model="m", refit_bucket_bytes=1 << 32)
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMConfig(model="m", sleep_level=3)


def test_colocated_needs_a_process_group(tiny_model_dir):
    from megatron_dgpo.rollout.vllm_engine import VLLMEngine

    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        VLLMEngine(VLLMConfig(model=str(tiny_model_dir), placement="colocated"))


# --------------------------------------------------------------------- real vLLM: separate

@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    from megatron_dgpo.tasks.prompts import builtin_prompts, render_prompts

    records = builtin_prompts()
    return render_prompts(tiny_tokenizer, [records[i] for i in (0, 20, 150, 40)])


def _hf_max_diff(model_dir, prompts, groups) -> float:
    from tests._rank_fns_colocated import _max_diff_vs_transformers

    return _max_diff_vs_transformers(model_dir, prompts, groups)


def test_separate_engine_refits_in_tiny_buckets(vllm_engine, prompts, tiny_model_dir, tiny_model_dir_b):
    seeds = [70 + i for i in range(len(prompts))]
    old_bucket = vllm_engine.config.refit_bucket_bytes
    try:
        vllm_engine.update_weights_from_dir(tiny_model_dir_b)
        full = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seeds=seeds)
        vllm_engine.update_weights_from_dir(tiny_model_dir)
        vllm_engine.config.refit_bucket_bytes = 128 << 10
        b = load_file(str(tiny_model_dir_b / "model.safetensors"))
        vllm_engine.llm.collective_rpc(_worker_logs.start)
        try:
            stats = vllm_engine.update_weights(hf_groups(tiny_model_dir_b, b))
            vllm_engine.llm.collective_rpc(_worker_logs.probe)
        finally:
            (logged,) = vllm_engine.llm.collective_rpc(_worker_logs.stop)
        assert stats is vllm_engine.last_refit and stats.tensors == len(b)
        assert stats.buckets >= 2 * 2 + 2  # per layer: qkv alone, gate/up alone; embed, lm_head
        # vLLM's per-call warnings about the modules a bucket does not hold stay quiet during
        # the refit (the completeness check replaces them), and only then: the probe logged
        # after it is kept
        flood = [m for m in logged if re.search(PARTIAL_LOAD_WARNINGS, m)]
        assert flood == [PROBE_LAYERWISE, PROBE_INPLACE], flood[:4]
        after = vllm_engine.generate(prompts, n=3, max_tokens=MAX_TOKENS, seeds=seeds)
        assert _hf_max_diff(tiny_model_dir_b, prompts, after) < LOGPROB_ATOL
        assert _hf_max_diff(tiny_model_dir, prompts, after) > 1e-2
        assert [[s.token_ids for s in g] for g in after] == [[s.token_ids for s in g] for g in full]
        assert max(abs(x - y) for ga, gb in zip(after, full) for sa, sb in zip(ga, gb)
                   for x, y in zip(sa.logprobs, sb.logprobs)) < LOGPROB_ATOL
        # seeds per prompt: a prompt's samples do not depend on the call it is in
        halves = (vllm_engine.generate(prompts[:2], n=3, max_tokens=MAX_TOKENS, seeds=seeds[:2])
                  + vllm_engine.generate(prompts[2:], n=3, max_tokens=MAX_TOKENS, seeds=seeds[2:]))
        assert [[s.token_ids for s in g] for g in halves] == [[s.token_ids for s in g] for g in after]
        with pytest.raises(ValueError, match="seeds for"):
            vllm_engine.generate(prompts, seeds=seeds[:1])
    finally:
        vllm_engine.config.refit_bucket_bytes = old_bucket
        vllm_engine.update_weights_from_dir(tiny_model_dir)


def test_refit_that_misses_or_repeats_a_parameter_fails(vllm_engine, prompts, tiny_model_dir,
                                                        tiny_model_dir_b):
    """Every vLLM parameter is loaded exactly once per refit: a stream that lacks a tensor, a
    bucket sent twice and a fused group split over two buckets each fail naming the vLLM
    parameter; the engine then refuses to sample until a good refit."""
    seeds = [40 + i for i in range(len(prompts))]
    on_a = vllm_engine.generate(prompts, n=2, max_tokens=MAX_TOKENS, seeds=seeds)
    b = load_file(str(tiny_model_dir_b / "model.safetensors"))
    norm = "model.layers.1.post_attention_layernorm.weight"  # vLLM keeps the HF name

    def refused():
        with pytest.raises(RuntimeError, match="holds no weights"):
            vllm_engine.generate(prompts, max_tokens=2, seed=0)
        return True

    try:
        with pytest.raises(RuntimeError, match=rf"vLLM parameter '{re.escape(norm)}' was not loaded by "
                                                r"any of the \d+ reload calls of this refit \(1 missing"):
            vllm_engine.update_weights(hf_groups(tiny_model_dir_b,
                                                 {n: t for n, t in b.items() if n != norm}))
        assert refused()

        vllm_engine.begin_refit()
        vllm_engine.load_bucket([("model.norm.weight", b["model.norm.weight"])])
        with pytest.raises(RuntimeError, match=r"vLLM parameter 'model\.norm\.weight' loaded by reload calls "
                                               r"1 and 2 of this refit \(1 loaded again"):
            vllm_engine.load_bucket([("model.norm.weight", b["model.norm.weight"])])
        assert refused()

        # q and k of layer 0 in one call, v in the next: vLLM's packed qkv_proj is loaded by both
        qk = [(n, t) for n, t in b.items() if re.match(r"model\.layers\.0\.self_attn\.[qk]_proj\.", n)]
        v = [(n, t) for n, t in b.items() if n.startswith("model.layers.0.self_attn.v_proj.")]
        assert len(qk) == 4 and len(v) == 2  # weights and biases
        vllm_engine.begin_refit()
        vllm_engine.load_bucket(qk)
        with pytest.raises(RuntimeError, match=r"vLLM parameter 'model\.layers\.0\.self_attn\.qkv_proj\.bias' "
                                               r"loaded by reload calls 1 and 2 of this refit \(2 loaded again"):
            vllm_engine.load_bucket(v)
        assert refused()
        with pytest.raises(RuntimeError, match="begin_refit"):
            vllm_engine.end_refit()  # the failed refit is over: no end without a new begin
    finally:
        vllm_engine.update_weights(hf_groups(tiny_model_dir))
    again = vllm_engine.generate(prompts, n=2, max_tokens=MAX_TOKENS, seeds=seeds)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in on_a]
    assert _hf_max_diff(tiny_model_dir, prompts, again) < LOGPROB_ATOL


# -------------------------------------------------------------------- real vLLM: colocated

def test_colocated_engines_on_two_ranks(prompts, tiny_model_dir, tiny_model_dir_b):
    from tests._rank_fns_colocated import colocated_engines

    r0, r1 = run_ranks(colocated_engines, 2, str(tiny_model_dir), str(tiny_model_dir_b),
                       [list(p) for p in prompts], timeout=900, start_method="spawn")  # vLLM
    half = len(prompts) // 2
    # two engines, same per-prompt seeds -> the samples one engine gives in one call
    assert r0["whole"] == r1["whole"]
    assert r0["shard"] + r1["shard"] == r0["whole"]
    assert len({tuple(map(tuple, g)) for g in r0["whole"]}) == len(prompts)
    for r in (r0, r1):
        assert len(r["shard"]) == half
        assert r["diff_a"] < LOGPROB_ATOL
        assert r["refit"]["buckets"] >= 6 and r["refit"]["tensors"] == len(load_file(str(tiny_model_dir_b / "model.safetensors")))
        assert r["refit"]["metrics"]["refit/buckets"] == r["refit"]["buckets"]
        assert r["diff_b"] < LOGPROB_ATOL and r["diff_b_vs_a"] > 1e-2
        assert r["bucketed_equals_dir"] and r["lp_bucketed_vs_dir"] < LOGPROB_ATOL
        assert r["all_reduce_after_shutdown"] == 3.0
        assert r["tp2_refused_before_refit"]
        assert r["tp2_diff_a"] < LOGPROB_ATOL and r["tp2_diff_b"] < LOGPROB_ATOL
        assert r["tp2_buckets"] >= 6
    assert r0["tp2_tokens"] == r1["tp2_tokens"]  # one engine: both TP ranks see the same result


# --------------------------------------------------------------------------------- timeout

def test_a_slow_rank_times_out_instead_of_hanging():
    from tests._rank_fns_colocated import slow_rank_times_out

    timeout_minutes, delay = 0.05, 10.0  # 3 s
    r0, _ = run_ranks(slow_rank_times_out, 2, free_port(), timeout_minutes, delay, timeout=120)
    for name in ("dp_group", "world"):
        error, waited = r0[name]
        assert error is not None and re.search(r"[Tt]imed out", error), (name, error)
        assert "3000ms" in error  # the configured timeout, not a default
        assert waited < delay - 2, (name, waited)


# ------------------------------------------------------------------------ engine placement

def test_engine_layout_and_prompt_shards():
    from megatron_dgpo.rollout.placement import EngineLayout, prompt_seeds, shard_prompts

    layouts = [EngineLayout(8, r, 2) for r in range(8)]
    assert [l.engine_index for l in layouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [l.is_engine_leader for l in layouts] == [True, False] * 4
    assert {l.num_engines for l in layouts} == {4}
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        EngineLayout(8, 0, 3)
    for num_prompts in (0, 1, 7, 12, 13):
        for engines in (1, 2, 3, 5):
            shards = [shard_prompts(num_prompts, engines, e) for e in range(engines)]
            assert [i for s in shards for i in s] == list(range(num_prompts))  # disjoint, ordered
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # global prompt index (10 consumed + position) x group size 4, above the run's seed root
    assert prompt_seeds(100, 10, range(3, 6), 4) == [(100 << 40) + 52, (100 << 40) + 56, (100 << 40) + 60]
