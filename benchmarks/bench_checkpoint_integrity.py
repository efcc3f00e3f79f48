"""What checkpoint checksums cost on a real save and load (issue 45).

One gloo rank saves a Qwen2-shaped model with Megatron's optimizer state (Adam moments after
one update) through ``checkpoint.save_checkpoint`` and loads it back through
``load_checkpoint``, and prints each part's seconds and its share of the save or the load:

* the CRC taken as the writer writes (save with the writer hook against the plain writer);
* the read-back before publishing (``checkpoint.verify``: save with it against without it);
* the verification before a resume (``verify_checkpoint``), against the load it precedes;
* Megatron-Core's own ``verify_integrity`` option for comparison (SHA-256 of every file re-read
  by rank 0 after the save).

    python benchmarks/bench_checkpoint_integrity.py [--hidden 1024 --layers 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path


def _build(hidden: int, layers: int, vocab: int):
    import torch

    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.recipe import OptimizerConfig
    from megatron_dgpo.training.optimizer import build_optimizer
    from megatron_dgpo.training.policy import wrap_ddp

    hf_config = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=vocab,
                     hidden_size=hidden, intermediate_size=4 * hidden,
                     num_hidden_layers=layers, num_attention_heads=hidden // 64,
                     num_key_value_heads=hidden // 128, max_position_embeddings=2048,
                     rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
                     tie_word_embeddings=False)
    models = wrap_ddp(build_model(hf_config, seed=0))
    optimizer = build_optimizer(OptimizerConfig(lr=1e-4), models, lr=1e-4, bf16=False)
    for param in models[0].parameters():  # one update: Adam's moments exist and are saved
        param.main_grad.copy_(torch.randn_like(param) * 1e-3)
    optimizer.step()
    return models, optimizer, hf_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)

    import torch
    from megatron.core.dist_checkpointing import validation
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dgpo.convert import single_process_group
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training import checkpoint, integrity

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    hook, common = integrity.install_writer_hook, integrity.record_common
    with single_process_group():
        initialize_parallel(ParallelConfig(), seed=1)
        models, optimizer, hf_config = _build(args.hidden, args.layers, args.vocab)
        meta = dict(hf_config=hf_config, padded_vocab_size=args.vocab, dtype=torch.float32)

        def save(step: int, *, hashed: bool, verify: bool) -> float:
            integrity.install_writer_hook = hook if hashed else (lambda: None)
            integrity.record_common = common if hashed else (lambda folder: None)
            if not hashed:
                filesystem_async.open = open
            begin = time.perf_counter()
            checkpoint.save_checkpoint(root, checkpoint.TrainerState(step=step), models,
                                       optimizer, keep_last=1, verify=verify, **meta)
            return time.perf_counter() - begin

        times: dict[str, list[float]] = {}
        step = 1
        save(step, hashed=True, verify=True)  # warm-up: the writer's result queue starts
        variants = [("plain writer", False, False), ("CRC as written", True, False),
                    ("CRC as written + read-back", True, True)]
        for repeat in range(args.repeats):
            for name, hashed, verify in variants[repeat % 3:] + variants[:repeat % 3]:
                step += 1
                times.setdefault(name, []).append(save(step, hashed=hashed, verify=verify))
            step += 1  # a checkpoint with its checksums to verify and load (untimed)
            path = root / checkpoint.checkpoint_name(step)
            save(step, hashed=True, verify=False)
            for name, call in (("verify", lambda: checkpoint.verify_checkpoint(path)),
                               ("load", lambda: checkpoint.load_checkpoint(path, models, optimizer)),
                               ("megatron sha256", lambda: validation.save_integrity_manifest(str(path)))):
                begin = time.perf_counter()
                call()
                times.setdefault(name, []).append(time.perf_counter() - begin)
            data = [f.read_bytes() for f in path.glob("*.distcp")]
            begin = time.perf_counter()
            for chunk in data:
                zlib.crc32(chunk)
            times.setdefault("crc", []).append(time.perf_counter() - begin)
        integrity.install_writer_hook, integrity.record_common = hook, common
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    best = {name: min(values) for name, values in times.items()}
    plain = best["plain writer"]
    rows = [
        ("save, plain writer (baseline)", plain, "-"),
        ("CRC-32 of the shards' bytes (the writer's added work)", best["crc"],
         f"{best['crc'] / plain:.1%} of the save"),
        ("save, CRC as written", best["CRC as written"],
         f"{(best['CRC as written'] - plain) / plain:+.1%} of the save (noise: disk)"),
        ("read-back before publishing (verify_checkpoint, page cache hot)", best["verify"],
         f"{best['verify'] / plain:.1%} of the save"),
        ("save, CRC as written + read-back (checkpoint.verify)", best["CRC as written + read-back"],
         f"{(best['CRC as written + read-back'] - plain) / plain:+.1%} of the save (noise: disk)"),
        ("load (load_checkpoint)", best["load"], "-"),
        ("verification before the resume (verify_checkpoint)", best["verify"],
         f"{best['verify'] / best['load']:.1%} of the load"),
        ("Megatron's verify_integrity manifest (SHA-256, re-read)", best["megatron sha256"],
         f"{best['megatron sha256'] / plain:.1%} of the save"),
    ]
    print(f"checkpoint {size / 2**20:.0f} MiB (hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}, fp32 weights + Adam), best of {args.repeats}, one rank")
    print("| what | seconds | cost |\n| --- | --- | --- |")
    for name, seconds, cost in rows:
        print(f"| {name} | {seconds:.2f} | {cost} |")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
