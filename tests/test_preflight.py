"""A user's mistake gets one line, early: ``megatron_dgpo/preflight.py``'s checks of the model,
the layout and the data, run before torch.distributed and before any model, and every driver
command's one ``prog: error: ...`` line with exit status 2 (no traceback unless
``DGPO_DEBUG=1``). Each case below ended, on the code before these checks, in a traceback
after distributed init and the model build, after a rollout, or in silence (the table in
docs/training.md, "Mistakes caught at start-up")."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_dgpo import preflight
from megatron_dgpo.recipe import load_recipe
from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.runtime.parallel import ParallelConfig
from megatron_dgpo.training.policy import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny_cpu.yaml")
RELAUNCH = "-m megatron_dgpo.train recipes/tiny_cpu.yaml"


@pytest.fixture
def sharded_model(tiny_model_dir, tmp_path) -> Path:
    """The tiny model (4 heads, 2 KV groups, 2 layers, FFN 256) in two safetensors shards with
    their index, as a hub download of a large model is laid out."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    return folder


def _refused(path, message: str) -> None:
    with pytest.raises(InputError) as refused:
        preflight.model_config(ModelConfig(path=str(path)))
    assert message in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_intact_sharded_folder_passes_and_its_config_and_tokenizer_are_found(sharded_model):
    hf_config, folder = preflight.model_config(ModelConfig(path=str(sharded_model)))
    assert folder == sharded_model and hf_config["num_attention_heads"] == 4


def test_model_folder_faults_are_named_before_anything_starts(sharded_model, tmp_path):
    """A missing path said "Repo id must be in the form 'repo_name'" and a truncated shard was
    found by the loader after distributed init; each is one line naming what is wrong."""
    _refused(tmp_path / "absent" / "model", "is no folder here")
    _refused(tmp_path / "absent" / "model", "nor a hub id (org/name)")
    (tmp_path / "weights.bin").write_bytes(b"x")
    _refused(tmp_path / "weights.bin", "is a file; expected an HF model folder")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", "no config.json there")

    shard = sharded_model / "model-00002-of-00002.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-100])  # an interrupted copy
    _refused(sharded_model, f"{shard}: {len(whole) - 100} bytes where its header describes "
                            f"{len(whole)}: truncated")
    shard.write_bytes(whole + b"\0" * 8)
    _refused(sharded_model, "longer than its tensors")
    shard.write_bytes(b"\x05\0\0\0\0\0\0\0{oops")
    _refused(sharded_model, "not a safetensors file")
    shard.unlink()
    _refused(sharded_model, "1 of the 2 shards model.safetensors.index.json lists are missing: "
                            "model-00002-of-00002.safetensors")
    shard.write_bytes(whole)

    (sharded_model / "tokenizer.json").rename(sharded_model / "tokenizer.json.away")
    _refused(sharded_model, "no tokenizer (tokenizer.json, tokenizer.model, or vocab.json")
    (sharded_model / "tokenizer.json.away").rename(sharded_model / "tokenizer.json")

    config = json.loads((sharded_model / "config.json").read_text())
    (sharded_model / "config.json").write_text(json.dumps(
        {**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    _refused(sharded_model, "config.json: unsupported architecture: model_type='gpt2'")
    (sharded_model / "config.json").write_text('{\n  "model_type": "qwen2",\n  oops\n}')
    _refused(sharded_model, "config.json:3: invalid JSON")
    (sharded_model / "config.json").write_text(json.dumps(config))
    for shard in list(sharded_model.glob("*.safetensors")) + [sharded_model / preflight.INDEX_FILE]:
        shard.unlink()
    _refused(sharded_model, "no safetensors weights")


class _Hub(http.server.BaseHTTPRequestHandler):
    """A hub that knows no model: huggingface_hub maps this 404 to RepositoryNotFoundError."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    def log_message(self, *args):
        pass


def test_hub_ids_are_resolved_from_the_cache_or_asked_of_the_hub_by_rank_0(monkeypatch, tmp_path,
                                                                          sharded_model):
    """A typo in a hub id printed 117 lines of "check your internet connection" after
    distributed init; now: one line for a hub without that model, one for a hub out of reach,
    one for HF_HUB_OFFLINE=1 (naming the cached snapshot to use), nothing asked of the hub by
    the other ranks, and a cached snapshot checked like a folder."""
    from huggingface_hub import constants, hf_api

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(hf_api.api, "endpoint", f"http://127.0.0.1:{server.server_port}")
        _refused("deepseek-ai/DeepSeek-R1-Distil-Qwen-1.5B", "the hub has no model "
                                                           "deepseek-ai/DeepSeek-R1-Distil-Qwen-1.5B")
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setattr(hf_api.api, "endpoint", f"http://127.0.0.1:{server.server_port}")
    _refused("org/model", "not in this node's HF cache")
    _refused("org/model", "the hub cannot be reached")
    monkeypatch.setenv("RANK", "1")  # rank 0 alone asks; the others go on to the download
    assert preflight.model_config(ModelConfig(path="org/model")) == (None, None)
    monkeypatch.delenv("RANK")

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--model"
    shutil.copytree(sharded_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hf_config, folder = preflight.model_config(ModelConfig(path="org/model"))
    assert folder == repo / "snapshots" / commit and hf_config["num_hidden_layers"] == 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _refused("org/model", f"HF_HUB_OFFLINE=1 forbids fetching the hub id (docs/launching.md): set "
                          f"model.path to a folder every node sees: its cached snapshot is "
                          f"{repo / 'snapshots' / commit}")


TINY = dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("sizes, world, hf_config, message", [
    (dict(tensor_parallel=2), 1, None, "the trainer's ranks must be a multiple of tensor_parallel "
     "x context_parallel x pipeline_parallel = 2 x 1 x 1 = 2; this job has 1 rank. Start 2: "
     f"torchrun --nproc-per-node 2 {RELAUNCH}"),
    (dict(tensor_parallel=2, context_parallel=2), 6, None, "= 2 x 2 x 1 = 4; this job has 6 "
     f"ranks. Start 4: torchrun --nproc-per-node 4 {RELAUNCH}"),
    (dict(tensor_parallel=8), 20, None, f"Start 16: torchrun --nnodes 2 --nproc-per-node 8 {RELAUNCH}"),
    (dict(expert_parallel=2, expert_tensor_parallel=1), 3, None, "and expert_tensor_parallel x "
     "expert_parallel x pipeline_parallel = 1 x 2 x 1 = 2"),
    (dict(tensor_parallel=3), 3, TINY, "parallel.tensor_parallel=3 does not divide the 4 attention "
     "heads; parallel.tensor_parallel=3 neither divides the 2 KV groups (num_key_value_heads) nor "
     "is a multiple of them (Megatron-Core then gives each rank one group); "
     "parallel.tensor_parallel=3 does not divide the FFN width 256 (intermediate_size) (TP sizes "
     "up to 8 that split this model: 1, 2, 4"),
    (dict(tensor_parallel=8), 8, TINY, "parallel.tensor_parallel=8 does not divide the 4 attention heads"),
    (dict(pipeline_parallel=3), 3, TINY, "parallel.pipeline_parallel=3 does not divide the 2 layers"),
    (dict(pipeline_parallel=2, virtual_pipeline_parallel=2), 2, TINY, "parallel.pipeline_parallel=2 "
     "x virtual_pipeline_parallel=2 does not divide the 2 layers"),
    (dict(expert_parallel=3, expert_tensor_parallel=1), 3,
     dict(TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
          moe_intermediate_size=64), "parallel.expert_parallel=3 does not divide the 8 experts"),
])
def test_layouts_that_cannot_split_the_world_or_the_model_are_refused(sizes, world, hf_config,
                                                                     message):
    """Megatron asserted on these after distributed init (or a rank hung); a world the layout
    does not divide gets the torchrun command that fits."""
    with pytest.raises(InputError) as refused:
        preflight.check_layout(ParallelConfig(**sizes), world, hf_config, relaunch=RELAUNCH)
    assert message in str(refused.value)


def test_more_tp_ranks_than_kv_groups_pass_as_megatron_replicates_them():
    """4 TP ranks over 2 KV groups: Megatron-Core gives each rank one group (the tiny recipe at
    TP = 4 on 4 ranks trains, its log-probs the engine's within 2e-7)."""
    preflight.check_layout(ParallelConfig(tensor_parallel=4), 4, TINY, relaunch=RELAUNCH)


def test_dedicated_engines_must_leave_the_trainer_ranks_its_layout_needs():
    with pytest.raises(InputError, match=r"plus rollout.num_gpus=2 engine ranks; this job has 3 "
                                         r"ranks \(1 for the trainer\)\. Start 4"):
        preflight.check_layout(ParallelConfig(tensor_parallel=2), 3, None, rollout_ranks=2,
                               relaunch=RELAUNCH)
    preflight.check_layout(ParallelConfig(tensor_parallel=2), 4, TINY, rollout_ranks=2,
                           relaunch=RELAUNCH)


def _check_run(overrides, *, model=None, world_size=1):
    cfg = load_recipe(RECIPE, overrides)
    if model is not None:
        cfg.model.tiny, cfg.model.path = None, str(model)
    preflight.check_run(cfg, world_size=world_size, relaunch=RELAUNCH)


def test_data_faults_name_the_file_and_the_line(tmp_path):
    """A non-UTF-8 dataset named no file or line, after the model build; a bad JSON line, a
    missing field and a broken parquet file now each name where."""
    good = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
    data = tmp_path / "train.jsonl"
    data.write_bytes(b"".join([json.dumps(good).encode() + b"\n"] * 2
                              + [b'{"prompt": "caf\xe9", "reward_model": {"ground_truth": "1"}}\n']))
    with pytest.raises(InputError, match=r"train.jsonl:3: not UTF-8 text \(byte 0xe9"):
        _check_run([f"data.source={data}"])
    data.write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(InputError, match=r"train.jsonl:2: invalid JSON"):
        _check_run([f"data.source={data}"])
    data.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    with pytest.raises(InputError, match=r"train.jsonl row 0: missing field 'reward_model.ground_truth'"):
        _check_run([f"data.source={data}"])
    with pytest.raises(InputError, match=r"train.jsonl row 0: missing field 'question'"):
        _check_run([f"data.source={data}", "data.prompt_field=question"])
    (tmp_path / "train.json").write_text('[\n  {"prompt": "x",\n  oops]\n')
    with pytest.raises(InputError, match=r"train.json:3: invalid JSON"):
        _check_run([f"data.source={tmp_path / 'train.json'}"])
    (tmp_path / "train.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match=r"train.parquet: not a readable parquet file"):
        _check_run([f"data.source={tmp_path / 'train.parquet'}"])
    with pytest.raises(InputError, match=r"dataset file not found: .*absent.jsonl"):
        _check_run([f"data.source={tmp_path / 'absent.jsonl'}"])
    with pytest.raises(InputError, match=r"data.builtin_families: unknown built-in families \['calculus'\]"):
        _check_run(["data.builtin_families=[calculus]"])
    with pytest.raises(InputError, match=r"benchmark 'nope' is neither a dataset file"):
        _check_run(["eval.at_end=true", "eval.benchmarks=[nope]"])


def test_at_least_one_prompt_must_fit_and_the_check_needs_no_model_build(tiny_model_dir):
    """No prompt within rollout.max_prompt_tokens was found after the model build and the
    engine's start; with the model's tokenizer at hand it is found at start-up."""
    with pytest.raises(InputError, match=r"data.source 'builtin': none of its 10 prompts fits in "
                                         r"rollout.max_prompt_tokens=8 \(the shortest is \d+ "
                                         r"tokens with the chat template\)"):
        _check_run(["rollout.max_prompt_tokens=8"], model=tiny_model_dir)
    _check_run([], model=tiny_model_dir)
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_prompts_dropped_for_length_are_counted(tiny_model_dir):
    """``prompt_census`` (the trainer's start-up line and its ``data/prompts_dropped_for_length``)
    against the tokenizer's own chat-template tokenization of the 215 built-in prompts."""
    from transformers import AutoTokenizer

    from megatron_dgpo.tasks.prompts import DataConfig, builtin_prompts, prompt_census

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = sorted(len(tokenizer.apply_chat_template(list(r.messages), tokenize=True,
                                                       add_generation_prompt=True,
                                                       return_dict=True)["input_ids"])
                     for r in builtin_prompts())
    limit = lengths[len(lengths) // 2]
    kept = sum(length <= limit for length in lengths)
    assert 0 < kept < len(lengths) == 215
    assert prompt_census(DataConfig(), tiny_model_dir, limit) == (kept, 215)


def test_sft_pairs_are_checked_at_start(tmp_path):
    from megatron_dgpo.sft import load_sft_recipe

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    cfg = load_sft_recipe(str(ROOT / "recipes" / "sft_arithmetic.yaml"),
                          [f"sft.data={pairs}", "model.path=", "model.tiny={num_hidden_layers: 2}"])
    with pytest.raises(InputError, match=r"pairs.jsonl row 0: missing field 'response'"):
        preflight.check_sft(cfg, world_size=1, relaunch=RELAUNCH)


def test_every_command_reports_a_mistake_in_one_line_and_rank_0_alone(monkeypatch, tmp_path, capsys):
    """dgpo-train, dgpo-sft, dgpo-eval and python -m megatron_dgpo.arithmetic: exit 2 and one
    ``prog: error:`` line (dgpo-eval exited 1 with an unprefixed line; arithmetic and sft ended
    in tracebacks). Under torchrun a mistake every rank sees is said once, by rank 0."""
    from megatron_dgpo.evaluate import main as dgpo_eval
    from megatron_dgpo.sft import main as dgpo_sft
    from megatron_dgpo.tasks.arithmetic import main as arithmetic
    from megatron_dgpo.train import main as dgpo_train

    monkeypatch.delenv("RANK", raising=False)
    layout = [RECIPE, "parallel.tensor_parallel=2"]
    assert dgpo_train(layout) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgpo-train: error: parallel: the trainer's ranks must be a multiple")
    assert err.count("\n") == 1 and f"torchrun --nproc-per-node 2 -m megatron_dgpo.train " \
                                   f"{RECIPE} parallel.tensor_parallel=2" in err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dgpo_train(layout) == 2 and capsys.readouterr() == ("", "")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")

    assert dgpo_sft([str(ROOT / "recipes" / "sft_arithmetic.yaml"),
                     f"sft.data={tmp_path / 'absent.jsonl'}"]) == 2
    assert capsys.readouterr().err == f"dgpo-sft: error: dataset file not found: {tmp_path / 'absent.jsonl'}\n"
    assert arithmetic([str(tmp_path / "task"), "--digits", "0"]) == 2
    assert capsys.readouterr().err == ("python -m megatron_dgpo.arithmetic: error: digits must be "
                                       ">= 1, got 0\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert dgpo_eval(["--model", str(tmp_path / "model"), "--benchmarks", "nope"]) == 2
    assert capsys.readouterr().err.startswith("dgpo-eval: error: --model ")  # no weights there


def test_the_command_line_prints_one_line_in_seconds(tmp_path):
    """The whole process: exit 2, one line on stderr, no traceback, nothing in run_dir (the
    traceback with DGPO_DEBUG=1: tests/runtime/test_errors.py)."""
    command = [sys.executable, "-m", "megatron_dgpo.train", RECIPE, f"run_dir={tmp_path / 'run'}",
               "model.tiny=null", f"model.path={tmp_path / 'typo' / 'model'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    env.pop("DGPO_DEBUG", None)
    begin = time.perf_counter()
    quiet = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - begin
    assert quiet.returncode == 2, quiet.stderr
    assert quiet.stderr.splitlines() == [
        f"dgpo-train: error: model.path: {tmp_path / 'typo' / 'model'} is no folder here (working "
        f"directory {os.getcwd()}), nor a hub id (org/name)"], quiet.stderr
    assert not (tmp_path / "run").exists() and seconds < 120
