"""Where the initial policy comes from (``policy.initial_model``) in one process. The two-node
case (each node its own HF cache) runs in tests/training/test_optimizer_checkpoint.py's launch,
with the same hub stand-in (``tests._rank_fns_trainer.StandInHub``: only the network fetch is
stood in, the cache look-up is huggingface_hub's)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dgpo.training.policy import ModelConfig, initial_model
from tests._rank_fns_trainer import HUB_REPO, StandInHub, stand_in_commit


@pytest.fixture
def node_cache(tmp_path, monkeypatch):
    """This process's HF cache in ``tmp_path``, as its ``HF_HOME`` gives huggingface_hub at
    import; no ``LOCAL_RANK`` (not started by torchrun)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "cache"


def test_a_hub_id_in_one_process_is_the_snapshot_of_the_commit_it_fetched(node_cache, tmp_path,
                                                                           tiny_model_dir):
    folder = initial_model(ModelConfig(path=HUB_REPO), tmp_path / "run", 0,
                           download=StandInHub(tmp_path / "hub", tiny_model_dir))
    commit = stand_in_commit(HUB_REPO, 0)
    assert folder == node_cache / "models--stand-in--tiny-qwen2" / "snapshots" / commit
    assert json.loads((folder / "config.json").read_text())["stand_in_commit"] == commit
    assert (folder / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


def test_a_hub_id_is_refused_offline_and_a_download_must_be_a_commit_snapshot(node_cache, tmp_path,
                                                                             monkeypatch):
    def no_call(*args, **kwargs):
        raise AssertionError("downloaded although HF_HUB_OFFLINE=1")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=f"model.path: {HUB_REPO} is not a folder and "
                                                "HF_HUB_OFFLINE=1"):
        initial_model(ModelConfig(path=HUB_REPO), tmp_path / "run", 0, download=no_call)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ValueError, match="not a snapshot folder named by its commit"):
        initial_model(ModelConfig(path=HUB_REPO), tmp_path / "run", 0,
                      download=lambda *args, **kwargs: str(tmp_path / "a_local_dir"))


def test_a_megatron_bridge_checkpoint_is_converted_once_into_the_initial_hf_folder(tmp_path):
    """model.path = a checkpoint folder Megatron-Bridge wrote (tests/convert/fixtures/bridge):
    the run's initial policy is its HF conversion in <run_dir>/initial_model, made once: the
    HF original's weights, a tokenizer that tokenizes as the original's. A partial folder is
    refused naming what is missing, a provider field that changes the model by name (the
    same ``InputError`` dgpo-convert reports), both before any weight is read. The run stops
    where a run from the HF original does: its generation config comes along."""
    import shutil
    from pathlib import Path

    import yaml

    from megatron_dgpo.runtime.errors import InputError

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    fixture = Path(__file__).parents[1] / "convert" / "fixtures" / "bridge" / "qwen2_tied"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    folder = initial_model(ModelConfig(path=str(fixture / "bridge")), run_dir, 0)
    assert folder == run_dir / "initial_model"
    got, want = (load_file(str(d / "model.safetensors")) for d in (folder, fixture / "hf"))
    assert sorted(got) == sorted(want)
    # exact: a lossless conversion of the same values
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    text = "<|im_start|>user\nRepeat the digit 3. Put it in \\boxed{}.<|im_end|>\n"
    assert (AutoTokenizer.from_pretrained(folder).encode(text)
            == AutoTokenizer.from_pretrained(fixture / "hf").encode(text))
    assert ((folder / "generation_config.json").read_bytes()
            == (fixture / "hf" / "generation_config.json").read_bytes())
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert initial_model(ModelConfig(path=str(fixture / "bridge")), run_dir, 0) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # kept, not redone
    partial = tmp_path / "partial"
    shutil.copytree(fixture / "bridge", partial)
    (partial / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(InputError, match="latest_checkpointed_iteration.txt"):
        initial_model(ModelConfig(path=str(partial)), tmp_path / "run2", 0)
    changed = tmp_path / "changed"
    shutil.copytree(fixture / "bridge", changed)
    run_config = changed / "iter_0000000" / "run_config.yaml"
    config = yaml.safe_load(run_config.read_text())
    config["model"]["no_rope_freq"] = 2
    run_config.write_text(yaml.safe_dump(config))
    with pytest.raises(InputError, match=r"model\.no_rope_freq=2 is not supported"):
        initial_model(ModelConfig(path=str(changed)), tmp_path / "run3", 0)
    assert not (tmp_path / "run3" / "initial_model").exists()
