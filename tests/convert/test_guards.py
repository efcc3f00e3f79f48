"""The converters' checks before any work, and their output whole or not at all: a non-empty
output folder, a training run's checkpoints, the input itself, a layout the model cannot take,
a failure mid-way; and every user mistake as one line with exit status 2 from `dgpo-convert`.
One process, tiny models (tests/convert/fixtures/bridge), no launch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_dgpo.convert import hf_to_megatron, megatron_to_hf, single_process_group
from megatron_dgpo.convert import guards
from megatron_dgpo.convert.hf_source import HFSource
from megatron_dgpo.convert.safetensors_io import LazyHFReader, iter_hf_tensors
from megatron_dgpo.runtime.errors import InputError

FIXTURES = Path(__file__).parent / "fixtures" / "bridge"
QWEN3 = FIXTURES / "qwen3"
MOE_HF = FIXTURES / "qwen3_moe" / "hf"


def _files(folder: Path) -> dict:
    """Every file under ``folder``, relative path -> bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


def test_a_non_empty_output_needs_overwrite_which_replaces_it_whole(tmp_path):
    """A non-empty output folder is refused without ``overwrite`` and left alone; with it, the
    folder is replaced whole: megatron-to-hf into a sharded HF folder of another model leaves
    no index or shard of it (the reader would otherwise load the old weights)."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for convert in (lambda: megatron_to_hf(str(QWEN3 / "bridge"), str(out)),
                    lambda: hf_to_megatron(str(QWEN3 / "hf"), str(out))):
        with pytest.raises(InputError, match=r"hf is not empty: pass --overwrite to replace it"):
            convert()
        assert _files(out) == {"notes.txt": b"mine"}
    # another model's sharded folder: index + shards
    megatron_to_hf(str(FIXTURES / "qwen3_moe" / "bridge"), str(out), max_shard_bytes=20_000,
                   overwrite=True)
    assert (out / "model.safetensors.index.json").is_file() and "notes.txt" not in _files(out)
    megatron_to_hf(str(QWEN3 / "bridge"), str(out), overwrite=True)
    assert sorted(_files(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    want = dict(iter_hf_tensors(str(QWEN3 / "hf")))
    assert sorted(LazyHFReader(str(out)).names()) == sorted(want)
    got = dict(iter_hf_tensors(str(out)))
    assert all(torch.equal(got[k], want[k]) for k in want)  # exact: a lossless export
    assert _siblings(out) == []  # no staging or replaced folder left beside it
    # hf-to-megatron replaces a folder of stale shards whole as well
    (out / "__1_0.distcp").write_bytes(b"stale")
    hf_to_megatron(str(QWEN3 / "hf"), str(out), overwrite=True)
    assert "__1_0.distcp" not in _files(out) and "model.safetensors" not in _files(out)
    assert (out / "dgpo_convert.json").is_file() and _siblings(out) == []


def test_a_training_runs_checkpoints_and_the_input_are_never_written(tmp_path):
    """A run's checkpoints are recognised by the training checkpoint's markers, whatever the
    folders are called: nothing is written into a checkpoint, beside the steps, or over the
    run folder, ``overwrite`` or not; a folder merely named ``checkpoints`` is an ordinary
    one, and so is a folder a checkpoint was copied into. The output cannot be the input
    either."""
    from megatron_dgpo.training import checkpoint as training

    assert (guards.RUN_STATE_FILE, guards.RUN_LATEST_FILE, guards.RUN_INCOMPLETE_PREFIX) == (
        training.STATE_FILE, training.LATEST_FILE, training.INCOMPLETE_PREFIX)
    run = tmp_path / "run"
    root = run / "saves"  # not named checkpoints: recognised by what it holds
    step = root / training.checkpoint_name(2)
    hf_to_megatron(str(QWEN3 / "hf"), str(step))
    (step / training.STATE_FILE).write_text('{"step": 2}')
    (root / training.LATEST_FILE).write_text(step.name + "\n")
    before = _files(run)
    refusals = ((lambda: megatron_to_hf(str(step), str(root / "hf")), "is inside"),
                (lambda: hf_to_megatron(str(QWEN3 / "hf"), str(step), overwrite=True),
                 "is inside"),
                (lambda: megatron_to_hf(str(step), str(run), overwrite=True), "holds"),
                (lambda: megatron_to_hf(str(step), str(tmp_path), overwrite=True), "holds"))
    for convert, where in refusals:
        with pytest.raises(InputError, match=rf"{where} a training run's checkpoints \(.*saves"
                                             rf".*never writes there, --overwrite or not"):
            convert()
    assert _files(run) == before
    # a first save still in flight marks the folder too
    early = tmp_path / "early"
    (early / f"{training.INCOMPLETE_PREFIX}{training.checkpoint_name(4)}").mkdir(parents=True)
    with pytest.raises(InputError, match="training run's checkpoints"):
        megatron_to_hf(str(QWEN3 / "bridge"), str(early / "hf"))
    with pytest.raises(InputError, match="is the input"):
        megatron_to_hf(str(QWEN3 / "bridge"), str(QWEN3 / "bridge"), overwrite=True)
    plain = tmp_path / "checkpoints" / "hf"  # just a name
    megatron_to_hf(str(QWEN3 / "bridge"), str(plain))
    assert (plain / "model.safetensors").is_file()
    home = tmp_path / "home"  # a checkpoint copied out of its run: exported beside it
    shutil.copytree(step, home / step.name)
    megatron_to_hf(str(home / step.name), str(home / "hf"))
    assert (home / "hf" / "model.safetensors").is_file()


def test_a_failed_conversion_leaves_the_output_as_it_was(tmp_path, monkeypatch):
    """A shard truncated on disk (found when its bytes are read) or a read failing mid-way: the
    error names the tensor, and the output folder is what it was, with no temporary file in it
    or beside it."""
    from megatron_dgpo.convert import hf_source

    damaged = tmp_path / "damaged"
    hf_to_megatron(str(QWEN3 / "hf"), str(damaged))
    shard = next(damaged.glob("*.distcp"))
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the previous export")
    with pytest.raises(InputError, match=r"tensor '.*' could not be read .*damaged or incomplete"):
        megatron_to_hf(str(damaged), str(out), overwrite=True)
    assert _files(out) == {"model.safetensors": b"the previous export"}
    assert _siblings(out) == ["damaged"]
    calls = []

    def failing_box(self, pm, layer, box):
        calls.append(pm)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_box(self, pm, layer, box)

    real_box = hf_source.HFSource.box
    monkeypatch.setattr(hf_source.HFSource, "box", failing_box)
    with pytest.raises(BaseException, match="No space left"):  # DCP wraps it in its own
        hf_to_megatron(str(QWEN3 / "hf"), str(out), overwrite=True)
    assert _files(out) == {"model.safetensors": b"the previous export"}
    assert _siblings(out) == ["damaged"]


def test_layouts_the_model_cannot_take_are_refused_before_any_rank_starts(tmp_path,
                                                                          monkeypatch):
    """--tp / --pp / --ep against heads, KV groups, MLP widths, layers and experts, and a
    torchrun world against the layout: one line naming the flag and the values that work,
    before a process is spawned or an output folder made. Qwen3 fixture: 2 heads, 1 KV group
    (which TP 2 replicates), 2 layers; the MoE one 4 experts."""
    import torch.multiprocessing as mp

    def no_spawn(*args, **kwargs):
        raise AssertionError("a rank was spawned")

    monkeypatch.setattr(mp, "spawn", no_spawn)
    dense, moe = QWEN3 / "hf", MOE_HF
    for model, flags, message in (
            (dense, dict(tp=3), r"--tp 3 does not divide the model's 2 attention heads: use "
                                r"--tp 1 or 2"),
            (dense, dict(pp=3), r"--pp 3 does not divide the model's 2 layers: use --pp 1 or 2"),
            (dense, dict(pp=0), r"--pp 0: a parallel size is a whole number >= 1"),
            (dense, dict(tp=-1), r"--tp -1: a parallel size is a whole number >= 1"),
            (dense, dict(ep=2), r"--ep 2: the model has no routed experts: leave --ep at 1"),
            (moe, dict(ep=3), r"--ep 3 does not divide the model's 4 experts: use --ep 1, 2 "
                              r"or 4"),
            (moe, dict(tp=2, ep=3), r"--ep 3 does not divide"),
            (moe, dict(tp=4), r"--tp 4 does not divide the model's 2 attention heads")):
        out = tmp_path / "out"
        with pytest.raises(InputError, match=message):
            hf_to_megatron(str(model), str(out), **flags)
        assert not out.exists()
    dims = HFSource(str(dense)).dims
    assert guards.check_layout(dims, tp=2, pp=2, ep=1) == 4  # 1 KV group, replicated
    with single_process_group():  # a torchrun world of 1 for a 2-rank layout
        with pytest.raises(InputError, match=r"a world of 1 ranks is no multiple of max\(--tp, "
                                             r"--ep\) x --pp = 2: start it with torchrun "
                                             r"--nproc-per-node 2"):
            hf_to_megatron(str(QWEN3 / "hf"), str(tmp_path / "out"), tp=2)
    assert not (tmp_path / "out").exists()


def test_every_dgpo_convert_mistake_is_one_line_with_exit_status_2(tmp_path, capsys):
    """What a user gets wrong on `dgpo-convert`'s command line: one `dgpo-convert: error:`
    line, exit status 2, no traceback, nothing written."""
    from megatron_dgpo.convert.cli import main

    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("")
    bad_config = tmp_path / "bad_hf"
    shutil.copytree(QWEN3 / "hf", bad_config)
    (bad_config / "config.json").write_text("{not json")
    cases = (
        (["megatron-to-hf", str(QWEN3 / "bridge"), str(out)], "busy is not empty"),
        (["hf-to-megatron", str(QWEN3 / "hf"), str(tmp_path / "o"), "--tp", "3"],
         "--tp 3 does not divide"),
        (["megatron-to-hf", str(QWEN3 / "bridge"), str(tmp_path / "o"), "--max-shard-gb", "0"],
         "--max-shard-gb must be a number > 0"),
        (["megatron-to-hf", str(tmp_path / "nothing"), str(tmp_path / "o")], "missing file:"),
        (["hf-to-megatron", str(tmp_path / "nothing"), str(tmp_path / "o")], "missing file:"),
        (["hf-to-megatron", str(bad_config), str(tmp_path / "o")], "config.json: not valid JSON"),
        (["hf-to-megatron", str(QWEN3 / "hf"), str(tmp_path / "o"), "--format", "bridge",
          "--pp", "2"], "--format bridge writes at --tp 1 --pp 1 --ep 1"))
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dgpo-convert: error: "), (argv, err)
        assert message in err[0], (argv, err)
        assert not (tmp_path / "o").exists()
