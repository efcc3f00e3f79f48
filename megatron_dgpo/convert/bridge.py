"""Megatron-Bridge's Megatron checkpoints (what NeMo-RL, verl and Miles write): found, described
as this project's checkpoints are, and written for Bridge's loader (docs/checkpoints.md).

A Bridge checkpoint folder (``save_megatron_model`` or Bridge's training loop)::

    <dir>/latest_checkpointed_iteration.txt   the latest iteration (Megatron-LM's tracker)
    <dir>/latest_train_state.pt
    <dir>/iter_0000100/                       one iteration: torch_dist files of the model
        run_config.yaml    Bridge's ConfigContainer; ``model`` is the GPTModelProvider
        train_state.pt
        tokenizer/         the HF tokenizer's files (when saved with one)

``bridge_iteration`` finds the iteration folder; its ``run_config.yaml`` gives the HF config
(``bridge_provider``); ``adopt_original_generation`` takes the stop ids from the HF original its
``hf_model_id`` names; ``write_bridge_files`` writes the container around a conversion's tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from megatron_dgpo.convert.bridge_provider import hf_config_from_provider, provider_fields
from megatron_dgpo.convert.guards import described
from megatron_dgpo.runtime.errors import InputError, MissingInputError

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.yaml"
TRACKER = "latest_checkpointed_iteration.txt"
TOKENIZER_DIR = "tokenizer"
TRAIN_STATE = "train_state.pt"
FIRST_ITERATION = "iter_0000000"
"""The iteration folder ``save_megatron_model`` writes, and ``dgpo-convert --format bridge``."""
COMMON_STATE = {"checkpoint_version": 3.0, "iteration": 0}
"""What Bridge's saver puts in a checkpoint's common state (its ``generate_state_dict``)."""
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""The sharded-state-dict metadata Bridge records (and passes back to ``sharded_state_dict``)."""
_ITER = re.compile(r"^iter_(\d{7})$")



def _iteration_dir(folder: str, tracker: str) -> str:
    with open(tracker, encoding="utf-8") as handle:
        text = handle.read().strip()
    if text == "release":
        return os.path.join(folder, "release")
    if not text.isdigit():
        raise InputError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    return os.path.join(folder, f"iter_{int(text):07d}")


def bridge_iteration(path: str) -> str | None:
    """The iteration folder of a Megatron-Bridge checkpoint at ``path`` (an ``iter_*`` folder, or
    its parent: the iteration ``latest_checkpointed_iteration.txt`` names), or None when
    ``path`` is no Bridge checkpoint (no ``run_config.yaml``, no tracker, no ``iter_*`` folder).

    Raises ``MissingInputError`` naming what is missing for a partial one: a parent without
    the tracker, a tracker naming an absent iteration, an iteration without ``run_config.yaml``.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, RUN_CONFIG)):
        return path
    tracker = os.path.join(path, TRACKER)
    iterations = sorted(n for n in os.listdir(path) if _ITER.match(n) or n == "release")
    if os.path.isfile(tracker):
        folder = _iteration_dir(path, tracker)
        if not os.path.isdir(folder):
            raise MissingInputError(f"missing folder: {folder} ({tracker} names it; the checkpoint "
                                    f"holds {iterations or 'no iteration folder'})")
    elif iterations:
        raise MissingInputError(f"missing file: {tracker} (a Megatron-Bridge checkpoint folder "
                                f"names its latest iteration there; it holds {iterations}: pass "
                                f"one of them instead)")
    elif (_ITER.match(os.path.basename(os.path.normpath(path)))
          and os.path.isfile(os.path.join(path, "metadata.json"))):
        folder = path  # a torch_dist iteration folder without its run_config.yaml
    else:
        return None
    if not os.path.isfile(os.path.join(folder, RUN_CONFIG)):
        raise MissingInputError(f"missing file: {os.path.join(folder, RUN_CONFIG)} (Megatron-"
                                f"Bridge's model config; a Megatron-LM checkpoint has none: "
                                f"describe it with megatron_dgpo.convert.write_metadata)")
    return folder


def read_run_config(iteration_dir: str) -> dict:
    """``run_config.yaml`` of an iteration folder as a plain dict (``_target_`` entries kept)."""
    import yaml

    path = os.path.join(iteration_dir, RUN_CONFIG)
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise InputError(f"{path}: no 'model' section (Megatron-Bridge writes the model's "
                         f"provider there)")
    return config


def write_bridge_files(out_dir: str, iteration_dir: str, hf_config, dtype: torch.dtype, *,
                       hf_dir: str | None = None, final_dir: str | None = None) -> None:
    """Everything of a Bridge checkpoint folder besides the torch_dist files of
    ``iteration_dir`` (a folder under ``out_dir``): ``run_config.yaml``, both train-state files,
    the tracker and ``tokenizer/`` (the tokenizer and generation-config files of ``hf_dir``).
    ``final_dir``: where ``out_dir`` will be renamed to (the paths ``run_config.yaml`` records).
    Call on one rank."""
    import yaml

    from megatron_dgpo.convert.safetensors_io import SIDE_FILES, copy_side_files

    tokenizer = os.path.join(iteration_dir, TOKENIZER_DIR)
    has_tokenizer = hf_dir is not None and any(
        os.path.isfile(os.path.join(hf_dir, n)) for n in SIDE_FILES if n.startswith("tokenizer"))
    run_config = {
        "model": provider_fields(hf_config, dtype,
                                 hf_model_id=hf_dir and os.path.abspath(hf_dir)),
        # what Bridge's training resume reads (_load_checkpoint_from_path)
        "checkpoint": {"ckpt_format": "torch_dist", "save_optim": False, "save_rng": False,
                       "fully_parallel_save": True},
        "tokenizer": None,
    }
    if has_tokenizer:
        # config.json too: AutoTokenizer takes the tokenizer's class from its model_type
        copy_side_files(hf_dir, tokenizer)
        run_config["tokenizer"] = {
            "_target_": "megatron.bridge.training.tokenizers.config.TokenizerConfig",
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": os.path.abspath(os.path.join(
                final_dir or out_dir, os.path.relpath(tokenizer, out_dir)))}
    with open(os.path.join(iteration_dir, RUN_CONFIG), "w", encoding="utf-8") as handle:
        yaml.safe_dump(run_config, handle, sort_keys=False)
    zero = torch.tensor(0)
    train_state = {"step": zero, "consumed_train_samples": zero, "skipped_train_samples": zero,
                   "consumed_valid_samples": zero,
                   "floating_point_operations_so_far": torch.tensor(0.0),
                   "do_train": torch.tensor(False), "do_valid": torch.tensor(False),
                   "do_test": torch.tensor(False)}
    torch.save(train_state, os.path.join(iteration_dir, TRAIN_STATE))
    torch.save(train_state, os.path.join(out_dir, f"latest_{TRAIN_STATE}"))
    iteration = _ITER.match(os.path.basename(iteration_dir))
    with open(os.path.join(out_dir, TRACKER), "w", encoding="utf-8") as handle:
        handle.write(str(int(iteration.group(1))))


def original_hf_folder(iteration_dir: str, model: dict) -> tuple[Path | None, str]:
    """``(folder, "")``: the HF original a provider (``model``, of the checkpoint at
    ``iteration_dir``) names in ``hf_model_id``: a folder (a relative path as given, or beside
    the checkpoint folder, where Bridge ran when its ``checkpoint.save`` was relative), or a hub
    id's config files at ``hf_model_revision`` from this machine's HF cache (fetched unless
    ``HF_HUB_OFFLINE=1``); ``(None, why)`` when there is none."""
    name = model.get("hf_model_id")
    if not name:
        return None, "is not set"
    for folder in (Path(name), Path(iteration_dir).parent.parent / name):
        if (folder / "config.json").is_file():
            return folder, ""
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(name, revision=model.get("hf_model_revision"),
                                        allow_patterns=["config.json", "generation_config.json"]))
    except Exception as exc:  # noqa: BLE001 - any failure only means: not found here
        return None, (f"is neither a folder here nor a hub repo this machine can read "
                      f"({type(exc).__name__})")
    return (folder, "") if (folder / "config.json").is_file() else (None, "has no config.json")


def _tokenizer_eos(folder: Path) -> str:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"none known: no tokenizer could be read ({type(exc).__name__})"
    if tokenizer.eos_token_id is None:
        return "none: the tokenizer has no EOS token"
    return f"[{tokenizer.eos_token_id}] ({tokenizer.eos_token!r}, the tokenizer's EOS)"


def adopt_original_generation(iteration_dir: str, out: Path, shown_as: Path) -> None:
    """Give ``out``, the HF folder converted from the Bridge checkpoint at ``iteration_dir``
    (which holds no ``generation_config.json``), its HF original's stop ids
    (``original_hf_folder``): that folder's ``generation_config.json`` and its config.json's
    special token ids; an original describing another model is not used. Without one, one
    warning names the stop ids a run from ``shown_as`` (where ``out`` is published) uses."""
    run_config = os.path.join(iteration_dir, RUN_CONFIG)
    model = read_run_config(iteration_dir)["model"]
    origin, why = original_hf_folder(iteration_dir, model)
    if origin is not None:
        with open(origin / "config.json", encoding="utf-8") as handle:
            theirs = json.load(handle)
        try:
            same = described(theirs, str(origin)).dims == described(
                hf_config_from_provider(model, run_config), run_config).dims
        except InputError:
            same = False
        if not same:
            origin, why = None, f"names {origin}, whose config.json describes another model"
    if origin is None:
        log.warning("%s holds no generation_config.json and its hf_model_id %r %s: a run from %s "
                    "stops at %s only; copy the original model's generation_config.json there "
                    "to stop where it does", iteration_dir, model.get("hf_model_id"), why,
                    shown_as, _tokenizer_eos(out))
        return
    if (origin / "generation_config.json").is_file():
        shutil.copyfile(origin / "generation_config.json", out / "generation_config.json")
    with open(out / "config.json", encoding="utf-8") as handle:
        ours = json.load(handle)
    ours.update({key: theirs[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                 if key in theirs})
    with open(out / "config.json", "w", encoding="utf-8") as handle:
        json.dump(ours, handle, indent=2, sort_keys=True)
    log.info("%s: generation config and special token ids from its HF original %s", shown_as,
             origin)
