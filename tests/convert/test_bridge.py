"""Megatron-Bridge's Megatron checkpoints in and out, held against Bridge 0.6.2 without
depending on it: tests/convert/fixtures/bridge holds tiny checkpoints that Bridge itself wrote
(tools/bridge_fixtures.py, run in Bridge's own venv; the folder's README), each beside the HF
original Bridge converted. One process, no launch: every check here is single-rank.

The round trip through Bridge's own loader needs Bridge's venv: ``test_bridges_loader_reads_
what_dgpo_convert_writes`` (marker ``bridge``, not in `make test`; it skips, saying why, where
that venv is absent).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_dgpo.convert import (find_model_checkpoint, hf_to_megatron, load_model,
                                   megatron_to_hf, single_process_group, write_metadata)
from megatron_dgpo.convert.safetensors_io import iter_hf_tensors
from megatron_dgpo.models import describe
from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel
from tests._rank_fns_model import causal_mask

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures" / "bridge"
CASES = ("qwen3", "qwen2_tied", "qwen3_moe", "qwen3_moe_no_norm_topk")
TOKENS = torch.tensor([[1, 7, 42, 99, 150, 3, 77, 12], [5, 159, 0, 64, 33, 8, 120, 2]])


def _hf(case: str) -> dict:
    return dict(iter_hf_tensors(str(FIXTURES / case / "hf")))


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for name in want:
        assert got[name].dtype == want[name].dtype, (what, name, got[name].dtype)
        # exact: conversion and storage copy the weights (no arithmetic)
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


@pytest.fixture
def one_rank():
    """Megatron's parallel state of one rank in this process."""
    with single_process_group():
        initialize_parallel(ParallelConfig())
        try:
            yield
        finally:
            destroy_parallel()


def _state_and_logits(path: str, dtype: torch.dtype):
    chunks = load_model(path, dtype=dtype)
    model = chunks[0].eval()
    with torch.no_grad():
        logits = model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS),
                       causal_mask(TOKENS.shape[1]))
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")}, logits


def test_each_bridge_fixture_exports_its_hf_original(tmp_path):
    """megatron_to_hf of Bridge's folder (the parent: the tracker's iteration) gives back the
    HF original's tensors bitwise and its architecture; the tokenizer Bridge saved comes along."""
    from transformers import AutoTokenizer

    for case in CASES:
        out = tmp_path / case
        megatron_to_hf(str(FIXTURES / case / "bridge"), str(out))
        _assert_bitwise(dict(iter_hf_tensors(str(out))), _hf(case), f"{case} megatron_to_hf")
        got = json.loads((out / "config.json").read_text())
        want = json.loads((FIXTURES / case / "hf" / "config.json").read_text())
        assert [got[k] for k in ("model_type", "architectures", "dtype")] == [
            want[k] for k in ("model_type", "architectures", "dtype")]
        # the whole architecture as the builder reads it; the router's aux-loss weight is
        # Bridge's own (0.001 for any Qwen3-MoE), not the HF original's
        got, want = describe(got), describe(want)
        if case.startswith("qwen3_moe"):
            assert got.router.norm_topk_prob == want.router.norm_topk_prob
            got, want = (dataclasses.replace(d, router=None) for d in (got, want))
        assert got == want, case
    text = "<|im_start|>user\nRepeat the digit 7. Put it in \\boxed{}.<|im_end|>\n"
    ids = [AutoTokenizer.from_pretrained(tmp_path / "qwen2_tied").encode(text),
           AutoTokenizer.from_pretrained(FIXTURES / "qwen2_tied" / "hf").encode(text)]
    assert ids[0] == ids[1]


def test_load_model_of_each_bridge_fixture_equals_our_own_conversion(tmp_path, one_rank):
    """load_model of Bridge's folder and of this project's conversion of the same HF original:
    the same parameters (Bridge's 160 vocabulary rows padded to 256 with zeros, as ours) and
    the same logits, exactly; an MoE's norm read from the local spec's key."""
    for case in CASES:
        dtype = next(iter(_hf(case).values())).dtype
        ours = tmp_path / case
        hf_to_megatron(str(FIXTURES / case / "hf"), str(ours))
        want_state, want_logits = _state_and_logits(str(ours), dtype)
        state, logits = _state_and_logits(str(FIXTURES / case / "bridge" / "iter_0000000"), dtype)
        _assert_bitwise(state, want_state, f"{case} load_model")
        # exact: the same weights through the same model
        assert torch.equal(logits, want_logits), case
        rows = state["embedding.word_embeddings.weight"]
        if case != "qwen2_tied":  # vocabulary 160: Bridge stores 160 rows, this project 256
            assert rows.shape[0] == 256 and not rows[160:].any() and rows[:160].abs().sum() > 0
    moe = find_model_checkpoint(str(FIXTURES / "qwen3_moe" / "bridge"))
    assert moe.renamed == {"decoder.layers.pre_mlp_layernorm.weight":
                           "decoder.layers.mlp.linear_fc1.layer_norm_weight"}


def test_load_model_keeps_only_the_model_keys_of_a_checkpoints_common_state(tmp_path, one_rank):
    """A torch_dist model checkpoint whose common state holds Bridge's (and Megatron-LM's)
    entries, described by write_metadata as the converter's docs say: load_model reads the
    model's keys and leaves checkpoint_version, iteration and content_metadata alone."""
    from megatron.core import dist_checkpointing

    folder = tmp_path / "described"
    shutil.copytree(FIXTURES / "qwen3" / "bridge" / "iter_0000000", folder)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    assert {"checkpoint_version", "iteration", "content_metadata"} <= set(common)
    write_metadata(str(folder), str(FIXTURES / "qwen3" / "hf"), 160, torch.float32)
    hf_to_megatron(str(FIXTURES / "qwen3" / "hf"), str(tmp_path / "ours"))
    state, logits = _state_and_logits(str(folder), torch.float32)
    want_state, want_logits = _state_and_logits(str(tmp_path / "ours"), torch.float32)
    _assert_bitwise(state, want_state, "load_model of a described checkpoint")
    # exact: the same weights through the same ops in one process
    assert torch.equal(logits, want_logits)


def _run_config(folder: Path) -> dict:
    return yaml.safe_load((folder / "run_config.yaml").read_text())


def test_dgpo_convert_writes_bridges_layout_with_bridges_names_and_config(tmp_path):
    """`dgpo-convert hf-to-megatron --format bridge`: the container, common state, tensor keys
    and shapes, and every run_config.yaml model field as Bridge's own folder of the same HF
    original has them (the MoE norm under the TE spec's name, Bridge's default spec); read
    back, it is the HF original again."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_dgpo.convert.cli import main

    # Bridge's MoE settings in its fixtures are its CPU patches' (shared/notes), not its import's
    cpu_patched = {"moe_grouped_gemm", "moe_permute_fusion", "moe_token_dispatcher_type"}
    for case in ("qwen2_tied", "qwen3_moe"):
        out, theirs = tmp_path / case, FIXTURES / case / "bridge"
        assert main(["hf-to-megatron", str(FIXTURES / case / "hf"), str(out),
                     "--format", "bridge"]) == 0
        assert (out / "latest_checkpointed_iteration.txt").read_text() == "0"
        ours_iter, theirs_iter = out / "iter_0000000", theirs / "iter_0000000"
        assert sorted(torch.load(ours_iter / "train_state.pt")) == sorted(
            torch.load(theirs_iter / "train_state.pt"))
        assert (out / "latest_train_state.pt").is_file()
        assert (dist_checkpointing.load_common_state_dict(str(ours_iter))
                == dist_checkpointing.load_common_state_dict(str(theirs_iter)))
        shapes = [{k: tuple(v.size) for k, v in FileSystemReader(str(d)).read_metadata()
                   .state_dict_metadata.items() if hasattr(v, "size")}
                  for d in (ours_iter, theirs_iter)]
        if case == "qwen3_moe":  # the local spec's name in Bridge's CPU fixture
            shapes[1]["decoder.layers.pre_mlp_layernorm.weight"] = shapes[1].pop(
                "decoder.layers.mlp.linear_fc1.layer_norm_weight")
        assert shapes[0] == shapes[1], case
        ours, bridge = _run_config(ours_iter)["model"], _run_config(theirs_iter)["model"]
        differ = {k: (v, bridge.get(k)) for k, v in ours.items()
                  if k not in cpu_patched | {"hf_model_id"} and v != bridge.get(k)}
        # Bridge's Qwen3-MoE import sets its own aux-loss weight; this project writes the HF one
        assert differ == ({"moe_aux_loss_coeff": (0.0, 0.001)} if case == "qwen3_moe" else {})
        if case == "qwen3_moe":  # what Bridge 0.6.2's Qwen3MoEBridge.provider_bridge sets
            assert [ours[k] for k in sorted(cpu_patched)] == [True, True, "alltoall"]
        checkpoint = _run_config(ours_iter)["checkpoint"]
        assert checkpoint["save_optim"] is False and checkpoint["save_rng"] is False
        assert {ours["tensor_model_parallel_size"], ours["pipeline_model_parallel_size"]} == {1}
        megatron_to_hf(str(out), str(tmp_path / f"{case}_back"))
        _assert_bitwise(dict(iter_hf_tensors(str(tmp_path / f"{case}_back"))), _hf(case),
                        f"{case} back from the folder written for Bridge")
    tokenizer = tmp_path / "qwen2_tied" / "iter_0000000" / "tokenizer"
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(os.listdir(tokenizer))
    assert _run_config(tmp_path / "qwen2_tied" / "iter_0000000")["tokenizer"][
        "tokenizer_model"] == str(tokenizer)
    with pytest.raises(InputError, match="--format bridge writes at --tp 1 --pp 1 --ep 1"):
        hf_to_megatron(str(FIXTURES / "qwen3" / "hf"), str(tmp_path / "x"), tp=2, format="bridge")


def _copy(case: str, tmp_path: Path) -> Path:
    folder = tmp_path / case
    shutil.copytree(FIXTURES / case / "bridge", folder)
    return folder


def _edit_run_config(folder: Path, **model) -> None:
    path = folder / "iter_0000000" / "run_config.yaml"
    config = yaml.safe_load(path.read_text())
    config["model"].update(model)
    path.write_text(yaml.safe_dump(config))


def test_wrong_or_partial_bridge_folders_are_refused_naming_what_is_missing(tmp_path):
    """A parent without its tracker, a tracker naming no folder, an iteration without
    run_config.yaml or without its tensors' index, a model Bridge describes that this project
    cannot build, a config that does not match the tensors: each refused by name, before a
    tensor is read. The latest iteration of a parent is the tracker's."""
    parent = _copy("qwen3", tmp_path)
    (parent / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(FileNotFoundError, match="latest_checkpointed_iteration.txt.*iter_0000000"):
        megatron_to_hf(str(parent), str(tmp_path / "out"))
    (parent / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(FileNotFoundError, match="missing folder: .*iter_0000005"):
        find_model_checkpoint(str(parent))
    shutil.copytree(parent / "iter_0000000", parent / "iter_0000005")
    assert find_model_checkpoint(str(parent)).dir == str(parent / "iter_0000005")
    (parent / "iter_0000005" / "run_config.yaml").unlink()
    with pytest.raises(FileNotFoundError, match=r"iter_0000005/run_config\.yaml"):
        find_model_checkpoint(str(parent))
    with pytest.raises(FileNotFoundError, match=r"iter_0000005/run_config\.yaml"):
        load_model(str(parent / "iter_0000005"))  # an iteration folder itself
    os.remove(parent / "iter_0000000" / ".metadata")
    with pytest.raises(FileNotFoundError, match=r"iter_0000000/\.metadata"):
        find_model_checkpoint(str(parent / "iter_0000000"))
    for edit, error, message in (
            (dict(normalization="LayerNorm"), ValueError,
             r"model\.normalization='LayerNorm' is not supported"),
            (dict(num_layers=3), ValueError,
             r"shape mismatch for tensor 'decoder\.layers\.self_attention.*\(2, 16\).*\(3, 16\)"),
            # run_config says Llama (no q/k norms): the stored norms would be dropped
            (dict(qk_layernorm=False), ValueError,
             r"does not account for, e\.g\. .*self_attention\.k_layernorm\.weight"),
            (dict(hidden_size=None), ValueError, r"run_config\.yaml: model\.hidden_size is missing")):
        folder = _copy("qwen3", tmp_path / str(len(os.listdir(tmp_path))))
        _edit_run_config(folder, **edit)
        with pytest.raises(error, match=message):
            load_model(str(folder))  # refused before the parallel state is even needed


def test_cli_reads_a_bridge_folder(tmp_path):
    from megatron_dgpo.convert.cli import main

    assert main(["megatron-to-hf", str(FIXTURES / "qwen3_moe" / "bridge"), str(tmp_path / "hf"),
                 "--dtype", "bfloat16"]) == 0
    got = dict(iter_hf_tensors(str(tmp_path / "hf")))
    for name, tensor in _hf("qwen3_moe").items():
        # exact: one fp32 -> bf16 rounding of the same values
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    assert main(["megatron-to-hf", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


def _bridge_python() -> Path | None:
    path = Path(os.environ.get("MEGATRON_BRIDGE_PYTHON", "/tmp/megatron-bridge-0.6.2/bin/python"))
    return path if path.is_file() else None


@pytest.mark.bridge
@pytest.mark.skipif(_bridge_python() is None,
                    reason="no Megatron-Bridge venv: set MEGATRON_BRIDGE_PYTHON to its python "
                           "(tools/bridge_fixtures.py creates /tmp/megatron-bridge-0.6.2)")
def test_bridges_loader_reads_what_dgpo_convert_writes(tmp_path):
    """Bridge's own load_megatron_model (in its venv, with its CPU patches) on every folder
    `dgpo-convert --format bridge` writes: each parameter bitwise equal to Bridge's own import
    of the HF original, Bridge's export equal to the original, Bridge's tokenizer the
    original's (tools/bridge_fixtures.py --bridge-check)."""
    cases = []
    for case in CASES:
        hf_to_megatron(str(FIXTURES / case / "hf"), str(tmp_path / case), format="bridge")
        cases.append(f"{case}={FIXTURES / case / 'hf'}={tmp_path / case}="
                     f"{FIXTURES / case / 'bridge'}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(_bridge_python()), str(ROOT / "tools" / "bridge_fixtures.py"),
                           "--bridge-check", *cases], capture_output=True, text=True,
                          env=dict(env, CUDA_VISIBLE_DEVICES=""), cwd=tmp_path, timeout=900)
    report = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum("all bitwise equal to Bridge's HF import" in line for line in report) == 8, report
    assert proc.stdout.strip().endswith("0 failure(s)")
    print("\n".join(report), file=sys.stderr)


def test_every_field_bridge_writes_is_judged():
    """The allow-list is Megatron-Bridge 0.6.2's GPTModelProvider, field for field: every field
    of every fixture's run_config.yaml (which Bridge writes whole) is read, required at the
    builder's value, or without effect, exactly one of them, and none is listed that Bridge
    does not write."""
    from megatron_dgpo.convert import bridge_provider as provider

    groups = (provider._READ, set(provider._REQUIRED), provider._NO_EFFECT)
    assert not any(a & b for i, a in enumerate(groups) for b in groups[i + 1:])
    for case in CASES:
        fields = set(_run_config(FIXTURES / case / "bridge" / "iter_0000000")["model"])
        assert fields == set().union(*groups), (case, fields ^ set().union(*groups))


def test_a_bridge_field_that_changes_the_model_is_refused_by_name(tmp_path):
    """Each field whose value changes what the weights compute (softmax_scale, no_rope_freq,
    glu_linear_offset ... : every required one off its value), a field the allow-list does
    not know, another provider class: refused naming the field, through every reader. Fields
    without effect take any value and give the same HF config; a softmax_scale of exactly
    1/sqrt(head_dim) is the builder's."""
    from megatron_dgpo.convert.bridge_provider import _REQUIRED, hf_config_from_provider

    model = _run_config(FIXTURES / "qwen3" / "bridge" / "iter_0000000")["model"]
    want = hf_config_from_provider(model, "run_config.yaml")
    named = [("softmax_scale", 0.5), ("no_rope_freq", 2), ("glu_linear_offset", 1.0),
             ("activation_func_clamp_value", 7.0), ("mup_output_mult", 2.0),
             ("moe_router_load_balancing_type", "sinkhorn"),
             ("moe_router_load_balancing_type", ["aux_loss", "sinkhorn"]),
             ("transformer_layer_spec", {"_target_": "megatron.bridge.models.gpt_provider."
                                                    "modelopt_transformer_layer_spec"}),
             ("_target_", "megatron.bridge.models.gemma.gemma_provider.GemmaModelProvider")]
    off_value = [(name, "not-" + str(allowed[0])) for name, (allowed, _) in _REQUIRED.items()]
    for name, value in named + off_value:
        with pytest.raises(InputError, match=rf"run_config\.yaml: model\.{name}=.* is not "
                                             rf"supported \(this project builds"):
            hf_config_from_provider({**model, name: value}, "run_config.yaml")
    with pytest.raises(InputError, match=r"model\.a_new_field is a field this project has not "
                                         r"judged"):
        hf_config_from_provider({**model, "a_new_field": None}, "run_config.yaml")
    with pytest.raises(InputError, match=r"model\.normalization='LayerNorm' is not supported"):
        hf_config_from_provider({k: v for k, v in model.items() if k != "normalization"},
                                "run_config.yaml")  # left out: Bridge's default, LayerNorm
    no_effect = dict(tensor_model_parallel_size=8, apply_rope_fusion=True, hidden_dropout=0.1,
                     fp8="hybrid", recompute_granularity="full", moe_grouped_gemm=True,
                     softmax_scale=16 ** -0.5, moe_router_load_balancing_type=["aux_loss"])
    assert hf_config_from_provider({**model, **no_effect}, "run_config.yaml") == want
    folder = _copy("qwen3", tmp_path)
    _edit_run_config(folder, softmax_scale=0.5)
    for read in (find_model_checkpoint, load_model,
                 lambda path: megatron_to_hf(path, str(tmp_path / "out"))):
        with pytest.raises(InputError, match=r"iter_0000000/run_config\.yaml: model\."
                                             r"softmax_scale=0\.5 is not supported"):
            read(str(folder))


def test_a_bridge_folder_takes_its_stop_ids_from_its_hf_original(tmp_path, caplog,
                                                                 monkeypatch):
    """Bridge writes no generation_config.json: the export takes the one of the HF original its
    hf_model_id names (beside the checkpoint folder, as in the fixtures) and the original's
    special token ids, so a run from it stops where a run from the original does. An
    hf_model_id that names nothing, or another model, is not used: one warning names the stop
    ids a run uses instead."""
    import logging

    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    original = FIXTURES / "qwen2_tied" / "hf"
    out = tmp_path / "hf"
    megatron_to_hf(str(FIXTURES / "qwen2_tied" / "bridge"), str(out))
    assert (out / "generation_config.json").read_bytes() == (
        original / "generation_config.json").read_bytes()
    got, want = (json.loads((d / "config.json").read_text()) for d in (out, original))
    assert [got.get(k) for k in ("eos_token_id", "pad_token_id")] == [
        want[k] for k in ("eos_token_id", "pad_token_id")] == [2, 0]
    eos = AutoTokenizer.from_pretrained(original).eos_token_id
    for case, hf_model_id, why in (
            ("qwen2_tied", "nowhere/no-such-model", "is neither a folder here nor a hub repo"),
            ("qwen2_tied", str(FIXTURES / "qwen3" / "hf"), "describes another model")):
        folder = _copy(case, tmp_path / why[:8].replace(" ", "_"))
        _edit_run_config(folder, hf_model_id=hf_model_id)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_dgpo.convert.bridge"):
            megatron_to_hf(str(folder), str(folder.parent / "hf"))
        assert not (folder.parent / "hf" / "generation_config.json").exists()
        [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert why in record.getMessage() and f"stops at [{eos}]" in record.getMessage(), \
            record.getMessage()
