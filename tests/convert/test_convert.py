"""HF <-> Megatron converters: bitwise round trips at TP2 x PP2, logit parity against
transformers at TP1 and TP2 (a Megatron-Bridge checkpoint's too), resharding (TP2 x PP1 saved,
TP1 x PP2 loaded), refusals.

Three gloo launches in all (4, 2 and 2 ranks); several checks per launch.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dgpo.convert import (LazyHFReader, ShardedSafetensorsWriter, export_from_checkpoint,
                                   hf_to_megatron, megatron_to_hf)
from megatron_dgpo.convert.safetensors_io import TensorBlocks, iter_hf_tensors
from megatron_dgpo.runtime.errors import InputError
from tests import _rank_fns_convert as fns
from tests.distributed import run_ranks


def _hf_state(path: str) -> dict:
    return dict(iter_hf_tensors(path))


def _assert_bitwise(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for name in want:
        assert got[name].dtype == want[name].dtype, (what, name, got[name].dtype)
        assert got[name].shape == want[name].shape, (what, name)
        # exact: conversion, sharding and storage copy the weights (no arithmetic)
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case saved by transformers, converted at TP2 x PP2, exported back (4 ranks)."""
    root = tmp_path_factory.mktemp("convert")
    dirs, models = {}, {}
    for case in fns.CASES:
        hf_dir = str(root / case)
        models[case] = fns.save_hf(case, hf_dir)
        dirs[case] = (hf_dir, str(root / f"{case}_mg"))
    exported = run_ranks(fns.tp2pp2_fn, 4, dirs)
    torch.manual_seed(5)
    tokens = torch.randint(0, 300, (2, 16))
    return dict(root=root, dirs=dirs, models=models, exported=exported, tokens=tokens)


def test_round_trip_tp2pp2_bitwise(converted, tmp_path):
    for case, (hf_dir, mg_dir) in converted["dirs"].items():
        want = _hf_state(hf_dir)
        if case == "llama":
            assert all(t.dtype == torch.bfloat16 for t in want.values())
        meta = json.load(open(os.path.join(mg_dir, "dgpo_convert.json")))
        assert meta["vocab_size"] == fns.CASES[case]["vocab_size"]
        assert meta["padded_vocab_size"] % 256 == 0 and meta["padded_vocab_size"] >= meta["vocab_size"]
        out = str(tmp_path / case)
        megatron_to_hf(mg_dir, out)
        _assert_bitwise(_hf_state(out), want, f"{case} megatron_to_hf")
        for side in ("config.json", "generation_config.json"):
            assert os.path.isfile(os.path.join(out, side)), side
        cfg = json.load(open(os.path.join(out, "config.json")))
        assert cfg["vocab_size"] == fns.CASES[case]["vocab_size"]
        # the live-model generator: every one of the 4 ranks receives every full tensor
        for rank, result in enumerate(converted["exported"]):
            _assert_bitwise(result[case]["ckpt"], want, f"{case} export_hf_weights rank {rank}")
    want = _hf_state(converted["dirs"]["qwen2"][0])
    assert "lm_head.weight" not in _hf_state(converted["dirs"]["qwen2_tied"][0])
    for rank, result in enumerate(converted["exported"]):
        _assert_bitwise(result["qwen2"]["hf"], want, f"load_model(HF dir) rank {rank}")
        if rank == 0:
            _assert_bitwise(result["qwen2"]["first"], want, "consumer='first' rank 0")
        else:
            assert result["qwen2"]["first"] == {}, rank


def test_megatron_to_hf_dtype_and_shards(converted, tmp_path):
    hf_dir, mg_dir = converted["dirs"]["qwen2"]
    want = _hf_state(hf_dir)
    megatron_to_hf(mg_dir, str(tmp_path), dtype=torch.bfloat16, max_shard_bytes=200_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    got = _hf_state(str(tmp_path))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.bfloat16
        # exact: one fp32 -> bf16 rounding of the same values on both sides
        assert torch.equal(got[name], want[name].to(torch.bfloat16)), name
    cfg = json.load(open(tmp_path / "config.json"))
    assert "bfloat16" in (cfg.get("torch_dtype"), cfg.get("dtype"))


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_logit_parity_tp1_tp2_and_resharding(converted):
    dirs, tokens = converted["dirs"], converted["tokens"]
    # without torch.distributed, tp * pp > 1 spawns its own gloo processes (the CLI's path)
    hf_dir = dirs["qwen2_vocab300"][0]
    hf_to_megatron(hf_dir, hf_dir + "_tp2pp1", tp=2, pp=1)
    assert json.load(open(os.path.join(hf_dir + "_tp2pp1", "dgpo_convert.json")))[
        "padded_vocab_size"] == 512
    bridge = os.path.join(os.path.dirname(__file__), "fixtures", "bridge", "qwen3")
    tp2 = run_ranks(fns.tp2_fn, 2, dirs, tokens, os.path.join(bridge, "bridge"))
    tp1 = run_ranks(fns.tp1_fn, 2, dirs, tokens)
    errors = {}
    for case, model in converted["models"].items():
        vocab = fns.CASES[case]["vocab_size"]
        case_tokens = tokens % vocab
        with torch.no_grad():
            want = model(tokens).logits
        for label, logits in (("tp2", tp2[0][case]), ("tp1", tp1[0][case])):
            assert logits.shape[-1] >= vocab
            if case == "llama":  # stored in bf16: the reference is the bf16-rounded model
                continue
            errors[(case, label)] = _max_rel(logits[..., :vocab], want)
        assert torch.equal(case_tokens, tokens)  # exact: token ids, all < every vocab size
    # llama (stored in bf16): transformers' model loaded from the same files in fp32
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(dirs["llama"][0], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        want = llama(tokens).logits
    for label, logits in (("tp2", tp2[0]["llama"]), ("tp1", tp1[0]["llama"])):
        errors[("llama", label)] = _max_rel(logits[..., :512], want)
    assert max(errors.values()) <= 1e-5, errors
    # VPP: stage 0 holds layers 1 and 3, stage 1 layers 2 and 4; export is still exact
    assert tp1[0]["vpp_layers"] == [[1], [3]] and tp1[1]["vpp_layers"] == [[2], [4]]
    # dgpo-convert under torchrun's world of 2: what that world cannot run refused on both
    # ranks (exit 2, nothing written), --tp 2 converted collectively
    hf_dir = dirs["qwen2"][0]
    assert [result["cli"] for result in tp1] == [[2, 2, 0]] * 2
    assert not os.path.exists(hf_dir + "_cli_tp2pp2") and not os.path.exists(hf_dir + "_cli_hf")
    megatron_to_hf(hf_dir + "_cli_tp2", hf_dir + "_cli_back")
    _assert_bitwise(_hf_state(hf_dir + "_cli_back"), _hf_state(hf_dir), "dgpo-convert, torchrun")
    want_state = _hf_state(dirs["qwen2"][0])
    for rank in range(2):
        _assert_bitwise(tp1[rank]["vpp_export"], want_state, f"VPP export rank {rank}")
    # resharding: saved at TP2 x PP1 (vocab padded to 512), loaded at TP1 x PP2 (padded to 384)
    saved, resharded = tp2[0]["saved_tp2pp1"], tp1[1]["resharded_tp1pp2"]
    assert tp1[0]["resharded_tp1pp2"] is None  # first pipeline stage has no logits
    assert saved.shape[-1] == 512 and resharded.shape[-1] == 384
    assert _max_rel(resharded[..., :300], saved[..., :300]) <= 1e-6
    with torch.no_grad():
        want = converted["models"]["qwen2_vocab300"](tokens).logits
    assert _max_rel(resharded[..., :300], want) <= 1e-5
    # Megatron-Bridge's checkpoint (160 vocabulary rows, unpadded) at TP2 (padded to 256):
    # transformers' model of its HF original
    qwen3 = AutoModelForCausalLM.from_pretrained(os.path.join(bridge, "hf"), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        want = qwen3(tokens % 160).logits
    assert tp2[0]["bridge"].shape[-1] == 256
    assert _max_rel(tp2[0]["bridge"][..., :160], want) <= 1e-5


def test_refusals(converted, tmp_path):
    hf_dir = converted["dirs"]["qwen2"][0]
    # unsupported architecture: the message lists the supported ones
    bad = tmp_path / "mistral"
    bad.mkdir()
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    json.dump(dict(cfg, model_type="mistral", architectures=["MistralForCausalLM"]),
              open(bad / "config.json", "w"))
    save_file({"x": torch.zeros(1)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unsupported architecture.*qwen2 \(Qwen2ForCausalLM\)"
                                         r".*llama \(LlamaForCausalLM\)"):
        hf_to_megatron(str(bad), str(tmp_path / "o1"))
    # shape mismatch: names the tensor and both shapes
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    json.dump(cfg, open(wrong / "config.json", "w"))
    state = _hf_state(hf_dir)
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 128)
    save_file(state, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*"
                                         r"\(32, 128\).*\(64, 128\)"):
        hf_to_megatron(str(wrong), str(tmp_path / "o2"))
    # missing files: no config.json; no safetensors; a shard listed in the index; a tensor
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_to_megatron(str(tmp_path / "nowhere"), str(tmp_path / "o3"))
    empty = tmp_path / "empty"
    empty.mkdir()
    json.dump(cfg, open(empty / "config.json", "w"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf_to_megatron(str(empty), str(tmp_path / "o4"))
    json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}},
              open(empty / "model.safetensors.index.json", "w"))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        hf_to_megatron(str(empty), str(tmp_path / "o5"))
    # a tensor the map would drop silently (an MLP bias) is refused, by name
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(256)
    save_file(state, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.bias"):
        hf_to_megatron(str(wrong), str(tmp_path / "o5b"))
    del state["model.layers.0.mlp.gate_proj.bias"]
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(wrong / "model.safetensors"))
    with pytest.raises(InputError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        hf_to_megatron(str(wrong), str(tmp_path / "o6"))
    with pytest.raises(FileNotFoundError, match="dgpo_convert.json"):
        megatron_to_hf(hf_dir, str(tmp_path / "o7"))


def test_tp1_in_process_split_chunks_and_streaming_writer(converted, tmp_path, monkeypatch):
    """tp=pp=1 converts in this process, here with the embedding stored as several chunks;
    Megatron's own loader reads it back; the writer's files load with safetensors itself."""
    from megatron_dgpo.convert import (export_hf_weights, load_model, single_process_group,
                                       write_metadata, writing)
    from megatron_dgpo.runtime.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    hf_dir = converted["dirs"]["qwen2_tied"][0]
    want = _hf_state(hf_dir)
    monkeypatch.setattr(writing, "_CHUNK_BYTES", 40_000)  # embedding 384 x 128 fp32 = 196 kB
    hf_to_megatron(hf_dir, str(tmp_path / "mg"))
    stored = [f for f in os.listdir(tmp_path / "mg") if f.endswith(".distcp")]
    assert len(stored) == 1
    megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf"))
    _assert_bitwise(load_file(str(tmp_path / "hf" / "model.safetensors")), want, "tp1 round trip")
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "mg")).read_metadata().state_dict_metadata
    # 384 rows of 512 B: the fewest equal parts of <= 40 kB are 6 of 64 rows
    assert len(md["embedding.word_embeddings.weight"].chunks) == 6
    with single_process_group():
        initialize_parallel(ParallelConfig())
        try:
            exported = {k: v.clone() for k, v in export_hf_weights(load_model(str(tmp_path / "mg")))}
        finally:
            destroy_parallel()
    _assert_bitwise(exported, want, "load_model of split chunks")
    # a torch_dist checkpoint without our metadata (e.g. from training) is refused until
    # write_metadata describes it
    meta = json.load(open(tmp_path / "mg" / "dgpo_convert.json"))
    os.remove(tmp_path / "mg" / "dgpo_convert.json")
    with pytest.raises(FileNotFoundError, match="write_metadata"):
        megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf2"))
    write_metadata(str(tmp_path / "mg"), hf_dir, meta["padded_vocab_size"], torch.float32,
                   hf_dir=hf_dir)
    assert json.load(open(tmp_path / "mg" / "dgpo_convert.json"))["hf_config"] == meta["hf_config"]
    blocks = dict(export_from_checkpoint(str(tmp_path / "mg"), row_blocks=True))
    assert isinstance(blocks["model.embed_tokens.weight"], TensorBlocks)  # 6 stored row chunks
    # exact: the stored row chunks concatenated: a copy
    assert torch.equal(blocks["model.embed_tokens.weight"].materialize(),
                       want["model.embed_tokens.weight"])
    writer = ShardedSafetensorsWriter(str(tmp_path / "w"), max_shard_bytes=100, header_reserve=64)
    tensors = {f"t{i}": torch.randn(i + 3, 5).to(torch.bfloat16 if i % 2 else torch.float32)
               for i in range(6)}
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()  # header outgrows the 64-byte reserve: exercises the shifting path
    _assert_bitwise(_hf_state(str(tmp_path / "w")), tensors, "writer")
    reader = LazyHFReader(str(tmp_path / "w"))
    # exact: a slice read back from storage
    assert torch.equal(reader.read("t4", ((1, 3), (2, 4))), tensors["t4"][1:3, 2:4])


def test_dgpo_convert_cli_round_trip(converted, tmp_path):
    """The installed `dgpo-convert` command, both directions, as the README shows it."""
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).parent / "dgpo-convert"
    assert cli.exists(), "dgpo-convert is not installed: run `make test` (pip install -e .)"
    hf_dir, _ = converted["dirs"]["qwen2"]
    mg, back = tmp_path / "mg", tmp_path / "hf"
    for args in (["hf-to-megatron", hf_dir, str(mg), "--tp", "2"],
                 ["megatron-to-hf", str(mg), str(back)]):
        proc = subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_bitwise(_hf_state(str(back)), _hf_state(hf_dir), "dgpo-convert CLI round trip")
    assert (back / "config.json").exists()
    missing = subprocess.run([str(cli), "megatron-to-hf", str(tmp_path / "nothing"),
                              str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert "dgpo-convert: error: missing file:" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_private_api_adapter_names_package_version_and_api(monkeypatch):
    """Every private DCP / Megatron-Core call goes through convert/_megatron_compat: a missing
    API fails naming the package, its version and the API; an untested version warns."""
    import importlib.metadata

    from megatron_dgpo.convert import _megatron_compat as compat

    mcore = importlib.metadata.version("megatron-core")
    with pytest.raises(compat.IncompatibleDependency,
                       match=rf"megatron-core {re.escape(mcore)} lacks "
                             r"megatron\.core\.dist_checkpointing\.strategies\.torch\.NoSuchPlanner"):
        compat.api("megatron-core", "megatron.core.dist_checkpointing.strategies.torch",
                   "NoSuchPlanner")
    assert compat.mcore_save_planner_class().__name__ == "MCoreSavePlanner"  # tested version
    monkeypatch.setattr(compat, "_installed", lambda package: "99.1.0")
    with pytest.warns(UserWarning, match="tested with torch 2.13, found 99.1.0"):
        compat.check_versions.__wrapped__()
    monkeypatch.setattr(compat, "_installed", lambda package: {"torch": "2.13.0+cpu",
                                                              "megatron-core": "0.19.2"}[package])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_versions.__wrapped__()  # the tested versions: silent
    # nothing else in the converter imports the private modules
    root = os.path.join(os.path.dirname(compat.__file__))
    for name in os.listdir(root):
        if name.endswith(".py") and name != "_megatron_compat.py":
            text = open(os.path.join(root, name)).read()
            imports = re.findall(r"^\s*(?:from|import) (\S+)", text, re.M)
            assert not [m for m in imports if m.startswith(("torch.distributed.checkpoint",
                                                            "megatron.core.dist_checkpointing."))
                        ], (name, imports)
            assert "_create_read_items" not in text and "__create_chunk_list__" not in text
