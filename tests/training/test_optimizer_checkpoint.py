"""Megatron's optimizer on CPU (TP=2) against AdamW in float64, non-finite step skipping, and
the atomic distributed checkpoint of model + optimizer. The optimizer's launch also resolves a
hub id on two "nodes" with separate HF caches (``policy.initial_model``): one launch, not two."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests import _rank_fns_trainer as fns
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def optimizer_results(tmp_path_factory, tiny_model_dir):
    return run_ranks(fns.optimizer_and_skipping, 2, str(tmp_path_factory.mktemp("hub_nodes")),
                     str(tiny_model_dir))


def test_megatron_optimizer_on_cpu_is_adamw_with_global_clip(optimizer_results):
    for result in optimizer_results:
        assert max(result["norm_errors"]) < 1e-6  # the TP-aware global grad norm
        assert result["clipped"]  # the clip was active, so the coefficient was checked too
        assert max(result["errors"]) < 1e-6


def test_non_finite_updates_are_skipped_on_every_rank(optimizer_results):
    for result in optimizer_results:
        assert result["inf_step"] is False and result["inf_unchanged"]
        assert result["moments_unchanged"]
        assert result["nan_loss"] != result["nan_loss"]  # NaN
        assert result["nan_step"] is False and result["nan_unchanged"]
        assert result["clean_step"] is True


def test_offloaded_training_state_frees_its_memory_and_round_trips_bit_for_bit(optimizer_results):
    for result in optimizer_results:
        offload = result["offload"]
        # fp32 weights: the param groups' tensors are the model's and stay; the Adam state of
        # every parameter (two moments and the step count) is the optimizer's own
        assert offload["storages"] == offload["state_tensors"] > 0
        assert offload["freed"] and offload["weights_kept"]
        assert offload["resident_inside"] and offload["offloaded_after"]
        assert offload["state_equal"] and offload["grads_zero"] and offload["host_reused"]
        assert offload["next_equal"]


def test_a_hub_id_resolves_on_each_nodes_own_cache_at_one_revision(optimizer_results):
    """Two ranks, each its own node (``LOCAL_RANK`` 0, its own HF cache), a hub stood in by
    ``StandInHub`` whose repo moves after rank 0's fetch: each rank's folder lies in its own
    node's cache, holds the model, and both are rank 0's commit, not the moved one."""
    from pathlib import Path

    got = [result["hub_model"] for result in optimizer_results]
    for node in got:
        folder = Path(node["folder"])
        assert folder.is_relative_to(node["cache"]), (folder, node["cache"])
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(node["files"])
    first = fns.stand_in_commit(fns.HUB_REPO, 0)  # main before it moved
    assert [node["commit"] for node in got] == [first, first]
    assert [Path(node["folder"]).name for node in got] == [first, first]


def test_a_node_that_cannot_download_stops_every_rank_naming_itself(optimizer_results):
    """Rank 1's node cannot reach the hub: both ranks raise one error that names rank 1, the
    repo id and the revision rank 0 fixed (the second fetch of main: its second commit)."""
    commit = fns.stand_in_commit(fns.HUB_REPO, 1)
    errors = [result["hub_model"].get("unreachable_error") for result in optimizer_results]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "(rank 1, LOCAL_RANK 0) could not download" in errors[0]
    assert f"{fns.HUB_REPO} at revision {commit}" in errors[0]
    assert "ConnectionError" in errors[0] and "(rank 0," not in errors[0]


def test_offload_keeps_storages_the_model_shares():
    """Main weights distinct from the model's (bf16 training) are offloaded; a param-group
    tensor that is a view of a model parameter (fp32 weights, distributed-optimizer shards)
    is not. Through Megatron's wrapper shapes: ``chained_optimizers`` and ``.optimizer``."""
    from types import SimpleNamespace

    import torch

    from megatron_dgpo.training.offload import optimizer_storages

    model = torch.nn.Linear(4, 3)
    main = [p.detach().float().clone() for p in model.parameters()]
    shard_view = model.weight.detach().view(-1)[2:6]  # shares the weight's storage
    inner = torch.optim.Adam([{"params": main}, {"params": [shard_view]}])
    for p in main:
        p.grad = torch.ones_like(p)
    inner.step()
    wrapped = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])
    found = {s.data_ptr() for s in optimizer_storages(wrapped, [model])}
    want = {t.untyped_storage().data_ptr() for t in main}
    want |= {v.untyped_storage().data_ptr() for p in main for v in inner.state[p].values() if v.dim()}
    assert want <= found
    assert model.weight.untyped_storage().data_ptr() not in found


LAYOUT = {"tensor_parallel": 2, "pipeline_parallel": 1, "context_parallel": 1, "data_parallel": 1,
          "expert_parallel": 1}


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """The 2-rank save / load round trip (``fns.checkpoint_round_trip``): its results and the
    folder of its checkpoints (``step_000002`` published, ``.incomplete-step_000003`` torn)."""
    root = tmp_path_factory.mktemp("round_trip")
    return run_ranks(fns.checkpoint_round_trip, 2, str(root)), root


def test_checkpoint_round_trip_resumes_exactly(round_trip):
    results, tmp_path = round_trip
    for result in results:
        assert result["differs_before"] and result["loaded_equal"] and result["next_equal"]
        assert (result["step"], result["consumed"]) == (2, 64)
        assert result["rng_restored"]
        assert result["extra"] == {"layout": LAYOUT, "note": "kept"}
        # async save: until Megatron's write has finished and the finalize step ran, the
        # checkpoint is only a staging folder (no shard written yet) and `latest` is the old one
        staged = result["async"]
        assert staged["pending"] == 1 and staged["after_wait"] == 0
        assert staged["closed_with_pending"] == 0  # close publishes first, then stops the writer
        assert staged["latest"] == "step_000001"
        assert staged["listing"] == [".incomplete-step_000002", "latest", "step_000001"]
        assert not any(f.endswith(".distcp") for f in staged["staged_files"])
        # A second Ctrl-C while Megatron's writer writes step 3: KeyboardInterrupt, not
        # published (the first one was only a request: megatron_dgpo.runtime.interrupt)
        ctrl_c = result["ctrl_c"]
        assert ctrl_c["requested"] and ctrl_c["delivered"] and ctrl_c["interrupted"]
        assert ctrl_c["latest"] == "step_000002"
        assert ctrl_c["listing"] == [".incomplete-step_000003", "latest", "step_000002"]
        # never published: a step not finite on one rank, a save that does not read back
        unpublished = result["unpublished"]
        assert unpublished["non_finite"] == ("step 5: rank 1: parameter embedding.word_embeddings"
                                             ".weight is not finite: not saved, the last "
                                             "checkpoint stays the one to resume from")
        assert re.search(r"\.incomplete-step_000006 does not read back as written: __1_0.distcp "
                         r"does not match its checksum \(crc32 .*\); not published, latest stays "
                         r"the previous checkpoint", unpublished["unverified"]), unpublished
        assert unpublished["latest"] == "step_000002"
        assert unpublished["listing"] == [".incomplete-step_000003", ".incomplete-step_000006",
                                          "latest", "step_000002"]
    # the layout recorded is the one saved at (TP=2), not the stale one in the state passed in
    import json

    record = json.loads((tmp_path / "step_000002" / "trainer_state.json").read_text())
    assert record["extra"] == {"layout": LAYOUT, "note": "kept"}
    assert (tmp_path / "latest").read_text().strip() == "step_000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".incomplete-step_000003", ".incomplete-step_000006", "latest", "step_000002"]
    # A training checkpoint is also a converter checkpoint: it exports to HF, outside the run's
    # checkpoints (a conversion never writes into them).
    from transformers import AutoModelForCausalLM

    from megatron_dgpo.convert import hf_to_megatron, megatron_to_hf
    from megatron_dgpo.runtime.errors import InputError

    exported = tmp_path.with_name(tmp_path.name + "_hf")
    megatron_to_hf(str(tmp_path / "step_000002"), str(exported))
    assert AutoModelForCausalLM.from_pretrained(exported).config.vocab_size == 300
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(InputError, match="is inside a training run's checkpoints"):
        megatron_to_hf(str(tmp_path / "step_000002"), str(tmp_path / "hf"))
    with pytest.raises(InputError, match="is inside a training run's checkpoints"):
        hf_to_megatron(str(exported), str(tmp_path / "step_000002"), overwrite=True)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_resume_modes(round_trip, tmp_path):
    """checkpoint.resume: auto continues when there is a checkpoint and starts fresh otherwise;
    require needs one; never refuses to start over a run that has one (each an InputError)."""
    from megatron_dgpo.runtime.errors import InputError
    from megatron_dgpo.training.checkpoint import checkpoint_to_resume

    root = tmp_path / "checkpoints"
    assert checkpoint_to_resume(root, "auto") is None and checkpoint_to_resume(root, "never") is None
    with pytest.raises(InputError, match="checkpoint.resume=require: no complete checkpoint"):
        checkpoint_to_resume(root, "require")
    root.mkdir()
    shutil.copytree(round_trip[1] / "step_000002", root / "step_000004")
    (root / "latest").write_text("step_000004\n")
    assert checkpoint_to_resume(root, "auto").name == checkpoint_to_resume(root, "require").name == "step_000004"
    with pytest.raises(InputError, match="checkpoint.resume=never: .* already holds step_000004"):
        checkpoint_to_resume(root, "never")
    with pytest.raises(ValueError, match="checkpoint.resume must be one of"):
        checkpoint_to_resume(root, "sometimes")


def _overwrite_middle(path: Path) -> None:
    """4 KiB of 0xff in the middle of ``path``, its size unchanged (issue 45's corruption)."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(b"\xff" * min(4096, size - size // 2))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_json(path: Path) -> None:
    path.write_text(path.read_text().replace('"step": 2', '"step": 7'))


FAULTS = {  # name -> (what is done to the newest checkpoint, what the one line must name)
    "shard overwritten": (lambda c: _overwrite_middle(c / "__0_0.distcp"),
                          r"__0_0.distcp does not match its checksum \(crc32"),
    "shard truncated": (lambda c: _truncate(c / "__1_0.distcp"),
                        r"__1_0.distcp does not match its checksum \(size"),
    "shard deleted": (lambda c: (c / "__1_0.distcp").unlink(), r"lacks __1_0.distcp"),
    "shard and its manifest deleted": (
        lambda c: [(c / "__1_0.distcp").unlink(), (c / "checksums/rank00001-shards.json").unlink()],
        r"lacks __1_0.distcp \(named by .metadata\)"),
    "torch metadata deleted": (lambda c: (c / ".metadata").unlink(), r"lacks .metadata"),
    "torch metadata overwritten": (lambda c: _overwrite_middle(c / ".metadata"),
                                   r"\.metadata does not match its checksum"),
    "megatron metadata deleted": (lambda c: (c / "metadata.json").unlink(), r"lacks metadata.json"),
    "trainer state edited": (lambda c: _flip_json(c / "trainer_state.json"),
                             r"trainer_state.json does not match its checksum"),
    "trainer state deleted": (lambda c: (c / "trainer_state.json").unlink(),
                              r"lacks trainer_state.json"),
    "converter metadata overwritten": (lambda c: _overwrite_middle(c / "dgpo_convert.json"),
                                       r"dgpo_convert.json does not match its checksum"),
    "extra file overwritten": (lambda c: (c / "extra/rank1.txt").write_text("later"),
                               r"extra/rank1.txt does not match its checksum"),
    "checksums deleted": (lambda c: shutil.rmtree(c / "checksums"),
                          r"lacks checksums/common.json"),
    "shard manifest deleted": (lambda c: (c / "checksums/rank00000-shards.json").unlink(),
                               r"holds __0_0.distcp, which no checksum manifest lists"),
    "manifest garbled": (lambda c: (c / "checksums/common.json").write_text("{"),
                         r"checksums/common.json is unreadable"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_checkpoint_is_named_and_the_run_falls_back(round_trip, tmp_path, capfd, fault):
    """Each damage to the newest of two real checkpoints (the 2-rank round trip's, with its
    checksums recorded as written): the resume names it in one line, moves it aside and
    continues from the older one, which it names too; ``latest`` then names the older one."""
    from megatron_dgpo.training.checkpoint import checkpoint_to_resume

    damage, named = FAULTS[fault]
    root = tmp_path / "checkpoints"
    root.mkdir()
    for step in ("step_000001", "step_000002"):
        shutil.copytree(round_trip[1] / "step_000002", root / step)
    (root / "latest").write_text("step_000002\n")
    damage(root / "step_000002")
    assert checkpoint_to_resume(root, "auto") == root / "step_000001"
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert re.search(rf"checkpoint {root}/step_000002 fails verification: .*{named}", err[0]), err
    assert "falling back to step_000001, the newest checkpoint that verifies" in err[1]
    assert (root / ".corrupt-step_000002").is_dir() and not (root / "step_000002").exists()
    assert (root / "latest").read_text() == "step_000001\n"


def test_a_file_added_later_is_not_a_damage(round_trip, tmp_path):
    """A file put into a checkpoint after it was saved (notes, a plot) is not read by a resume:
    the checkpoint still verifies."""
    from megatron_dgpo.training.checkpoint import checkpoint_to_resume

    root = tmp_path / "checkpoints"
    root.mkdir()
    shutil.copytree(round_trip[1] / "step_000002", root / "step_000002")
    (root / "step_000002" / "notes.txt").write_text("lr looked high")
    assert checkpoint_to_resume(root, "auto") == root / "step_000002"


def test_every_checkpoint_damaged_is_refused_unless_verification_is_off(round_trip, tmp_path):
    from megatron_dgpo.runtime.errors import InputError
    from megatron_dgpo.training.checkpoint import checkpoint_to_resume

    root = tmp_path / "checkpoints"
    root.mkdir()
    shutil.copytree(round_trip[1] / "step_000002", root / "step_000002")
    _overwrite_middle(root / "step_000002" / "__0_0.distcp")
    assert checkpoint_to_resume(root, "auto", verify=False) == root / "step_000002"
    with pytest.raises(InputError, match=r"no checkpoint under .* verifies \(step_000002: "
                                         r"__0_0.distcp does not match its checksum"):
        checkpoint_to_resume(root, "auto")


def test_checksums_are_recorded_by_each_ranks_writer(round_trip):
    """Each rank's writer recorded its own shard file (size and CRC taken as it wrote); rank 0
    recorded every other file, those ``write_extra`` added on each rank in a subfolder
    included; together they verify."""
    import json
    import zlib

    from megatron_dgpo.training.integrity import verify

    checkpoint = round_trip[1] / "step_000002"
    for rank in (0, 1):
        files = json.loads((checkpoint / f"checksums/rank{rank:05d}-shards.json").read_text())["files"]
        data = (checkpoint / f"__{rank}_0.distcp").read_bytes()
        assert files == {f"__{rank}_0.distcp": [len(data), zlib.crc32(data)]}
    common = json.loads((checkpoint / "checksums/common.json").read_text())["files"]
    assert {"trainer_state.json", ".metadata", "metadata.json", "dgpo_convert.json",
            "extra/rank0.txt", "extra/rank1.txt"} <= set(common)
    assert verify(checkpoint) == [] and verify(checkpoint, 1, 2) == []


MOMENTS = {"writing": "step_000001", "publishing": "step_000001", "published": "step_000002"}


def test_a_trainer_killed_during_an_async_save_leaves_no_process_and_a_checkpoint(tmp_path):
    """SIGKILL to the trainer process alone (its children get no signal: the OOM killer, or
    torchrun killing a rank) at three moments of an async save (``tests/_killed_during_async_save.py``,
    the three at once): 10 s later none of its processes lives (the checkpoint writer, its
    result queue's manager, the resource tracker), and the newest
    checkpoint is the one published last, and verifies."""
    import json
    import subprocess
    import sys
    import time

    import psutil

    from megatron_dgpo.training.checkpoint import checkpoint_to_resume

    root = Path(__file__).resolve().parents[2]
    jobs = {moment: subprocess.Popen(
        [sys.executable, "tests/_killed_during_async_save.py", moment, str(tmp_path / moment)],
        cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for moment in MOMENTS}
    def alive(pids):
        return [pid for pid in pids if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]

    for moment, job in jobs.items():
        _, err = job.communicate(timeout=300)
        assert job.returncode == -9, f"{moment}: exit {job.returncode}\n{err[-3000:]}"
        killed_at = time.monotonic()
        children = json.loads((tmp_path / moment / "children.json").read_text())
        assert len(children) >= 3, (moment, children)  # writer, manager, resource tracker
        while alive(children) and time.monotonic() < killed_at + 10:
            time.sleep(0.2)
        left = alive(children)
        for pid in left:  # not to leave them to the next test
            psutil.Process(pid).kill()
        assert not left, moment
        assert checkpoint_to_resume(tmp_path / moment / "checkpoints", "auto").name == MOMENTS[moment]


def test_an_async_save_keeps_the_state_it_was_given_while_training_goes_on(tmp_path):
    """Megatron's persistent writer stages the tensors with ``tensor.to("cpu")``: on CPU the
    live tensors, which the next update changed under it (a torn step; its checksum then did
    not match). ``cpu.py`` stages copies: the published step holds the parameters it was saved
    with although every one changed in place right after (``_killed_during_async_save.py``)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "tests/_killed_during_async_save.py", "changed",
                           str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "changed.json").read_text()) == {"kept": True}


def test_a_resume_lists_recipe_changes_and_refuses_those_that_change_the_run(tmp_path, capfd):
    """Against the recipe a checkpoint was saved with: a change of method, loss, seed, data,
    group size or batch size is refused (InputError naming each) unless allowed; any accepted
    change is printed in one line and kept in checkpoints/config_changes.jsonl."""
    import json

    from megatron_dgpo.recipe import load_recipe
    from megatron_dgpo.runtime.config import to_dict
    from megatron_dgpo.runtime.errors import InputError
    from megatron_dgpo.training.checkpoint import resume_config_changes

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
    checkpoint = tmp_path / "checkpoints" / "step_000004"
    checkpoint.mkdir(parents=True)
    saved = to_dict(load_recipe(recipe))
    assert resume_config_changes(checkpoint, saved, saved, allowed=False, record=True) == {}
    for override, key in (("algorithm.method=grpo", "algorithm.method"),
                          ("algorithm.loss.eps_low=0.3", "algorithm.loss.eps_low"),
                          ("train.seed=7", "train.seed"), ("rollout.group_size=4", "rollout.group_size"),
                          ("train.rollout_batch_prompts=16", "train.rollout_batch_prompts"),
                          ("data.builtin_families=[add]", "data.builtin_families")):
        current = to_dict(load_recipe(recipe, [override, "train.steps=60"]))
        with pytest.raises(InputError, match=rf"resuming {checkpoint} would change what the run "
                                             rf"means \({re.escape(key)}: .* -> .*\): use another "
                                             rf"run_dir, or set checkpoint.allow_config_change=true"):
            resume_config_changes(checkpoint, saved, current, allowed=False, record=True)
    assert not (checkpoint.parent / "config_changes.jsonl").exists()
    capfd.readouterr()
    current = to_dict(load_recipe(recipe, ["train.seed=7", "train.steps=60"]))
    assert resume_config_changes(checkpoint, saved, current, allowed=True, record=True) == {
        "train.seed": (42, 7), "train.steps": (50, 60)}
    assert capfd.readouterr().err == ("[megatron-dgpo] the recipe differs from the one step_000004 "
                                      "was saved with: train.seed: 42 -> 7, train.steps: 50 -> 60\n")
    kept = json.loads((checkpoint.parent / "config_changes.jsonl").read_text())
    assert kept["resumed_from"] == "step_000004"
    assert kept["changes"] == {"train.seed": [42, 7], "train.steps": [50, 60]}


@pytest.mark.parametrize("override, message", [
    ("checkpoint.keep_last=0", "keep_last must be >= 1"),
    ("checkpoint.save_every=-1", "save_every must be >= 0")])
def test_checkpoint_config_bounds(override, message):
    from megatron_dgpo.recipe import load_recipe
    from megatron_dgpo.runtime.errors import InputError

    with pytest.raises(InputError, match=message):
        load_recipe(None, ["model.tiny={num_hidden_layers: 1}", override])
