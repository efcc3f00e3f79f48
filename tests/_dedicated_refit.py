"""Run by ``tests/rollout/test_weight_broadcast.py`` under torchrun (2 ranks): rank 0 plays the trainer's
exporting rank, rank 1 a dedicated engine in its own world (``parallel.split_world``).

    python -m torch.distributed.run --nproc-per-node 2 tests/_dedicated_refit.py A B BUCKET OUT

Rank 0 streams model B's HF tensors (grouped by the family map, as the export yields them)
through ``run_bucketed_refit`` + ``send_bucket`` over a ``comm.PeerGroup``; rank 1 starts vLLM on model A
(not from random weights as the trainer's engines: vLLM refuses a reload from a folder then),
reloads each received bucket, samples, then reloads A and B fully from their folders
(``update_weights_from_dir``) and samples again with the same seeds. Rank 1 writes what it
saw to OUT (JSON): the names of each received bucket and both samplings.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(model_a: str, model_b: str, bucket_bytes: int, out: str) -> None:
    from megatron_dgpo.rollout.dedicated.wire import receive_bucket, send_bucket
    from megatron_dgpo.runtime import comm
    from megatron_dgpo.runtime.parallel import init_distributed, launch_store, split_world

    init_distributed(timeout_minutes=5, rollout_ranks=1)
    side = split_world(1)
    link = comm.PeerGroup(launch_store(5), "test/refit", 0 if side.role == "trainer" else 1, 2,
                          device_backend="gloo", timeout=timedelta(minutes=5))
    if side.role == "trainer":
        from megatron_dgpo.rollout.refit import run_bucketed_refit
        from tests.conftest import hf_groups

        stats = run_bucketed_refit(hf_groups(model_b), bucket_bytes,
                                   lambda bucket: send_bucket(link, bucket))
        link.broadcast_object({"kind": "end"})
        assert link.recv_object(1) == stats.buckets
        return

    from megatron_dgpo.rollout.vllm_engine import VLLMConfig, VLLMEngine

    engine = VLLMEngine(VLLMConfig(model=model_a, dtype="float32", max_model_len=128,
                                   max_num_seqs=16, kv_cache_memory_bytes=32 << 20,
                                   placement="colocated"))
    received = []
    engine.begin_refit()
    while (message := link.broadcast_object(None))["kind"] == "bucket":
        bucket = receive_bucket(link, message["tensors"])
        received.append([name for name, _ in bucket])
        engine.load_bucket(bucket)
    engine.end_refit()
    link.send_object(len(received), 0)

    prompts = [[5, 17, 23, 42, 7], [11, 3, 9], [30, 31, 32, 33, 34, 35]]

    def sample():
        groups = engine.generate(prompts, n=4, max_tokens=12, seeds=[101, 202, 303])
        return [[c.token_ids, c.logprobs] for g in groups for c in g]

    by_broadcast = sample()
    engine.update_weights_from_dir(model_a)
    on_a = sample()
    engine.update_weights_from_dir(model_b)
    by_reload = sample()
    engine.shutdown()
    Path(out).write_text(json.dumps({"buckets": received,
                                     "broadcast": by_broadcast, "reload": by_reload, "a": on_a}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
