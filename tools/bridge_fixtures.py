"""Regenerate tests/convert/fixtures/bridge: tiny checkpoints that Megatron-Bridge 0.6.2 wrote, and
show Bridge's own loader reading the folders that ``dgpo-convert`` writes for it.

    .venv/bin/python tools/bridge_fixtures.py [--venv /tmp/megatron-bridge-0.6.2] [--out DIR]

Bridge cannot share this project's environment (it needs transformers <= 5.12.1, vLLM 0.32 needs
>= 5.16.1), so the script runs in three kinds of process (shared/notes/megatron-bridge-on-cpu.md):

1. this project's environment (the process you start): each fixture's HF original, random tiny
   weights saved by transformers (``FIXTURES``), written to ``<out>/<name>/hf``;
2. Bridge's own venv, created under /tmp on first use with the note's pinned packages
   (``BRIDGE_PACKAGES``): ``AutoBridge`` converts each HF original and ``save_megatron_model``
   writes ``<out>/<name>/bridge`` (the ``iter_0000000`` layout). Bridge's CPU patches
   (``_bridge_on_cpu``) live in that process only: Bridge never sees this project's
   ``runtime/cpu.py`` patches, nor this project Bridge's;
3. this project's environment again: ``dgpo-convert hf-to-megatron --format bridge`` writes each
   HF original for Bridge (a temporary folder), and a Bridge process loads every one of them with
   its own loader (``load_megatron_model``) and compares each parameter, bitwise, with Bridge's
   own HF import of the same original, then exports it back to HF and compares with the
   original. Its report is printed (tests/convert/fixtures/bridge/README.md holds the last one).

The fixtures are deterministic (seeded weights, Bridge's own writer); run this again after a
change of Bridge or of the fixture list and commit the result with the README's report.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "convert" / "fixtures" / "bridge"
DEFAULT_VENV = Path(tempfile.gettempdir()) / "megatron-bridge-0.6.2"

BRIDGE_PACKAGES = (
    # torch first, pinned, so that nothing later swaps it
    ["torch==2.13.0", "megatron-core==0.19.2", "transformers==5.12.1"],
    # Bridge's declared requirements pull in what its model paths never import (wandb, timm, ...)
    ["--no-deps", "megatron-bridge==0.6.2"],
    # what its conversion, provider and checkpoint modules import at module level
    ["omegaconf==2.3.1", "hydra-core==1.3.8", "accelerate==1.15.0", "einops==0.8.2",
     "psutil==7.2.2", "nvidia-modelopt==0.47.0", "requests==2.34.2", "datasets==5.2.0",
     "megatron-energon==7.4.1", "multi-storage-client==1.3.1", "tensorboard==2.21.0"],
)

_SMALL = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
              hidden_act="silu", attention_bias=False)
FIXTURES = {
    # head_dim 16 != hidden 16 / 2 heads; vocabulary 160: Bridge stores 160 rows, this project
    # pads to 256 (a multiple of 128 x TP)
    "qwen3": dict(family="qwen3", dtype="float32", config=dict(
        _SMALL, intermediate_size=32, num_hidden_layers=2, vocab_size=160,
        tie_word_embeddings=False)),
    # tied embeddings, QKV bias, bfloat16, the tiny job's tokenizer and a head size vLLM's CPU
    # attention accepts (32): the model that tests/test_trainer.py's tied run warm-starts from
    "qwen2_tied": dict(family="qwen2", dtype="bfloat16", tokenizer=True, config=dict(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        num_hidden_layers=1, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True)),
    # routed experts; the router renormalises its top k (norm_topk_prob) or does not
    "qwen3_moe": dict(family="qwen3_moe", dtype="float32", config=dict(
        _SMALL, num_hidden_layers=2, vocab_size=160, tie_word_embeddings=False,
        intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.0)),
    "qwen3_moe_no_norm_topk": dict(family="qwen3_moe", dtype="float32", config=dict(
        _SMALL, num_hidden_layers=1, vocab_size=160, tie_word_embeddings=False,
        intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.0)),
}
_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


# ------------------------------------------------------------------ this project's environment

def make_hf_original(name: str, spec: dict, out_dir: Path, seed: int) -> None:
    """Random tiny weights (norms too, so that a misplaced norm shows) saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_class, model_class = (getattr(transformers, n) for n in _CLASSES[spec["family"]])
    config = config_class(**spec["config"])
    if spec.get("tokenizer"):  # the tiny job's tokenizer (megatron_dgpo.tasks.tiny)
        from transformers import AutoTokenizer

        from megatron_dgpo.tasks.tiny import tiny_tokenizer_texts, train_tokenizer

        tok = AutoTokenizer.from_pretrained(train_tokenizer(tiny_tokenizer_texts(), out_dir))
        config.vocab_size = len(tok)
        config.eos_token_id = tok.eos_token_id
        config.pad_token_id = tok.pad_token_id
    model = model_class(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    model.to(getattr(torch, spec["dtype"])).save_pretrained(out_dir)
    print(f"[{name}] HF original: {out_dir}", file=sys.stderr)


def ensure_bridge_venv(venv: Path) -> Path:
    """Bridge's venv (created with ``BRIDGE_PACKAGES`` when absent); its python."""
    python = venv / "bin" / "python"
    stamp = venv / ".bridge-installed"
    if stamp.is_file():
        return python
    if not python.exists():  # this project's Python (3.12, as Bridge 0.6.2 requires)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for packages in BRIDGE_PACKAGES:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    stamp.write_text("\n".join(" ".join(p) for p in BRIDGE_PACKAGES) + "\n")
    return python


def _bridge(python: Path, *args: str, cwd: Path | None = None) -> None:
    """Run this script's Bridge side in Bridge's venv (a clean environment: no PYTHONPATH, so
    that this project's package is not importable there)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    subprocess.run([str(python), str(Path(__file__).resolve()), *args], check=True, env=env,
                   cwd=cwd or tempfile.gettempdir())


def _sizes(out: Path) -> str:
    lines = []
    for name in FIXTURES:
        total = sum(f.stat().st_size for f in (out / name).rglob("*") if f.is_file())
        lines.append(f"  {name}: {total / 1024:.0f} KiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                        help="Bridge's venv (created when absent)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--bridge-write", nargs=2, metavar=("HF_DIR", "OUT_DIR"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--bridge-check", nargs="+", metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bridge_write:
        return bridge_write(*args.bridge_write)
    if args.bridge_check:
        return bridge_check(args.bridge_check)

    python = ensure_bridge_venv(args.venv)
    out = args.out.resolve()
    if out.exists():
        for name in FIXTURES:
            shutil.rmtree(out / name, ignore_errors=True)
    for seed, (name, spec) in enumerate(FIXTURES.items()):
        make_hf_original(name, spec, out / name / "hf", seed)
        # relative paths: Bridge records them in run_config.yaml (save, hf_model_id, tokenizer)
        _bridge(python, "--bridge-write", "hf", "bridge", cwd=out / name)
    # Folders this project writes for Bridge, loaded by Bridge's own loader
    cases = []
    with tempfile.TemporaryDirectory(prefix="dgpo-for-bridge-") as tmp:
        for name in FIXTURES:
            ours = Path(tmp) / name
            subprocess.run([sys.executable, "-m", "megatron_dgpo.convert.cli", "hf-to-megatron",
                            str(out / name / "hf"), str(ours), "--format", "bridge"], check=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
            cases.append(f"{name}={out / name / 'hf'}={ours}={out / name / 'bridge'}")
        _bridge(python, "--bridge-check", *cases)
    print(f"fixtures in {out}:\n{_sizes(out)}")
    return 0


# ------------------------------------------------------------------ Bridge's venv

class _LoraLayersWithoutTE(importlib.machinery.SourceFileLoader):
    """``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch``
    unconditionally (TE is only an optional extra of Bridge): its source is loaded with that
    import replaced by ``te = None``. No fake ``transformer_engine`` module: Megatron-Core would
    then believe TE is present."""

    NAME = "megatron.bridge.peft.lora_layers"

    def get_data(self, path):
        data = super().get_data(path)
        if path.endswith(".py"):
            data = data.replace(b"import transformer_engine.pytorch as te", b"te = None")
        return data

    def get_code(self, fullname):  # never the cached bytecode of the unpatched source
        return compile(self.get_data(self.path), self.path, "exec")

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):  # a meta-path finder for that module
        if fullname != cls.NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        spec.loader = cls(fullname, spec.origin)
        return spec


def _bridge_on_cpu():
    """Bridge 0.6.2 and Megatron-Core on a machine without CUDA: the note's patches, each the
    smallest that works, and a gloo world of one rank with Megatron's parallel state."""
    import torch
    import torch.distributed as dist

    for name in [n for n in os.environ if n.startswith("NVTE_")]:
        # TE's attention switches, as a parent process of this project may have set them:
        # Megatron-Core asserts that they agree with Bridge's attention backend
        del os.environ[name]
    sys.meta_path.insert(0, _LoraLayersWithoutTE)  # 1. the TE import of peft/lora_layers
    # 3. the model-parallel RNG tracker saves and restores CUDA generator states
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    # 5. RoPE moves inv_freq to torch.cuda.current_device(); 6. the checkpoint writers
    # synchronise CUDA, and Bridge's saver records the CUDA RNG state even with save_rng=False
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="bridge-store-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tp_random.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)


def _cpu_provider(provider, *, keep_te_moe_norm_name: bool = False):
    """2. Bridge's own local (non-TE) layer spec; 4. MoE: SequentialMLP experts (grouped GEMM
    and permute fusion are TE's) and the allgather dispatcher (alltoall makes a CUDA stream).

    ``keep_te_moe_norm_name``: the local spec stores an MoE layer's pre-MLP norm under TE's
    fused name ``mlp.linear_fc1.layer_norm_weight``; Bridge's default (TE) spec, which a folder
    written for Bridge is for, stores it as ``pre_mlp_layernorm.weight``. Loading such a folder
    on CPU keeps that name, as the TE spec would."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    def spec(config):
        layer = local_layer_spec(config)
        if keep_te_moe_norm_name and config.num_moe_experts:
            keys = dict(layer.submodules.sharded_state_dict_keys_map)
            keys.pop("pre_mlp_layernorm.", None)
            layer.submodules.sharded_state_dict_keys_map = keys
        return layer

    provider.transformer_layer_spec = spec if keep_te_moe_norm_name else local_layer_spec
    if provider.num_moe_experts:
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
        provider.moe_token_dispatcher_type = "allgather"
    return provider


def _build(provider):
    """7. the model on CPU, unwrapped, with Bridge's pre-wrap hooks (HF weights) applied."""
    if hasattr(provider, "finalize"):
        provider.finalize()
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                              mixed_precision_wrapper=None)


def bridge_write(hf_dir: str, out_dir: str) -> int:
    """HF original -> Bridge's Megatron model -> ``save_megatron_model`` (Bridge's venv)."""
    _bridge_on_cpu()
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    model = _build(_cpu_provider(bridge.to_megatron_provider(load_weights=True)))
    tokenizer = hf_dir if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")) else None
    bridge.save_megatron_model(model, out_dir, hf_tokenizer_path=tokenizer)
    print(f"Bridge wrote {out_dir}", file=sys.stderr)
    return 0


def _hf_tensors(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def _params(model) -> dict:
    """{name: tensor} of model chunks, inside their wrappers (Float16Module for a bf16 one)."""
    out = {}
    for chunk in model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        out.update((name, param.detach().clone()) for name, param in chunk.named_parameters())
    return out


_NOT_ARCHITECTURE = {"hf_model_id", "hf_model_revision", "transformer_layer_spec", "init_method",
                     "output_layer_init_method", "embedding_init_method", "use_cpu_initialization",
                     "perform_initialization", "make_vocab_size_divisible_by", "timers"}


def _provider_differences(ours, theirs) -> list[str]:
    """Fields of two GPTModelProviders that differ, besides paths, init functions and the
    settings this script's CPU patches change."""
    import dataclasses

    out = []
    for f in dataclasses.fields(theirs):
        if f.name in _NOT_ARCHITECTURE or f.name.startswith("_"):
            continue
        a, b = getattr(ours, f.name, None), getattr(theirs, f.name, None)
        if callable(a) and callable(b):
            a, b = getattr(a, "__name__", a), getattr(b, "__name__", b)
        try:
            equal = bool(a == b)
        except Exception:  # noqa: BLE001 - e.g. tensors: compared by their text
            equal = repr(a) == repr(b)
        if not equal:
            out.append(f"{f.name}: {a!r} (ours) vs {b!r} (Bridge's)")
    return out


def bridge_check(cases: list[str]) -> int:
    """For each ``name=hf=ours=theirs``: Bridge's loader on the folder this project wrote for
    Bridge (``ours``) and on Bridge's own (``theirs``); each parameter compared bitwise with
    Bridge's import of the HF original, and Bridge's export of the loaded model with the
    original's tensors."""
    import torch

    _bridge_on_cpu()
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.model_load_save import build_and_load_model, load_model_config

    failures = 0
    for case in cases:
        name, hf_dir, ours, theirs = case.split("=")
        bridge = AutoBridge.from_hf_pretrained(hf_dir)
        imported = _cpu_provider(bridge.to_megatron_provider(load_weights=True))
        want = _params(_build(imported))
        original = _hf_tensors(hf_dir)
        # both providers as a build sees them: patched for the CPU, then finalised
        ours_config = _cpu_provider(load_model_config(str(max(Path(ours).glob("iter_*"))))[0])
        ours_config.finalize()
        differences = _provider_differences(ours_config, imported)
        print(f"[{name}] run_config.yaml written by dgpo-convert: {len(differences)} provider "
              f"field(s) differ from Bridge's own HF import"
              + "".join(f"\n    {d}" for d in differences))
        for label, folder, te_names in (("dgpo-convert --format bridge", ours, True),
                                        ("Bridge's own fixture", theirs, False)):
            iteration = max(Path(folder).glob("iter_*"))
            config, _ = load_model_config(str(iteration))
            model = build_and_load_model(str(iteration), _cpu_provider(config,
                                         keep_te_moe_norm_name=te_names),
                                         use_cpu_init=True, skip_temp_dist_context=True)
            got = _params(model)
            # values compared in the import's dtype (exact: both hold the same values); a
            # different dtype is reported (Bridge's bf16 import keeps norms in float32, its
            # loader in bfloat16)
            same = sorted(got) == sorted(want) and all(
                torch.equal(got[k].to(want[k].dtype), want[k]) for k in want)
            recast = sorted({f"{got[k].dtype} for {want[k].dtype}".replace("torch.", "")
                             for k in want if k in got and got[k].dtype != want[k].dtype})
            exported = {k: v.clone() for k, v in bridge.export_hf_weights(model, cpu=True)}
            back = sorted(exported) == sorted(original) and all(
                torch.equal(exported[k].to(original[k].dtype), original[k]) for k in original)
            exact_dtypes = all(exported[k].dtype == original[k].dtype for k in original
                               if k in exported)
            print(f"[{name}] Bridge's load_megatron_model on {label} ({iteration.name}, "
                  f"{type(config).__name__}): {len(got)} parameters, "
                  f"{'all bitwise equal to' if same else 'DIFFERENT from'} Bridge's HF import"
                  f"{' (dtypes: ' + ', '.join(recast) + ')' if recast else ''}; "
                  f"Bridge's HF export {'bitwise equal to' if back else 'DIFFERENT from'} the "
                  f"original ({len(original)} tensors"
                  f"{'' if exact_dtypes else ', some in another dtype: values compared after a cast'})")
            failures += not (same and back)
            if te_names and (iteration / "tokenizer").is_dir():
                from megatron.bridge.training.model_load_save import load_tokenizer
                from transformers import AutoTokenizer

                text = "Repeat the digit 7. Put it in \\boxed{}."
                got_ids = load_tokenizer(str(iteration)).tokenize(text)
                want_ids = AutoTokenizer.from_pretrained(hf_dir).encode(text,
                                                                       add_special_tokens=False)
                print(f"[{name}] Bridge's load_tokenizer on {label}: "
                      f"{'the same ids as' if list(got_ids) == want_ids else 'OTHER ids than'} "
                      f"the original tokenizer")
                failures += list(got_ids) != want_ids
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
