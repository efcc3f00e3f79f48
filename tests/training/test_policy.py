"""Where the initial policy comes from (``policy.initial_model``) in one process. The two-node
case (each node its own HF cache) runs in tests/training/test_optimizer_checkpoint.py's launch,
with the same hub stand-in (``tests._rank_fns_trainer.StandInHub``: only the network fetch is
stood in, the cache look-up is huggingface_hub's)."""

from __future__ import annotations

import json

import pytest

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
