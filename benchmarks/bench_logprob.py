"""Benchmark: log-probs over a TP vocab shard, forward + backward, memory and time.

Compares, on the Qwen2 vocabulary (152064) and N tokens, at TP = 1 (one process) and TP = 2
(two gloo processes, each holding its [N, V/2] shard; the max over ranks is reported):

* ``dgpo``      megatron_dgpo.algorithm.vocab_parallel.logprobs_and_entropy (log-probs AND entropy):
                the eager kernels (the CPU default) at the default chunk and two others, and
                the compiled ones (``kernel="compiled"``, inductor's C++ backend here), each
                also with the entropy gradient (``entropy_grad=True``, loss sum log p + sum H);
                the compiled rows after one untimed call that compiles (its seconds are
                printed in a row of their own);
* ``naive``     full-vocabulary ``log_softmax`` + ``gather`` (TP = 2: all-gather the shards
                first, differentiably);
* ``megatron``  ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (log-probs only;
                it overwrites its input logits, so it gets a private copy made before measuring).

Memory: peak extra resident memory of forward + backward (gradient w.r.t. the logits included),
in multiples of the logits shard. Method: Linux peak-RSS high-water mark. Before each run the
inputs are resident, ``/proc/self/clear_refs`` is written with ``5`` to reset VmHWM to the
current RSS, and after the run ``VmHWM - RSS_before`` is the peak extra memory. Large torch CPU
tensors are mmap'ed by glibc and returned on free, so RSS follows the live tensors (no
sampling thread, no allocator cache in between). tracemalloc cannot see torch's allocations. The ranks run with
``MALLOC_MMAP_THRESHOLD_=1048576`` so that glibc's dynamic mmap threshold does not keep freed
chunks of up to 32 MiB on the heap (which would inflate RSS).

Time: forward + backward wall time (best of ``--repeats``) in multiples of one float32
read+write pass over the shard, ``torch.add(shard, 1, out=buf)``, measured in the same process.
One torch thread per process (the machine is shared).

    python benchmarks/bench_logprob.py [--tokens 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

QWEN2_VOCAB = 152064


def _rss_kib() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _hwm_kib() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmHWM:\s+(\d+)", handle.read()).group(1))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _measure(fn, repeats: int, group, setup=None) -> tuple[float, int]:
    """(best seconds, worst peak extra bytes) of ``fn()`` over ``repeats`` runs."""
    best, peak = float("inf"), 0
    for _ in range(repeats):
        if setup is not None:
            setup()
        gc.collect()
        if group is not None:
            dist.barrier(group)
        before = _rss_kib()
        _reset_hwm()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        peak = max(peak, (_hwm_kib() - before) * 1024)
    return best, peak


def _rank_main(rank, world, port, tokens, vocab, repeats, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import tensor_parallel

    from megatron_dgpo.algorithm.vocab_parallel import logprobs_and_entropy
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_parallel=world))
    group = dist.group.WORLD if world > 1 else None
    width = vocab // world
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(tokens, width, generator=gen) * 3.0
    targets = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(99))
    shard_bytes = shard.numel() * shard.element_size()

    buf = torch.empty_like(shard)
    torch.add(shard, 1, out=buf)
    one_pass, _ = _measure(lambda: torch.add(shard, 1, out=buf), repeats + 2, None)
    exp_pass, _ = _measure(lambda: torch.exp(shard, out=buf), repeats, None)
    del buf

    leaf = shard.requires_grad_(True)

    def dgpo(chunk=None, kernel="eager", entropy_grad=False):
        def run():
            logp, entropy = logprobs_and_entropy(leaf, targets, chunk_size=chunk, kernel=kernel,
                                                 entropy_grad=entropy_grad)
            (logp.sum() + entropy.sum() if entropy_grad else logp.sum()).backward()
            leaf.grad = None
        return run

    def naive():
        if world > 1:
            parts = torch.distributed.nn.functional.all_gather(leaf)
            full = torch.cat(parts, dim=-1)
        else:
            full = leaf
        logp = torch.log_softmax(full, dim=-1).gather(-1, targets[:, None])
        del full
        logp.sum().backward()
        leaf.grad = None

    def megatron(copies):
        def run():
            logits = copies.pop()  # a private copy: Megatron overwrites its input
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
            del logits
            (-loss).sum().backward()
            leaf.grad = None
        return run

    results = {}
    from megatron_dgpo.algorithm.vocab_parallel import default_chunk_size

    chunk = default_chunk_size(width)
    compile_start = time.perf_counter()
    for entropy_grad in (False, True):  # the first calls compile; none is measured
        dgpo(kernel="compiled", entropy_grad=entropy_grad)()
    compile_seconds = time.perf_counter() - compile_start
    for name, fn in ((f"dgpo chunk={chunk} (CPU default: eager)", dgpo()),
                     ("dgpo chunk=64", dgpo(64)),
                     ("dgpo chunk=256", dgpo(256)),
                     (f"dgpo chunk={chunk}, entropy_grad", dgpo(entropy_grad=True)),
                     (f"dgpo compiled chunk={chunk}", dgpo(kernel="compiled")),
                     (f"dgpo compiled chunk={chunk}, entropy_grad",
                      dgpo(kernel="compiled", entropy_grad=True)),
                     ("naive log_softmax+gather", naive)):
        results[name] = _measure(fn, repeats, group)
    copies = []
    results["megatron vocab_parallel_cross_entropy"] = _measure(
        megatron(copies), repeats, group,
        setup=lambda: copies.append(shard.detach().clone().requires_grad_(True)))
    torch.save(dict(one_pass=one_pass, exp_pass=exp_pass, shard_bytes=shard_bytes, results=results,
                    compile_seconds=compile_seconds),
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tp: int, tokens: int, vocab: int, repeats: int) -> dict:
    # Fixed mmap threshold: every allocation >= 1 MiB is mmap'ed and unmapped on free, so RSS
    # tracks live tensors (glibc's dynamic threshold would keep freed chunks on the heap).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(tp, _free_port(), tokens, vocab, repeats, out_dir),
                           nprocs=tp, start_method="spawn", join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(tp)]
    rows = {}
    for name in ranks[0]["results"]:
        rows[name] = (max(r["results"][name][0] / r["one_pass"] for r in ranks),
                      max(r["results"][name][1] / r["shard_bytes"] for r in ranks),
                      max(r["results"][name][0] for r in ranks))
    rows = {"one fp32 exp pass, torch.exp(shard, out=buf) (compute reference)": (
        max(r["exp_pass"] / r["one_pass"] for r in ranks), None,
        max(r["exp_pass"] for r in ranks)), **rows}
    return dict(rows=rows, shard_mb=ranks[0]["shard_bytes"] / 2**20,
                one_pass_ms=1e3 * max(r["one_pass"] for r in ranks),
                compile_seconds=max(r["compile_seconds"] for r in ranks))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=QWEN2_VOCAB)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    print(f"tokens={args.tokens} vocab={args.vocab} float32 logits, 1 torch thread per rank")
    print(f"| TP | shard | method | extra memory (x shard) | time (x one pass) | time |")
    print(f"| --- | --- | --- | --- | --- | --- |")
    for tp in args.tp:
        res = run(tp, args.tokens, args.vocab, args.repeats)
        shard = f"[{args.tokens}, {args.vocab // tp}] {res['shard_mb']:.0f} MiB"
        print(f"| {tp} | {shard} | one fp32 read+write pass (baseline) | - | 1.0 | "
              f"{res['one_pass_ms']:.0f} ms |")
        for name, (t_rel, m_rel, seconds) in res["rows"].items():
            memory = "-" if m_rel is None else f"{m_rel:.2f}"  # None: a timing reference only
            print(f"| {tp} | {shard} | {name} | {memory} | {t_rel:.1f} | "
                  f"{1e3 * seconds:.0f} ms |")
        print(f"| {tp} | {shard} | dgpo compiled: the first calls (compiling, entropy_grad off "
              f"and on) | - | - | {res['compile_seconds']:.1f} s |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
