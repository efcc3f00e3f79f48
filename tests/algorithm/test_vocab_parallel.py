"""logprobs_and_entropy over a TP-split vocabulary vs a float64 full-vocabulary reference."""

import pytest
import torch

from megatron_dgpo.algorithm import vocab_parallel
from megatron_dgpo.algorithm.vocab_parallel import logprobs_and_entropy
from tests._rank_fns_vocab import (LARGE_SCALES, large_vocab_and_compiled_cases,
                                   large_vocab_grad_errors, tp_cases_fn, training_run_start_up)
from tests.conftest import TINY_RECIPE
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def tp2():
    """``large_vocab_and_compiled_cases`` on 2 gloo ranks: one launch for three tests (a launch
    costs seconds). The compiled kernels run there only: at TP = 1 they are the same kernels
    without the all-reduces, and inductor in this process would cost its import and compiles
    once more (the ranks compile at the same time, on the two cores CI has)."""
    return run_ranks(large_vocab_and_compiled_cases, 2)


def _check_case(case):
    tol = 1e-5 if case["dtype"] == "torch.float32" else 1e-2
    for key in ("logp", "entropy", "grad"):
        assert case[key] <= tol, (key, case)
    assert case["unmodified"], case
    assert case["out_dtypes"] == ("torch.float32", "torch.float32")
    assert case["ent_requires_grad"] == case["entropy_grad"]
    assert case["grad_dtype"] == case["dtype"]


def test_tp1_tp2_tp4_against_float64_reference():
    results = run_ranks(tp_cases_fn, 4)
    seen = set()
    for rank_cases in results:
        for case in rank_cases:
            _check_case(case)
            seen.add((case["tp"], case["dtype"], case["temperature"]))
    assert {tp for tp, _, _ in seen} == {1, 2, 4}
    assert len(seen) == 3 * 2 * 3


def test_single_process_group_none_and_errors():
    torch.manual_seed(0)
    logits = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (5,))
    logp, entropy = logprobs_and_entropy(logits, targets)
    want = torch.log_softmax(logits.detach(), -1)
    torch.testing.assert_close(logp.double(), want.gather(-1, targets[:, None]).squeeze(-1),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy.double(), -(want.exp() * want).sum(-1), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(ValueError, match="targets must lie in"):
        logprobs_and_entropy(logits, torch.full((5,), 40))
    with pytest.raises(ValueError, match="targets must lie in"):
        logprobs_and_entropy(logits, torch.full((5,), 35), vocab_size=30)
    with pytest.raises(ValueError, match="logits .* and targets"):
        logprobs_and_entropy(logits, targets[:4])
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy(logits, targets, temperature=0.0)
    with pytest.raises(TypeError, match="targets"):
        logprobs_and_entropy(logits, targets.float())


def test_gradient_precision_at_qwen2_vocab_and_large_logit_scales(tp2):
    """float32 rows of scale up to 16 over V = 152064 (151936 real), TP = 1 (eager) and TP = 2
    (eager and compiled kernels): the logits gradient (log-probs only, and log-probs + entropy) is within
    1e-6 of the float64 full-vocabulary one, the log-probs within 1e-6 relative. A backward
    forming p = exp(x - (m + log S)) with the shift rounded to float32 missed this (1.6e-6
    log-probs only, 9.4e-6 with the entropy gradient, at scale 16); so did inductor's float32
    sums on CPU (1.4e-6, 8.5e-6 at scale 4; the compiled sums accumulate in float64)."""
    cases = large_vocab_grad_errors(0, 1, kernels=("eager",)) + [
        c for rank in tp2 for c in rank["large_vocab"]]
    assert {(c["tp"], c["scale"], c["kernel"]) for c in cases} == {
        (tp, s, k) for tp, k in ((1, "eager"), (2, "eager"), (2, "compiled"))
        for s in LARGE_SCALES}
    worst = max(cases, key=lambda c: c["err"])
    assert worst["err"] <= 1e-6, worst
    worst = max(cases, key=lambda c: c["logp_rel"])
    assert worst["logp_rel"] <= 1e-6, worst


def test_compiled_kernels_against_float64_reference(tp2):
    """kernel="compiled" through inductor's CPU backend at TP = 2 (gloo), on both ranks (the
    first holds whole columns, the second TP padding too): float32 with and without the entropy
    gradient, bf16 logits with a bf16 gradient, T != 1, a last chunk shorter than the others."""
    cases = [c for rank in tp2 for c in rank["compiled"]]
    for case in cases:
        _check_case(case)
    assert sorted((c["tp"], c["dtype"], c["entropy_grad"]) for c in cases) == sorted(2 * [
        (2, "torch.bfloat16", True), (2, "torch.float32", False), (2, "torch.float32", True)])


def test_start_up_build_compiles_every_graph_the_chunks_use(tp2):
    """The start-up build (``compiled_kernels_work``, inductor's CPU backend) in float32 and
    bf16 compiles 2 graphs per pass and dtype (chunks of several rows, and of one); the calls
    after it compile none: [4, V] and [1, 33, V] logits, with and without the entropy gradient,
    padding columns, T != 1, chunks of 2, 5 and 4 rows with a last one of 1, and a forward
    without grad. Before, the build's float32 graphs (grad mode on, a chunk that did not
    require grad) served no real chunk, and a chunk's view base, its requires_grad and h = 0
    without the entropy gradient each made graphs of their own."""
    for rank in tp2:
        assert rank["graphs"] == dict(built=[True, True], start_up=2 * 2 * 2, later=0), rank


def test_kernel_choice(monkeypatch, caplog):
    """"auto" compiles only where inductor makes Triton code for the logits' device: CUDA with
    Triton usable and the fused passes building there (else eager, with the reason logged),
    never CPU; an unknown kernel name is refused."""
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    monkeypatch.setattr(vocab_parallel, "_compiled_kernels_work_on", lambda device, dtype: True)
    assert vocab_parallel.compiled_by_default("cuda", torch.bfloat16)
    # Triton imports but its kernels do not build here: eager, with the reason in a warning

    def no_c_compiler(fn):
        def build(*args):
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
        return build

    monkeypatch.setattr(vocab_parallel, "_compile", no_c_compiler)
    with caplog.at_level("WARNING", logger="megatron_dgpo.algorithm.vocab_parallel"):
        assert not vocab_parallel.compiled_kernels_work(torch.device("cpu"), torch.float32)
    assert ("do not build for torch.float32 logits on cpu (RuntimeError: Failed to find C "
            "compiler") in caplog.text
    assert not vocab_parallel.compiled_by_default("cpu", torch.float32)
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    assert not vocab_parallel.compiled_by_default(torch.device("cuda", 0), torch.bfloat16)
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        logprobs_and_entropy(logits, torch.zeros(2, dtype=torch.long), kernel="triton")


@pytest.fixture
def no_cached_builds():
    vocab_parallel._compiled_kernels_work_on.cache_clear()
    yield
    vocab_parallel._compiled_kernels_work_on.cache_clear()


def test_auto_runs_eager_for_a_dtype_whose_kernels_do_not_build(monkeypatch, caplog,
                                                                 no_cached_builds):
    """A Triton that builds the float32 kernels but not the bf16 ones: ``"auto"`` takes the
    compiled kernels for float32 logits and the eager ones for bf16 logits, with one warning,
    both against the float64 reference. Before, the build was tried in float32 only and the
    first bf16 call failed in the compiled kernels. Stand-ins for what needs a GPU: CPU passes
    for a device inductor makes Triton code for, and the "compiled" passes are the fused
    functions run by torch, failing on bf16."""
    built = []

    def triton_without_bf16(fn):
        def run(*args):
            if any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
                raise RuntimeError("bf16 is not supported on this GPU\n(Triton's message)")
            built.append(fn.__name__)
            return fn(*args)
        return run

    monkeypatch.setattr(vocab_parallel, "_inductor_makes_triton", lambda device: True)
    monkeypatch.setattr(vocab_parallel, "_compile", triton_without_bf16)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 7, 40, generator=gen) * 3
    targets = torch.randint(0, 40, (1, 7), generator=gen)
    with caplog.at_level("WARNING", logger="megatron_dgpo.algorithm.vocab_parallel"):
        for dtype, compiled, tol in ((torch.float32, True, 1e-6), (torch.bfloat16, False, 4e-3),
                                     (torch.bfloat16, False, 4e-3), (torch.float32, True, 1e-6)):
            del built[:]
            x = logits.to(dtype, copy=True).requires_grad_(True)
            logp, _ = logprobs_and_entropy(x, targets, chunk_size=3)
            logp.sum().backward()
            want = torch.log_softmax(x.detach().double(), -1)
            torch.testing.assert_close(logp.double(), want.gather(-1, targets[..., None])[..., 0],
                                       rtol=0, atol=1e-5)
            want_grad = torch.nn.functional.one_hot(targets, 40) - want.exp()  # d sum logp / dx
            assert x.grad.dtype == dtype
            torch.testing.assert_close(x.grad.double(), want_grad, rtol=0, atol=tol)
            assert bool(built) == compiled, (dtype, built)
    assert vocab_parallel.compiled_by_default("cpu", torch.float32)
    assert not vocab_parallel.compiled_by_default("cpu", torch.bfloat16)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert ("do not build for torch.bfloat16 logits on cpu (RuntimeError: bf16 is not supported "
            "on this GPU); using the eager kernels for them") in warnings[0]


def test_trainer_builds_the_kernels_in_its_dtype_before_any_engine(tmp_path):
    """``TrainingRun`` (the setup RL and SFT share; engines start after it) asks for the
    compiled kernels once, on its models' device in its dtype, before vLLM is imported; on CPU
    that builds nothing (the answer: eager). One rank, the tiny CPU recipe."""
    [got] = run_ranks(training_run_start_up, 1, str(TINY_RECIPE), str(tmp_path / "run"))
    device, dtype = got["run"]
    assert got["calls"] == [(device, dtype, False, False)]
    assert (device, dtype) == ("cpu", "torch.float32") and got["probed"] == 0
