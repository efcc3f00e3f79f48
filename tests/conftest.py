"""Session-wide fixtures: tiny models built locally and ONE vLLM engine per test session.

The engine (~25 s to start on CPU) is created lazily by the first test that asks for it and
shut down explicitly at the end of the session (an engine left running hangs the interpreter's
exit). Tests that refit its weights must restore model A (``tiny_model_dir``) before returning.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
TINY_QUIET = ["logging.progress_bar=false", "logging.tensorboard=false"]
FIRST_STEPS = 6

TINY_INIT_RANGE = 0.1  # peakier than the 0.02 default, so distinct weights give distinct log-probs


def hf_groups(model_dir, tensors=None):
    """The HF folder ``model_dir``'s tensors (or ``tensors``, a subset or altered copy of them)
    in the fused groups an export yields and a refit takes (``models.group_hf_tensors``)."""
    import json

    from safetensors.torch import load_file

    from megatron_dgpo.models import group_hf_tensors

    if tensors is None:
        tensors = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return group_hf_tensors(config, tensors)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Random tiny Qwen2 "A" (seed 0) with the locally trained tokenizer."""
    from megatron_dgpo.tasks.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_a"), seed=0, initializer_range=TINY_INIT_RANGE)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory):
    """Model "B": same architecture and tokenizer as A, different random weights (seed 1)."""
    from megatron_dgpo.tasks.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_b"), seed=1, initializer_range=TINY_INIT_RANGE)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """The session's single vLLM engine on model A, fp32 (exact log-probs)."""
    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine

    engine = VLLMEngine(
        VLLMConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            max_model_len=512,
            max_num_seqs=64,
            kv_cache_memory_bytes=64 << 20,
        )
    )
    try:
        yield engine
    finally:
        engine.shutdown()


# The tiny recipe's run at 1 rank is the reference of many end-to-end checks. `make test` runs it
# as written (tests/test_trainer.py's ``full_run``, 50 steps); the slow and cluster targets, each a
# pytest session of its own, compare against its first steps. A run of fewer steps is the longer
# run's beginning (no schedule depends on ``train.steps``), so those sessions take the steps from
# the 50-step run's metrics when this checkout's `make test` left them in pytest's cache
# (.pytest_cache, absent from a clean clone) for the same recipe, sources, packages and host.


def tiny_run_key() -> str:
    """What the tiny recipe's metrics are a function of: the recipe, the package's files, the
    installed distributions, the interpreter, the threading environment and the host's CPU
    (whose kernels decide the last bits); and the tests that run and keep it."""
    digest = hashlib.sha256()
    files = [TINY_RECIPE, Path(__file__), ROOT / "tests" / "test_trainer.py",
             *sorted((ROOT / "megatron_dgpo").rglob("*"))]
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    distributions = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        cpu = "".join(sorted({line for line in open("/proc/cpuinfo") if line.startswith(("model name", "flags"))}))
    threads = sorted((k, v) for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_", "VLLM_", "TORCH", "PYTORCH")))
    for part in (distributions, sys.version, platform.node(), platform.machine(), os.cpu_count(), cpu, threads):
        digest.update(repr(part).encode() + b"\0")
    return digest.hexdigest()[:20]


def _tiny_run_cache(config) -> Path | None:
    """The folder of the kept run (None under ``-p no:cacheprovider``)."""
    cache = getattr(config, "cache", None)
    return None if cache is None else cache.mkdir("megatron_dgpo_tiny_run")


def keep_tiny_run(config, run_dir: Path) -> None:
    """Keep the metrics of the tiny recipe run as written (1 rank, ``TINY_QUIET``, ``run_dir``)
    for later sessions of this checkout; the metrics of other keys are dropped."""
    cache = _tiny_run_cache(config)
    if cache is None:
        return
    for old in cache.glob("*.jsonl"):
        old.unlink()
    staging = cache / "metrics.jsonl.incomplete"
    staging.write_bytes((run_dir / "metrics.jsonl").read_bytes())
    staging.replace(cache / f"{tiny_run_key()}.jsonl")


@pytest.fixture(scope="session")
def tiny_first_steps(request, tmp_path_factory) -> list[dict]:
    """The metrics of the tiny recipe's first ``FIRST_STEPS`` steps at 1 rank, uninterrupted:
    the reference of the stop-signal, refill, dedicated-engine and layout runs. Taken from the
    50-step run that `make test` kept (``keep_tiny_run``) when its key is this session's, else
    run here (6 steps, no checkpoint, no export)."""
    from megatron_dgpo.telemetry import read_metrics

    cache = _tiny_run_cache(request.config)
    kept = None if cache is None else cache / f"{tiny_run_key()}.jsonl"
    if kept is not None and kept.is_file():
        records = read_metrics(kept)
        if len(records) >= FIRST_STEPS:
            return records[:FIRST_STEPS]
    run_dir = tmp_path_factory.mktemp("tiny_first_steps")
    proc = subprocess.run([sys.executable, "-m", "megatron_dgpo.train", str(TINY_RECIPE), f"run_dir={run_dir}",
                           *TINY_QUIET, f"train.steps={FIRST_STEPS}", "checkpoint.save_every=0",
                           "checkpoint.export_hf=false"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=900, start_new_session=True)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, FIRST_STEPS + 1))
    return records
