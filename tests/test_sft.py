"""The supervised warm start: ``train_step.sft_step`` is transformers' own token-mean NLL (value
and every gradient) at any split, and ``megatron_dgpo.sft`` reads its data and recipe strictly."""

import json

import pytest
import torch

from tests._rank_fns_model import TINY_QWEN2, hf_model, hf_to_megatron_full
from tests._rank_fns_sft import samples, sft_fn
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def reference():
    """transformers' loss and gradients: mean over all response tokens of -log p(next token)."""
    model = hf_model(TINY_QWEN2)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for sample in samples():
        logits = model(sample.tokens[None]).logits[0].double()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, sample.tokens[1:, None])[:, 0]
        response = logp[sample.response_start - 1:]
        total = total - response.sum()
        count += len(response)
    (total / count).backward()
    grads = hf_to_megatron_full({n: p.grad for n, p in model.named_parameters()}, TINY_QWEN2)
    return float(total.detach() / count), count, grads


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 1), (2, 2)], ids=["1rank", "dp2", "tp2"])
def test_sft_step_is_transformers_nll_at_any_split(reference, world_size, tp):
    loss64, count, grads64 = reference
    results = run_ranks(sft_fn, world_size, tp)
    for result in results:
        for name, run in result.items():
            assert run["num_tokens"] == count, name
            assert run["loss"] == pytest.approx(loss64, rel=1e-5), name
            assert run["pad_ok"], name
    runs = results[0]
    assert runs["rows_of_30"]["rows"] > runs["one_row"]["rows"]  # really split
    for name, run in runs.items():
        assert sorted(run["grads"]) == sorted(grads64)
        for key, want in grads64.items():
            err = float((run["grads"][key].double() - want).abs().max())
            assert err <= 1e-5 * max(1.0, float(want.abs().max())), (name, key, err)


def test_sft_data_and_recipe_errors(tmp_path):
    from megatron_dgpo.runtime.config import ConfigError
    from megatron_dgpo.sft import SFTConfig, load_sft_recipe, tokenize_pairs
    from megatron_dgpo.tasks.prompts import load_sft_pairs

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "response": "ok"}) + "\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "x"}], "answer": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl row 1: missing field 'response'"):
        load_sft_pairs(data)
    data.write_text(json.dumps({"prompt": "hi", "response": ""}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: field 'response' must be a non-empty string"):
        load_sft_pairs(data)
    with pytest.raises(ConfigError, match="sft.data"):
        load_sft_recipe(None, ["model.path=/x"])
    with pytest.raises(ConfigError, match="batch_samples"):
        load_sft_recipe(None, ["model.path=/x", "sft.data=/y", "sft.batch_samples=0"])

    from transformers import AutoTokenizer

    from megatron_dgpo.tasks.tiny import make_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m"))
    data.write_text(json.dumps({"prompt": "What is 3+4?", "response": "\\boxed{7}"}) + "\n")
    (sample,) = tokenize_pairs(SFTConfig(data=str(data), micro_batch_tokens=64), tokenizer)
    # the response is trained with its end-of-turn token: the policy learns to stop
    assert sample.tokens[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(sample.tokens[sample.response_start:-1]) == "\\boxed{7}"
    with pytest.raises(ValueError, match=r"row 0: \d+ tokens do not fit in sft.micro_batch_tokens=8"):
        tokenize_pairs(SFTConfig(data=str(data), micro_batch_tokens=8), tokenizer)


def test_every_sft_key_is_documented():
    from megatron_dgpo.runtime.config import describe
    from megatron_dgpo.sft import SFTRunConfig

    rows = list(describe(SFTRunConfig))
    assert {"sft.data", "sft.steps", "model.path", "optimizer.lr"} <= {key for key, _, _ in rows}
    assert all(doc for _, _, doc in rows), [key for key, _, doc in rows if not doc]


def test_sft_cli_time_budget_stop_then_rerun_is_exact_and_exports_hf(tmp_path):
    """4 steps in one go == a run stopped by its time budget (``sft.max_minutes``: a checkpoint
    of the last step, exit 75, no export), then the same command continued (resume is the
    default) to 4 (same losses, bit for bit); the export is an HF folder transformers loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from megatron_dgpo.runtime.interrupt import EXIT_STOPPED
    from megatron_dgpo.tasks.arithmetic import TaskSizes, make_task
    from megatron_dgpo.telemetry import read_metrics

    root = Path(__file__).resolve().parents[1]
    task = make_task(tmp_path / "task", sizes=TaskSizes(sft=64, train=1, heldout=1))
    common = [f"model.path={task / 'initial_model'}", f"sft.data={task / 'sft.jsonl'}",
              "sft.batch_samples=16", "sft.micro_batch_tokens=256", "checkpoint.save_every=3",
              "logging.progress_bar=false", "logging.tensorboard=false"]

    def sft(run_dir, steps, *extra, status=0):
        proc = subprocess.run([sys.executable, "-m", "megatron_dgpo.sft", str(root / "recipes" / "sft_arithmetic.yaml"),
                               f"run_dir={run_dir}", f"sft.steps={steps}", *common, *extra],
                              cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == status, proc.stderr[-3000:]

    sft(tmp_path / "whole", 4)
    # 6 ms: spent before step 1 ends, so the run stops after it, off the save schedule
    sft(tmp_path / "split", 4, "sft.max_minutes=0.0001", status=EXIT_STOPPED)
    first = read_metrics(tmp_path / "split")
    assert [r["step"] for r in first] == [1]
    assert (tmp_path / "split" / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert not (tmp_path / "split" / "hf").exists()  # exported only when the run is done
    sft(tmp_path / "split", 4)
    whole, split = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    assert split[:1] == first  # continued from the step-1 checkpoint, not started over
    assert [r["sft/loss"] for r in split] == [r["sft/loss"] for r in whole]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "hf").num_parameters() > 0
