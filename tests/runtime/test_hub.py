"""A hub snapshot on each node's own disk (``megatron_dgpo.runtime.hub``), and the dedicated
engines that start from it: an engine on a node whose HF cache lacks the trainer's folder
fetches the same commit into its own. The hub is stood in (no network here:
``tests._rank_fns_trainer.StandInHub`` replaces only the fetch; the cache look-up is
huggingface_hub's), and so is the replica's link (a list of commands)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from megatron_dgpo.runtime.hub import HubSnapshot, on_this_node, snapshot_of
from tests._rank_fns_trainer import HUB_REPO, StandInHub, stand_in_commit


@pytest.fixture
def node_caches(tmp_path, monkeypatch):
    """Two nodes' HF caches; this process is node A until a test switches it to B."""
    from huggingface_hub import constants

    caches = {node: tmp_path / f"node_{node}" / "hub" for node in "AB"}
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(caches["A"]))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return caches


def _become_node_b(caches, monkeypatch):
    """This process turns into node B: its own HF cache, and node A's disk out of sight."""
    from huggingface_hub import constants

    caches["A"].parent.rename(caches["A"].parent.with_name("node_A_out_of_sight"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(caches["B"]))


def test_a_cache_folder_names_its_repo_and_commit():
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert snapshot_of(f"/c/models--Qwen--Qwen3-8B/snapshots/{commit}") == HubSnapshot("Qwen/Qwen3-8B", commit)
    assert snapshot_of(f"/c/models--gpt2/snapshots/{commit}") == HubSnapshot("gpt2", commit)
    for other in ("/data/Qwen3-8B", f"/c/models--Qwen--Qwen3-8B/refs/{commit}",
                  "/c/models--Qwen--Qwen3-8B/snapshots/main", f"/c/datasets--a--b/snapshots/{commit}"):
        assert snapshot_of(other) is None, other


def test_a_snapshot_another_node_named_is_fetched_into_this_nodes_cache(node_caches, tmp_path,
                                                                        tiny_model_dir, monkeypatch):
    from huggingface_hub import constants

    hub = StandInHub(tmp_path / "hub", tiny_model_dir)
    on_a = Path(hub(HUB_REPO, allow_patterns=["*"]))  # the trainer's node fetched main
    snapshot = snapshot_of(on_a)
    assert snapshot == HubSnapshot(HUB_REPO, stand_in_commit(HUB_REPO, 0))
    assert on_this_node(on_a, snapshot, download=hub) == on_a  # node A sees it: used as it is
    _become_node_b(node_caches, monkeypatch)
    hub(HUB_REPO, allow_patterns=["*"])  # the repo moved on meanwhile: main is another commit
    on_b = on_this_node(on_a, snapshot, download=hub)
    assert on_b.is_relative_to(node_caches["B"]) and on_b.name == snapshot.revision
    assert json.loads((on_b / "config.json").read_text())["stand_in_commit"] == snapshot.revision
    with pytest.raises(FileNotFoundError, match=f"node .* could not fetch {HUB_REPO} at revision "
                                                f"{snapshot.revision}.*ConnectionError"):
        on_this_node(tmp_path / "elsewhere" / snapshot.revision, snapshot,
                     download=StandInHub(tmp_path / "hub", tiny_model_dir, unreachable=True))
    with pytest.raises(FileNotFoundError, match="sees no .*absent/config.json.*every node sees"):
        on_this_node(tmp_path / "absent", None)


def test_a_dedicated_engine_starts_from_its_own_nodes_snapshot(node_caches, tmp_path,
                                                               tiny_model_dir, monkeypatch):
    """The trainer's start command names its folder and snapshot (``DedicatedRollout``); an
    engine rank on a node without that folder starts from the same commit in its own cache."""
    from huggingface_hub import constants

    from megatron_dgpo.rollout.config import RolloutConfig
    from megatron_dgpo.rollout.dedicated import server

    hub = StandInHub(tmp_path / "hub", tiny_model_dir)
    trainer_folder = hub(HUB_REPO, allow_patterns=["*"])
    _become_node_b(node_caches, monkeypatch)
    monkeypatch.setattr(server, "on_this_node", partial(on_this_node, download=hub))

    class Link:  # the replica's link, as the engine rank receives its commands
        commands = [{"kind": "start", "hf_dir": str(trainer_folder),
                     "snapshot": snapshot_of(trainer_folder)}, {"kind": "stop"}]
        sent = []

        def broadcast_object(self, obj):
            return self.commands.pop(0)

        def send_object(self, obj, dst):
            self.sent.append(obj)

    started = []
    monkeypatch.setattr(server._EngineServer, "_start", lambda self, folder: started.append(folder))
    engine = server._EngineServer(rollout=RolloutConfig(), data=None, seed=0, layout=None, link=Link(),
                                  group=None, leader=True, engine_index=0)
    engine.run()
    (folder,) = started
    assert folder.is_relative_to(node_caches["B"]) and folder.name == snapshot_of(trainer_folder).revision
    assert Link.sent == ["stopped"]
