"""benchmarks/gpu_check.py on a machine without CUDA: one line saying it skipped, exit 0,
nothing written (the GPU checks themselves run only on a GPU); what every check needs, and the
"not run: needs ..." rows where that is missing, decided without a GPU. (A GPU node whose CUDA
does not start: tests/runtime/test_cuda_unusable.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTHING = {"TE": False, "vLLM": False, "apex": False, "GPUs": 1}  # torch + megatron-core only
FULL = {"TE": True, "vLLM": True, "apex": True, "GPUs": 8}


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--out", str(tmp_path / "results")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu_check: skipped: no CUDA device (the GPU checks need one)"]
    assert not (tmp_path / "results").exists()


def test_every_check_is_its_own_function_and_declares_its_needs(gpu_check):
    names = [name for name, _ in gpu_check.CHECKS]
    assert len(set(names)) == len(names) == 15
    assert len({fn for _, fn in gpu_check.CHECKS}) == len(names)
    # a function per check, or the tiny-run function bound to its layout's name
    assert all(name in getattr(fn, "__name__", "") or fn.args == (name,) for name, fn in gpu_check.CHECKS)
    assert set(gpu_check.NEEDS) == set(names)
    for needs in gpu_check.NEEDS.values():  # no typo: every need is one that can be checked
        gpu_check.missing_requirements(needs, FULL)
    # the module docstring lists every check
    assert all(f"``{name}``" in gpu_check.__doc__ for name in names)


def test_missing_requirements(gpu_check):
    missing = gpu_check.missing_requirements
    assert missing((), NOTHING) == []
    assert missing(("TE", "apex"), NOTHING) == ["TE", "apex"]
    assert missing(("TE", "apex"), dict(NOTHING, TE=True)) == ["apex"]
    assert missing(("vLLM",), dict(NOTHING, vLLM=True)) == []
    assert missing(("2 GPUs",), NOTHING) == ["2 GPUs"]
    assert missing(("2 GPUs",), dict(NOTHING, GPUs=2)) == []
    assert missing(("2 GPUs",), {}) == ["2 GPUs"]
    with pytest.raises(ValueError, match="'transformer_engine'"):
        missing(("transformer_engine",), FULL)


def test_torch_and_megatron_alone_still_run_the_trainer_checkpoint_and_kernel_checks(gpu_check):
    runnable = {name for name, needs in gpu_check.NEEDS.items()
                if not gpu_check.missing_requirements(needs, NOTHING)}
    assert runnable == {"attention_choice", "logprobs_v152064", "distopt_checkpoint",
                        "tiny_gpu_run", "tiny_gpu_stop_resume"}
    assert not any(gpu_check.missing_requirements(n, FULL) for n in gpu_check.NEEDS.values())


def test_a_check_whose_needs_are_missing_is_not_called(gpu_check):
    def must_not_run():
        raise AssertionError("called")

    row = gpu_check.run_check("throughput_1p5b", must_not_run, dict(NOTHING, TE=True))
    assert (row.check, row.ok, row.result) == ("throughput_1p5b", None, "not run: needs apex")
    row = gpu_check.run_check("tiny_gpu_tp2", must_not_run, NOTHING)
    assert row.ok is None and row.result == "not run: needs 2 GPUs"
    assert "| tiny_gpu_tp2 | - | not run: needs 2 GPUs |" in gpu_check._table([row])
    # with its needs met it runs; what it raises is a failed row, not a crash of the run
    row = gpu_check.run_check("tiny_gpu_tp2", must_not_run, FULL)
    assert row.ok is False and row.result == "error: AssertionError: called"
    ran = gpu_check.run_check("logprobs_v152064",
                              lambda: gpu_check.Row("logprobs_v152064", True, "r", "g"), NOTHING)
    assert ran.ok is True and "check_seconds" in ran.numbers


def test_tiny_runs_take_hf_generate_and_the_local_spec_where_vllm_and_te_are_missing(gpu_check, tmp_path):
    assert gpu_check.tiny_gpu_overrides(FULL) == []
    assert gpu_check.tiny_gpu_overrides(NOTHING) == ["rollout.engine=hf",
                                                     "model.without_transformer_engine=true"]
    assert gpu_check.tiny_gpu_overrides(dict(FULL, vLLM=False)) == ["rollout.engine=hf"]
    # the recipe accepts them (a typo in a key would fail every tiny run on such a node)
    from megatron_dgpo.recipe import load_recipe

    cfg = load_recipe(str(ROOT / "recipes" / "tiny_gpu.yaml"),
                      gpu_check.tiny_gpu_overrides(NOTHING) + ["checkpoint.save_every=0"])
    assert cfg.rollout.engine == "hf" and cfg.model.without_transformer_engine
    assert cfg.train.steps == gpu_check.TINY_GPU_STEPS
    assert cfg.checkpoint.saves_at(cfg.train.steps, cfg.train.steps)  # the final checkpoint


def test_tiny_gpu_layouts_run_under_torchrun_at_tp2_and_dp2(gpu_check):
    one = gpu_check.tiny_gpu_command(*gpu_check.TINY_GPU_LAYOUTS["tiny_gpu_run"], "r")
    assert one[:3] == [sys.executable, "-m", "megatron_dgpo.train"]
    for name, parallel in (("tiny_gpu_tp2", ["parallel.tensor_parallel=2"]), ("tiny_gpu_dp2", [])):
        cmd = gpu_check.tiny_gpu_command(*gpu_check.TINY_GPU_LAYOUTS[name], "r")
        assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
        assert cmd[cmd.index("-m", 2):][:2] == ["-m", "megatron_dgpo.train"]
        assert [a for a in cmd if a.startswith("parallel.")] == parallel
        assert gpu_check.NEEDS[name] == ("2 GPUs",)


def test_stop_signal_is_sent_after_the_first_metrics_line(gpu_check, tmp_path):
    """The stop half of ``tiny_gpu_stop_resume`` against a stand-in trainer: it writes its first
    metrics line, then finishes "the step in flight" (a second line) on SIGTERM and exits 75.
    The signal must come after the first line, not before and not never."""
    run = tmp_path / "run"
    trainer = (
        "import pathlib, signal, sys, time\n"
        f"run = pathlib.Path({str(run)!r}); run.mkdir()\n"
        "def stop(*_):\n"
        "    (run / 'metrics.jsonl').write_text('{\"step\": 1}\\n{\"step\": 2}\\n')\n"
        "    sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(0.5)\n"
        "(run / 'metrics.jsonl').write_text('{\"step\": 1}\\n')\n"
        "time.sleep(60)\n"
        "sys.exit(3)\n")
    rc, seconds = gpu_check._stop_after_first_step([sys.executable, "-c", trainer], run,
                                                   tmp_path / "log")
    assert rc == 75 and seconds < 30, (tmp_path / "log").read_text()
    assert gpu_check._run_state(run)["steps"] == [1, 2]
    # a trainer that ends before logging a step: its status, no signal, no wait
    rc, seconds = gpu_check._stop_after_first_step([sys.executable, "-c", "raise SystemExit(2)"],
                                                   tmp_path / "none", tmp_path / "log2")
    assert (rc, seconds) == (2, 0.0)


@pytest.mark.slow  # two trainer runs, ~35 s: `make test-slow`
def test_stop_resume_row_against_the_cpu_trainer(gpu_check, monkeypatch):
    """``tiny_gpu_stop_resume`` end to end, the GPU recipe swapped for tiny_cpu.yaml (5 steps,
    transformers' generate): the real trainer stops on SIGTERM with exit 75 and its step
    saved, and the same command continues it to step 5 with the final checkpoint and export."""
    def cpu_command(gpus, overrides, run_dir):
        return [sys.executable, "-m", "megatron_dgpo.train", str(ROOT / "recipes/tiny_cpu.yaml"),
                f"run_dir={run_dir}", "logging.progress_bar=false", "logging.tensorboard=false",
                f"train.steps={gpu_check.TINY_GPU_STEPS}", *overrides]

    monkeypatch.setattr(gpu_check, "tiny_gpu_command", cpu_command)
    monkeypatch.setattr(gpu_check, "available_components", lambda: dict(NOTHING, GPUs=0))
    row = gpu_check.run_check("tiny_gpu_stop_resume", gpu_check.check_tiny_gpu_stop_resume,
                              NOTHING)
    assert row.ok, row.result
    stopped, final = row.numbers["stopped"], row.numbers["final"]
    assert row.numbers["stop_returncode"] == 75 and not stopped["exported"]
    assert 1 <= len(stopped["steps"]) < gpu_check.TINY_GPU_STEPS
    assert final["steps"] == [1, 2, 3, 4, 5] and final["latest"] == "step_000005"


def test_a_check_leaves_tes_attention_switches_as_the_profile_set_them(gpu_check, monkeypatch):
    """Building a model sets TE's NVTE_*_ATTN switches for its backend, and Megatron asserts that
    they agree with what is already set: each check (and each model of ``te_thd_bf16``) starts
    from the profile's switches. ``--profile a100`` is cuDNN attention off, for the checks and
    the trainers they start."""
    for key in gpu_check.NVTE_SWITCHES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NVTE_FUSED_ATTN", gpu_check.PROFILES["a100"]["NVTE_FUSED_ATTN"])

    def builds_a_flash_model():
        os.environ.update(NVTE_FLASH_ATTN="1", NVTE_UNFUSED_ATTN="0")
        return gpu_check.Row("x", True, "", "")

    gpu_check.run_check("attention_choice", builds_a_flash_model, NOTHING)
    assert {k: os.environ.get(k) for k in gpu_check.NVTE_SWITCHES} == {
        "NVTE_FLASH_ATTN": None, "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": None}
    assert gpu_check.PROFILES == {"a100": {"NVTE_FUSED_ATTN": "0"}}


def test_attention_choice_row_on_stand_in_gpus(gpu_check, monkeypatch):
    """The ``attention_choice`` check's own logic, on stand-in ``Platform``s (the check needs
    no TE, so this is what it does on a GPU without one): pass on an H100 (fused), on an H100
    under the A100 profile (flash), on an A100 with flash-attn (flash); fail on an A100 without
    it (the trainer's refusal is the right decision, but that node cannot train)."""
    from dataclasses import replace

    from megatron_dgpo.runtime.gpu_flags import GPU

    h100 = replace(GPU, transformer_engine=False, compute_capability=(9, 0), device_name="H100")
    a100 = replace(h100, compute_capability=(8, 0), device_name="A100")
    bare_a100 = replace(a100, flash_attention="", flash_attention_error="flash-attn is not installed")
    for platform, profile, chosen, ok in ((h100, {}, "fused", True),
                                          (h100, gpu_check.PROFILES["a100"], "flash", True),
                                          (a100, {}, "flash", True), (bare_a100, {}, "refused", False)):
        monkeypatch.setattr(gpu_check, "_gpu_platform", lambda p=platform: p)
        for key in gpu_check.NVTE_SWITCHES:  # a fresh process (a local-spec build sets them)
            monkeypatch.delenv(key, raising=False)
        for key, value in profile.items():
            monkeypatch.setenv(key, value)
        row = gpu_check.check_attention_choice()
        assert row.ok is ok and row.numbers["chosen"].startswith(chosen), row
        assert "flash-attn==2.8.3" in row.numbers["refusal"]


def test_te_thd_bf16_builds_its_te_model_with_the_profiles_switches(gpu_check, monkeypatch):
    """The row's reference weights come from a local-spec model, whose build sets every
    NVTE_*_ATTN switch to 0 (Megatron's ``LanguageModule._set_attention_backend``); the old
    row kept them for the TE model built next, where Megatron asserts, so it failed on every
    GPU. Here the builds are stood in on CPU by Megatron's own switch-setting and a
    one-parameter model (no GPU for the forward), the row's order and restores are the real
    ones: the TE model is built as the trainer's choice on a stand-in H100, the row passes,
    and the switches end as they began."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.enums import AttnBackend

    import megatron_dgpo.models.builder as builder
    from megatron_dgpo.runtime.gpu_flags import GPU

    for key in gpu_check.NVTE_SWITCHES:
        monkeypatch.delenv(key, raising=False)
    built = []

    def build_model(config, *, platform, attention_backend=None, **kwargs):
        backend = attention_backend or (AttnBackend.auto if platform.transformer_engine
                                        else AttnBackend.local)
        LanguageModule._set_attention_backend(SimpleNamespace(config=SimpleNamespace(
            attention_backend=backend, flash_attention_version=None)))
        built.append(backend.name)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.ones(()))
        return [model]

    monkeypatch.setattr(builder, "build_model", build_model)
    monkeypatch.setattr(gpu_check, "_gpu_platform", lambda: replace(
        GPU, compute_capability=(9, 0), device_name="H100"))
    monkeypatch.setattr(gpu_check, "_logits", lambda model, tokens, cu, thd: model.w * torch.ones(
        1, len(tokens), 2))
    monkeypatch.setattr(gpu_check, "_weighted_logprob_loss", lambda logits, targets, w, vocab: (
        (logits[0, :, 0] * w).sum(), logits[0, :, 0].detach()))
    row = gpu_check.run_check("te_thd_bf16", gpu_check.check_te_thd_bf16, FULL)
    assert row.ok, row.result
    assert built == ["local", "local", "fused", "local"]
    assert {k: os.environ.get(k) for k in gpu_check.NVTE_SWITCHES} == dict.fromkeys(
        gpu_check.NVTE_SWITCHES)
