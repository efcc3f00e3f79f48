"""``dgpo-convert``: HF <-> Megatron-Core (torch_dist) checkpoint conversion.

    dgpo-convert hf-to-megatron HF_DIR OUT_DIR [--tp 2 --pp 2 --ep 2] [--dtype bfloat16]
    dgpo-convert hf-to-megatron HF_DIR OUT_DIR --format bridge     # for Megatron-Bridge
    dgpo-convert megatron-to-hf CKPT_DIR OUT_DIR [--dtype bfloat16] [--max-shard-gb 5]
    ... [--overwrite]                                              # replace OUT_DIR whole

hf-to-megatron with max(tp, ep) * pp > 1 spawns that many local gloo processes, or runs
collectively when started under torchrun (world size a multiple of it). The checkpoint loads
at any TP/PP/EP either way. ``--format bridge`` writes Megatron-Bridge's container (NeMo-RL,
verl): ``iter_0000000/`` with ``run_config.yaml``. megatron-to-hf reads this project's
checkpoints (converted or from training) and Megatron-Bridge's (an ``iter_*`` folder or its
parent, whose latest iteration it takes), in one process (not under torchrun). OUT_DIR appears
whole or not at all: a non-empty one is replaced only with --overwrite, a training run's
checkpoints never. A mistake in the input is one line and exit status 2, before any rank
starts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from megatron_dgpo.runtime.errors import InputError, reported_as

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_OVERWRITE = ("replace a non-empty OUT_DIR whole (never a training run's checkpoints)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgpo-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_mg = sub.add_parser("hf-to-megatron", help="HF folder -> torch_dist checkpoint")
    to_mg.add_argument("hf_dir")
    to_mg.add_argument("out_dir")
    to_mg.add_argument("--tp", type=int, default=1, help="tensor-parallel layout to write with")
    to_mg.add_argument("--pp", type=int, default=1, help="pipeline-parallel layout to write with")
    to_mg.add_argument("--ep", type=int, default=1,
                       help="expert-parallel layout to write with (MoE models)")
    to_mg.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                       help="stored dtype (default: the HF tensors' dtype)")
    to_mg.add_argument("--format", choices=("dgpo", "bridge"), default="dgpo",
                       help="container: this project's (default) or Megatron-Bridge's "
                            "(written at tp = pp = ep = 1)")
    to_mg.add_argument("--overwrite", action="store_true", help=_OVERWRITE)
    to_hf = sub.add_parser("megatron-to-hf", help="torch_dist checkpoint (this project's or "
                                                  "Megatron-Bridge's) -> HF folder")
    to_hf.add_argument("ckpt_dir")
    to_hf.add_argument("out_dir")
    to_hf.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                       help="safetensors dtype (default: the original HF dtype)")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0)
    to_hf.add_argument("--overwrite", action="store_true", help=_OVERWRITE)
    return parser


@reported_as("dgpo-convert")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch.distributed as dist

    from megatron_dgpo.convert import hf_to_megatron, megatron_to_hf
    from megatron_dgpo.runtime.parallel import init_distributed

    dtype = _DTYPES[args.dtype] if args.dtype else None
    world = int(os.environ.get("WORLD_SIZE", "1"))  # > 1: started by torchrun
    own_group = world > 1 and not dist.is_initialized()
    if args.command == "hf-to-megatron":
        if own_group:  # collective over torchrun's world (hf_to_megatron checks its size)
            init_distributed()
        try:
            hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, ep=args.ep,
                           dtype=dtype, progress=True, format=args.format,
                           overwrite=args.overwrite)
        finally:
            if own_group:
                dist.destroy_process_group()
    else:
        if world > 1:
            raise InputError(f"megatron-to-hf runs in one process; this is one of {world} "
                             f"torchrun ranks: start it without torchrun")
        if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
            raise InputError(f"--max-shard-gb must be a number > 0, got {args.max_shard_gb}")
        megatron_to_hf(args.ckpt_dir, args.out_dir, dtype=dtype,
                       max_shard_bytes=int(args.max_shard_gb * 1024**3), progress=True,
                       overwrite=args.overwrite)
    print(f"wrote {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
