"""A run's inputs, checked before anything expensive: ``dgpo-train`` and ``dgpo-sft`` run
``check_run`` / ``check_sft`` on every rank before torch.distributed starts and before a model
is built, so a mistake costs seconds and is one ``InputError`` naming the key, file or line.

* the model (``model_config``): ``model.path`` an HF folder (a config.json of a supported
  architecture, every safetensors shard its index lists present and as long as its header
  says, a tokenizer), a Megatron checkpoint (validated by its reader), or a hub id found in
  this node's HF cache or on the hub; ``model.tiny``'s fields;
* the layout (``check_layout``): the world size against TP x CP x PP and the expert grid, TP
  against attention heads, KV groups (divided, or a multiple of them) and the FFN width, PP (x VPP) against layers, EP against
  experts, with the torchrun command that fits;
* the data: the prompt (or SFT) file read whole (encoding, JSON, fields, with file and line),
  the held-out benchmarks, and, when the model's tokenizer is at hand, at least one prompt
  within ``rollout.max_prompt_tokens``.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import struct
from pathlib import Path

from megatron_dgpo.models import describe
from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.runtime.hub import HUB_FILES
from megatron_dgpo.tasks import prompts

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
"""One of these sets makes a tokenizer transformers can load."""


def check_run(cfg, *, world_size: int, relaunch: str) -> None:
    """Check the RL recipe ``cfg`` (``recipe.RunConfig``) for a torchrun world of
    ``world_size`` ranks; ``relaunch`` is the command after ``torchrun --nproc-per-node N``."""
    check_layout(cfg.parallel, world_size, None, rollout_ranks=cfg.rollout.num_gpus,
                 relaunch=relaunch)  # the cheap checks first
    records = prompts.training_prompts(cfg.data)
    if cfg.eval.enabled:
        prompts.resolve_benchmarks(cfg.eval.benchmarks, cfg.eval.benchmarks_dir,
                                   limit=cfg.eval.limit)
    hf_config, folder = model_config(cfg.model)
    check_layout(cfg.parallel, world_size, hf_config, rollout_ranks=cfg.rollout.num_gpus,
                 relaunch=relaunch)
    if folder is not None:  # else the tokenizer is made (model.tiny) or fetched at start
        prompts.fitting_prompts(records, _tokenizer(folder, cfg.model.path),
                                cfg.rollout.max_prompt_tokens, source=cfg.data.source,
                                first_only=True)


def check_sft(cfg, *, world_size: int, relaunch: str) -> None:
    """Check the supervised recipe ``cfg`` (``sft.SFTRunConfig``) as ``check_run`` does."""
    check_layout(cfg.parallel, world_size, None, relaunch=relaunch)
    prompts.load_sft_pairs(cfg.sft.data, prompt_key=cfg.sft.prompt_field,
                           response_key=cfg.sft.response_field)
    check_layout(cfg.parallel, world_size, model_config(cfg.model)[0], relaunch=relaunch)


def model_config(config) -> tuple[dict | None, Path | None]:
    """``(hf_config, folder)`` of the policy ``config`` (``policy.ModelConfig``) names: the HF
    config when it can be read now (None for a hub id not in this node's cache) and the local
    HF folder holding its tokenizer (None for ``model.tiny``, a Megatron checkpoint or a hub id
    still to be fetched). Raises ``InputError`` on any fault found."""
    if config.tiny is not None:
        from megatron_dgpo.tasks.tiny import tiny_config

        try:
            return _described(tiny_config(**config.tiny), "model.tiny"), None
        except (TypeError, ValueError) as exc:
            raise InputError(f"model.tiny: {exc}") from None
    path = Path(config.path)
    if path.exists():
        if not path.is_dir():
            raise InputError(f"model.path: {config.path} is a file; expected an HF model folder "
                             f"(config.json, safetensors, tokenizer) or a Megatron checkpoint")
        checkpoint = _megatron_checkpoint(config.path)
        if checkpoint is not None:
            return _described(checkpoint.meta["hf_config"], f"model.path {config.path}"), None
        return check_hf_folder(path, f"model.path {config.path}"), path
    return _hub_model(config.path)


def check_hf_folder(folder: Path, what: str, *, trainable: bool = True) -> dict:
    """The HF config of model folder ``folder`` after checking that a run can start from it:
    config.json (with ``trainable``, of an architecture the trainer builds), the safetensors
    shards whole, a tokenizer. ``what`` names the folder in messages."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise InputError(f"{what}: no config.json there: not an HF model folder, and no Megatron "
                         f"checkpoint (dgpo_convert.json, or Megatron-Bridge's run_config.yaml or "
                         f"latest_checkpointed_iteration.txt)")
    hf_config = _json(config_file)
    if trainable:
        _described(hf_config, what)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{index}: no weight_map")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise InputError(f"{what}: {len(missing)} of the {len(shards)} shards "
                             f"{INDEX_FILE} lists are missing: {', '.join(missing[:4])}"
                             f"{', ...' if len(missing) > 4 else ''} (an incomplete download "
                             f"or copy?)")
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        if not shards:
            raise InputError(f"{what}: no safetensors weights (model.safetensors or {INDEX_FILE}"
                             f" and its shards); .bin checkpoints are not read: save the model "
                             f"with safe_serialization=True")
    for shard in shards:
        check_safetensors_file(folder / shard)
    if not any(all((folder / f).is_file() for f in files) for files in TOKENIZER_FILES):
        raise InputError(f"{what}: no tokenizer (tokenizer.json, tokenizer.model, or vocab.json "
                         f"and merges.txt): copy the tokenizer files of the model in")
    return hf_config


def check_safetensors_file(path: Path) -> None:
    """``InputError`` unless ``path`` is as long as its safetensors header says (8 bytes of
    header length, the JSON header, then the tensors' bytes up to the largest end offset)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or 8 + length > size:
            raise InputError(f"{path}: {size} bytes, too short for its safetensors header "
                             f"(truncated: an interrupted download or copy?)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InputError(f"{path}: not a safetensors file (its header is not JSON)") from None
    end = max((entry["data_offsets"][1] for name, entry in header.items()
               if name != "__metadata__"), default=0)
    if size != 8 + length + end:
        state = "truncated" if size < 8 + length + end else "longer than its tensors"
        raise InputError(f"{path}: {size} bytes where its header describes {8 + length + end}: "
                         f"{state} (an interrupted download or copy?)")


def check_layout(parallel, world_size: int, hf_config: dict | None, *, rollout_ranks: int = 0,
                 relaunch: str) -> None:
    """``InputError`` unless ``parallel`` (``ParallelConfig``) splits the torchrun world of
    ``world_size`` ranks (the last ``rollout_ranks`` of them dedicated engines) and, when
    ``hf_config`` is known, the model."""
    tp, pp, cp = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.context_parallel
    ep, etp = parallel.expert_parallel, parallel.etp
    replica, experts_grid = tp * cp * pp, etp * ep * pp
    unit = math.lcm(replica, experts_grid)
    trainers = world_size - rollout_ranks
    if trainers < 1 or trainers % unit:
        sizes = (f"tensor_parallel x context_parallel x pipeline_parallel = {tp} x {cp} x {pp}"
                 + (f" and expert_tensor_parallel x expert_parallel x pipeline_parallel = "
                    f"{etp} x {ep} x {pp}" if unit != replica else ""))
        engines = f" plus rollout.num_gpus={rollout_ranks} engine ranks" if rollout_ranks else ""
        have = (f"{world_size} rank{'s' if world_size > 1 else ''}"
                + (f" ({trainers} for the trainer)" if rollout_ranks else ""))
        need = max(trainers // unit, 1) * unit + rollout_ranks
        raise InputError(f"parallel: the trainer's ranks must be a multiple of {sizes} = {unit}"
                         f"{engines}; this job has {have}. Start {need}: "
                         f"{torchrun_command(need, relaunch)}")
    if hf_config is None:
        return
    dims = describe(hf_config).dims
    problems = []
    if dims.heads % tp:
        problems.append(f"parallel.tensor_parallel={tp} does not divide the {dims.heads} "
                        f"attention heads")
    if not _splits_kv_groups(tp, dims.kv_heads):
        problems.append(f"parallel.tensor_parallel={tp} neither divides the {dims.kv_heads} KV "
                        f"groups (num_key_value_heads) nor is a multiple of them (Megatron-Core "
                        f"then gives each rank one group)")
    if not dims.moe and dims.ffn % tp:
        problems.append(f"parallel.tensor_parallel={tp} does not divide the FFN width "
                        f"{dims.ffn} (intermediate_size)")
    chunks = pp * (parallel.vpp or 1)
    if dims.layers % chunks:
        problems.append(f"parallel.pipeline_parallel={pp}" + (
            f" x virtual_pipeline_parallel={parallel.vpp}" if parallel.vpp else "")
            + f" does not divide the {dims.layers} layers")
    if dims.moe and dims.experts % ep:
        problems.append(f"parallel.expert_parallel={ep} does not divide the {dims.experts} experts")
    if dims.moe and dims.moe_ffn % etp:
        problems.append(f"the expert tensor-parallel size {etp} does not divide the experts' "
                        f"FFN width {dims.moe_ffn} (moe_intermediate_size)")
    if problems:
        splits = [t for t in range(1, 9) if not (dims.heads % t or (not dims.moe and dims.ffn % t))
                  and _splits_kv_groups(t, dims.kv_heads)]
        raise InputError("; ".join(problems) + f" (TP sizes up to 8 that split this model: "
                         f"{', '.join(map(str, splits))}; `dgpo-plan` lists the layouts that fit)")


def _splits_kv_groups(tp: int, kv_groups: int) -> bool:
    """Megatron-Core splits the KV groups over TP, or with fewer groups than TP ranks gives
    each rank one (``Attention.__init__``): either TP divides them or they divide TP."""
    return kv_groups % tp == 0 or tp % kv_groups == 0


def torchrun_command(ranks: int, relaunch: str) -> str:
    """``torchrun`` starting ``ranks`` ranks on 8-GPU nodes (one node up to 8)."""
    nodes = f"--nnodes {ranks // 8} --nproc-per-node 8" if ranks > 8 and ranks % 8 == 0 \
        else f"--nproc-per-node {ranks}"
    return f"torchrun {nodes} {relaunch}"


def relaunch_args(module: str, argv: list[str]) -> str:
    """The part of a command line after ``torchrun ...``: ``-m module argv...``."""
    return shlex.join(["-m", module, *argv])


def _described(hf_config: dict, what: str) -> dict:
    try:
        describe(hf_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{what}: config.json: {exc}") from None
    return hf_config


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None


def _megatron_checkpoint(path: str):
    from megatron_dgpo.convert import find_model_checkpoint

    try:
        return find_model_checkpoint(path)
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"model.path {path}: a Megatron checkpoint that cannot be read: "
                         f"{exc}") from None


def _tokenizer(folder: Path, path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises is the message
        raise InputError(f"model.path {path}: its tokenizer does not load: "
                         f"{type(exc).__name__}: {exc}") from None


def _hub_model(repo_id: str) -> tuple[dict | None, Path | None]:
    """A ``model.path`` that is no folder here: a hub id in this node's HF cache (checked like
    a folder), or one the hub knows (asked by rank 0 only; fetched at start)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    here = f"model.path: {repo_id} is no folder here (working directory {os.getcwd()})"
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise InputError(f"{here}, nor a hub id (org/name)") from None
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in this node's cache
        cached = None
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        found = f": its cached snapshot is {cached}" if cached else ", and it is not cached here"
        raise InputError(f"{here}, and HF_HUB_OFFLINE=1 forbids fetching the hub id "
                         f"(docs/launching.md): set model.path to a folder every node sees"
                         f"{found}")
    if cached is not None:
        return check_hf_folder(cached, f"model.path {repo_id} (cached at {cached})"), cached
    if os.environ.get("RANK", "0") == "0":
        _ask_the_hub(repo_id, here)
    return None, None


def _ask_the_hub(repo_id: str, here: str) -> None:
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(repo_id, timeout=10)
    except GatedRepoError:
        raise InputError(f"{here}; {repo_id} is a gated model on the hub: accept its license "
                         f"there and log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise InputError(f"{here}, and the hub has no model {repo_id} (a typo? a private model "
                         f"needs `hf auth login` or HF_TOKEN)") from None
    except Exception as exc:  # noqa: BLE001 - no network, a proxy, a timeout: all one answer
        raise InputError(f"{here}, not in this node's HF cache ({constants.HF_HUB_CACHE}), and "
                         f"the hub cannot be reached ({type(exc).__name__}): fetch it where "
                         f"there is network (`hf download {repo_id}`) into a cache every node "
                         f"sees, or set model.path to a local folder") from None
