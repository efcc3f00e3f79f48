"""Log-probabilities and entropy over a tensor-parallel vocabulary shard, chunked, no copies.

Rank r of a group of size R holds the columns [r V_l, (r+1) V_l) of the logits (Megatron's
``parallel_output=True``). With x = logits / T (T the sampling temperature), m = max_j x_j and
S = sum_j exp(x_j - m) over all ranks, z = x - m, p = softmax(x), g = dL/dlog p(t), h = dL/dH:

    log p(t) = z_t - log S        H = log S - sum_j p_j z_j
    dL/dlogits_j = ( g (1[j=t] - p_j)  -  h p_j (log p_j + H) ) / T

Per chunk of tokens two all-reduces (MAX of m; SUM of S, sum p z, z_t); ``logits`` is never
written. ``kernel=``: ``"eager"`` torch ops, ``"compiled"`` fused ``torch.compile`` passes,
``"auto"`` compiled where ``compiled_by_default``. Why this form, and what each kernel costs:
docs/training.md#log-probs-over-a-vocabulary-shard."""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dgpo.runtime import comm

log = logging.getLogger(__name__)

KERNELS = ("auto", "eager", "compiled")

# float32 bytes per chunk of the eager kernels (their two work buffers are [chunk, V_l] each):
# cache-sized on CPU; large on GPU, where each chunk costs kernel launches and two all-reduces
_CHUNK_BYTES = {"cpu": 1 << 23, "cuda": 1 << 28}
# logits per chunk of the compiled kernels on GPU: they allocate nothing per chunk, so only the
# per-chunk launches, guard checks and all-reduces count; 2^28 keeps the chunk's index below
# 2^31 (32-bit index arithmetic in the generated kernels). On CPU the eager size (the sums pass
# then reads the chunk from cache after the row max).
_COMPILED_CHUNK_ELEMENTS = 1 << 28


def _resolve_group(group):
    """``group`` if given; else Megatron's TP group if initialised; else None (one process)."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        from megatron_dgpo.runtime import parallel

        if parallel.parallel_initialized():
            return parallel.tensor_parallel_group()
    return None


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(tensor: Tensor, op: str, group, size: int) -> Tensor:
    if size > 1:
        comm.all_reduce_(tensor, op, group)
    return tensor


def default_chunk_size(local_vocab: int, device: torch.device | str = "cpu", *,
                       compiled: bool = False) -> int:
    """Tokens per chunk: one float32 chunk [chunk, V_l] of ~8 MiB (CPU) / ~256 MiB (GPU) for the
    eager kernels; 2^28 logits for the compiled ones on GPU (they hold no chunk buffer)."""
    kind = torch.device(device).type
    if compiled and kind != "cpu":
        return max(1, _COMPILED_CHUNK_ELEMENTS // max(1, local_vocab))
    budget = _CHUNK_BYTES.get(kind, _CHUNK_BYTES["cuda"])
    return max(1, budget // (4 * max(1, local_vocab)))


def compiled_by_default(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``kernel="auto"`` compiles for ``dtype`` logits on ``device``: CUDA with Triton
    importable and the fused passes built and run there in that dtype (``compiled_kernels_work``,
    once per device and dtype). CPU: False, nothing built."""
    device = torch.device(device)
    return _inductor_makes_triton(device) and _compiled_kernels_work_on(device, dtype)


def _inductor_makes_triton(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # a torch without inductor's Triton probe
        return False
    return has_triton()


def compiled_kernels_work(device: torch.device, dtype: torch.dtype) -> bool:
    """Build and run the fused passes for ``dtype`` logits on ``device`` once, as a training step
    calls them (forward and backward of [1, 5, 8] logits in chunks of 2, 2 and 1 rows), compiling
    the graphs later calls reuse. True if they ran; where they do not build, warns with the reason
    and returns False (``"auto"`` then takes the eager kernels for that dtype)."""
    try:
        logits = torch.zeros(1, 5, 8, dtype=dtype, device=device, requires_grad=True)
        targets = torch.zeros(1, 5, dtype=torch.long, device=device)
        # group, rank, size, temperature, chunk, n_valid, entropy_grad, compiled
        logp, entropy = _LogprobsEntropy.apply(logits, targets, None, 0, 1, 1.0, 2, 8, True, True)
        (logp.sum() + entropy.sum()).backward()
        return True
    except Exception as error:  # noqa: BLE001 - any failure to build means: run eager
        log.warning(
            "vocab_parallel: the compiled log-prob kernels do not build for %s logits on %s "
            "(%s: %s); using the eager kernels for them (same results, ~5x the time on a GPU)",
            dtype, device, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return False


@functools.cache
def _compiled_kernels_work_on(device: torch.device, dtype: torch.dtype) -> bool:
    return compiled_kernels_work(device, dtype)


class _EagerChunks:
    """The forward sums and backward gradient of one chunk in torch ops, on float32 work buffers
    [chunk, n_valid] made once per call (a shorter last chunk uses their leading rows). Both take
    the chunk's whole rows [rows, V_l] and leave the TP padding columns (>= n_valid) out."""

    def __init__(self, rows: int, n_valid: int, device, temperature: float):
        self.rows, self.n_valid, self.temperature = rows, n_valid, temperature
        self.f32 = dict(dtype=torch.float32, device=device)
        self.buffers: dict[str, Tensor] = {}

    def _buffer(self, name: str, rows: int) -> Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.rows, self.n_valid, **self.f32)
        return self.buffers[name][:rows]

    def _z(self, chunk: Tensor, m: Tensor, out: Tensor) -> Tensor:
        torch.sub(chunk[:, :self.n_valid], m[:, None], out=out)  # upcasts bf16 on the fly
        if self.temperature != 1.0:
            out.div_(self.temperature)
        return out

    def sums(self, chunk, m, target, hit) -> Tensor:
        """[3, rows]: S = sum_j exp(z_j), sum_j exp(z_j) z_j, and z_t where ``hit`` (the target
        column is in this shard) else 0."""
        rows = chunk.shape[0]
        z = self._z(chunk, m, self._buffer("z", rows))
        sums = torch.empty(3, rows, **self.f32)
        sums[2] = torch.where(hit, z.gather(1, target[:, None]).squeeze(1), 0.0)
        e = torch.exp(z, out=self._buffer("e", rows))
        sums[0] = e.sum(dim=-1)
        sums[1] = torch.linalg.vecdot(e, z)  # sum_j e_j z_j without an [rows, V] product
        return sums

    def grad(self, out, chunk, m, neg_inv_s, c, g, h, target, hit) -> None:
        """Writes the chunk's dL/dlogits into ``out`` [rows, V_l]; g and h are already divided
        by T, neg_inv_s = -1/S, h None without the entropy gradient."""
        rows = chunk.shape[0]
        out[:, self.n_valid:].zero_()  # TP padding columns are outside the distribution
        valid = out[:, :self.n_valid]
        in_place = out.dtype == torch.float32  # work straight in the gradient's rows
        work = self._z(chunk, m, valid if in_place else self._buffer("work", rows))
        if h is not None:
            e = torch.exp(work, out=self._buffer("e", rows))  # S p
            work.sub_(c[:, None]).mul_(h[:, None]).add_(g[:, None])
            work.mul_(e).mul_(neg_inv_s[:, None])  # -p (g + h (log p + H)) / T, log p + H = z - c
        else:
            work.exp_().mul_((g * neg_inv_s)[:, None])  # -g p / T
        work.scatter_add_(1, target[:, None], torch.where(hit, g, 0.0)[:, None])  # + g 1[j=t] / T
        if not in_place:
            valid.copy_(work)


def _z_and_valid(chunk, n_valid, m, temperature):
    """z = (logits - m) / T in float32 over the chunk's whole rows, and the mask of the columns that
    are not TP padding (a mask, not a slice, so that padded and whole shards are one graph)."""
    valid = torch.arange(chunk.shape[1], device=chunk.device) < n_valid
    return (chunk.float() - m[:, None]) / temperature, valid


def _fused_sums(chunk, n_valid, m, target, hit, temperature):
    """``_EagerChunks.sums`` as one expression for inductor: one pass over ``chunk``."""
    z, valid = _z_and_valid(chunk, n_valid, m, temperature)
    e = torch.where(valid, torch.exp(z), 0.0)  # where, not a product: exp(padding) may be inf
    z_t = (chunk.gather(1, target[:, None]).squeeze(1).float() - m) / temperature
    # float64 accumulators, free in a pass bound by memory: inductor's float32 sums add each
    # vector lane sequentially over blocks of 4096 steps on CPU (S off by 1e-5 relative over
    # 152064 columns, measured), and Triton's looped reductions add sequentially per lane too
    sums = torch.stack([e.double().sum(dim=-1),
                        torch.where(valid, e * z, 0.0).double().sum(dim=-1)]).float()
    return torch.cat([sums, torch.where(hit, z_t, 0.0)[None]])


def _fused_grad(out, chunk, n_valid, m, neg_inv_s, c, g, h, target, hit, temperature):
    """``_EagerChunks.grad`` as one expression for inductor: one pass over ``chunk``, the
    result stored into ``out`` (inductor writes the mutated input directly, no temporary)."""
    z, valid = _z_and_valid(chunk, n_valid, m, temperature)
    # h = 0 without the entropy gradient: one graph for both. A select, not a product, so that
    # h = 0 contributes nothing where z = -inf (a logit of -inf), as the eager kernel does
    entropy_term = torch.where(h[:, None] != 0, (z - c[:, None]) * h[:, None], 0.0)
    grad = (g[:, None] + entropy_term) * torch.exp(z) * neg_inv_s[:, None]
    target_column = torch.arange(chunk.shape[1], device=chunk.device) == target[:, None]
    grad = grad + torch.where(target_column & hit[:, None], g[:, None], 0.0)
    out.copy_(torch.where(valid, grad, 0.0))


@functools.cache
def _compile(fn):
    # dynamic=True: the row count, the vocab width and the offsets are symbolic, n_valid and
    # the temperature come in as tensors (inputs, not constants of the graph), and the
    # gradient's h is 0 without the entropy gradient, so one graph serves them all: a graph per
    # function and logits dtype, one more for a 1-row chunk (dynamo specialises sizes 0 and 1)
    # and one for a 1-row first chunk (one-token logits). The inputs go in detached: dynamo
    # guards on an input's requires_grad and on the tensor a view views (duck-sizing its shape
    # with the others'), which made graphs per logits layout and for the forward without grad.
    # tests/algorithm/test_vocab_parallel.py counts them. Compiled lazily: importing this
    # module must not import dynamo.
    return torch.compile(fn, dynamic=True)


class _CompiledChunks:
    """The same two per-chunk functions as ``_EagerChunks``, compiled."""

    def __init__(self, n_valid: int, device, temperature: float):
        # made on the device by a fill, not by a host-to-device copy that would synchronise
        self.n_valid = torch.full((), n_valid, dtype=torch.int64, device=device)
        self.temperature = torch.full((), temperature, dtype=torch.float32, device=device)

    def sums(self, chunk, m, target, hit) -> Tensor:
        return _compile(_fused_sums)(*_detached(chunk, self.n_valid, m, target, hit,
                                                self.temperature))

    def grad(self, out, chunk, m, neg_inv_s, c, g, h, target, hit) -> None:
        _compile(_fused_grad)(*_detached(out, chunk, self.n_valid, m, neg_inv_s, c, g, h, target,
                                         hit, self.temperature))


def _detached(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.detach() for t in tensors)


def _chunk_kernels(compiled: bool, rows: int, n_valid: int, device, temperature: float):
    if compiled:
        return _CompiledChunks(n_valid, device, temperature)
    return _EagerChunks(rows, n_valid, device, temperature)


class _LogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, rank, size, temperature, chunk, n_valid,
                entropy_grad, compiled):
        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)
        tgt = targets.reshape(-1)
        n_tokens = flat.shape[0]
        local_t = tgt - rank * vocab_local
        in_shard = (local_t >= 0) & (local_t < n_valid)
        local_t = torch.where(in_shard, local_t, torch.zeros_like(local_t))

        f32 = dict(dtype=torch.float32, device=logits.device)
        row_max = torch.empty(n_tokens, **f32)
        sum_exp = torch.empty(n_tokens, **f32)  # S
        mean_z = torch.empty(n_tokens, **f32)  # c = sum_j p_j z_j = log S - H
        logp = torch.empty(n_tokens, **f32)
        entropy = torch.empty(n_tokens, **f32)
        kernels = _chunk_kernels(compiled, min(chunk, n_tokens), n_valid, logits.device,
                                 temperature)
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            rows = end - start
            if n_valid > 0:  # max of x/T is max(x)/T for T > 0
                m = flat[start:end, :n_valid].amax(dim=-1).float()
            else:  # this rank holds only TP padding columns
                m = torch.full((rows,), -torch.inf, **f32)
            _all_reduce(m, "max", group, size)
            sums = (kernels.sums(flat[start:end], m, local_t[start:end], in_shard[start:end])
                    if n_valid > 0 else torch.zeros(3, rows, **f32))
            _all_reduce(sums, "sum", group, size)
            ls = sums[0].log()
            row_max[start:end] = m
            sum_exp[start:end] = sums[0]
            mean_z[start:end] = sums[1] / sums[0]
            logp[start:end] = sums[2] - ls
            entropy[start:end] = ls - mean_z[start:end]
        del kernels  # the eager work buffers go before the backward allocates the gradient

        ctx.save_for_backward(logits, local_t, in_shard, row_max, sum_exp, mean_z)
        ctx.setup = (temperature, chunk, n_valid, entropy_grad, compiled)
        logp, entropy = logp.view(targets.shape), entropy.view(targets.shape)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local_t, in_shard, row_max, sum_exp, mean_z = ctx.saved_tensors
        temperature, chunk, n_valid, entropy_grad, compiled = ctx.setup
        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)
        n_tokens = flat.shape[0]
        g = (grad_logp.reshape(-1).float() if grad_logp is not None
             else torch.zeros(n_tokens, dtype=torch.float32, device=logits.device))
        h = grad_entropy.reshape(-1).float() if (entropy_grad and grad_entropy is not None) \
            else None
        # the kernels write every column of a chunk; a rank of TP padding alone gets zeros
        grad = torch.empty_like(flat) if n_valid > 0 else torch.zeros_like(flat)
        g = g / temperature  # fold the 1/T of dx/dlogits into the per-token weights
        h = h / temperature if h is not None else None
        if h is None and compiled:  # h = 0 in the one graph (``_fused_grad``), a slice like
            h = torch.zeros_like(g)  # g's: dynamo duck-sizes the inputs' offsets
        neg_inv_s = -1.0 / sum_exp  # p = exp(z) / S, the 1/S folded into a per-row multiply
        kernels = _chunk_kernels(compiled, min(chunk, n_tokens), n_valid, logits.device,
                                 temperature)
        for start in range(0, n_tokens if n_valid > 0 else 0, chunk):
            end = min(start + chunk, n_tokens)
            kernels.grad(grad[start:end], flat[start:end], row_max[start:end],
                         neg_inv_s[start:end], mean_z[start:end], g[start:end],
                         None if h is None else h[start:end], local_t[start:end],
                         in_shard[start:end])
        return (grad.view(logits.shape),) + (None,) * 9


def logprobs_and_entropy(logits: Tensor, targets: Tensor, *, group=None, temperature: float = 1.0,
                         chunk_size: int | None = None, entropy_grad: bool = False,
                         vocab_size: int | None = None,
                         kernel: str = "auto") -> tuple[Tensor, Tensor]:
    """Per-token log pi(target) and full-vocabulary entropy from this rank's vocab shard:
    ``(logprobs, entropy)``, float32 with the shape of ``targets``; ``logprobs`` differentiable
    w.r.t. ``logits``, ``entropy`` too with ``entropy_grad`` (module docstring for the math).

    ``logits`` [..., V_l]: this rank's contiguous shard, any float dtype, never modified.
    ``targets`` [...]: global token ids. ``group``: the TP group (None: Megatron's if initialised,
    else one process). ``temperature`` divides the logits as the sampler does. ``chunk_size``:
    tokens per chunk (default ``default_chunk_size``). ``vocab_size``: the real vocabulary, columns
    >= it being TP padding (default V_l x group size). ``kernel``: "eager", "compiled" or "auto"
    (module docstring). Raises ``TypeError`` / ``ValueError`` on other dtypes, shapes or kernels."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor")
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError("targets must be an integer torch.Tensor of token ids")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: "
                         f"logits must be targets.shape + (V_local,)")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    group = _resolve_group(group)
    rank, size = _group_rank_size(group)
    vocab_local = logits.shape[-1]
    total = vocab_local * size
    vocab_size = total if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= total:
        raise ValueError(f"vocab_size={vocab_size} must lie in (0, V_local * TP = {total}]")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"targets must lie in [0, vocab_size={vocab_size}); got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    compiled = kernel == "compiled" or (kernel == "auto"
                                        and compiled_by_default(logits.device, logits.dtype))
    chunk = int(chunk_size) if chunk_size else default_chunk_size(vocab_local, logits.device,
                                                                  compiled=compiled)
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
    n_valid = max(0, min(vocab_local, vocab_size - rank * vocab_local))
    return _LogprobsEntropy.apply(logits, targets.long(), group, rank, size, float(temperature),
                                  chunk, n_valid, bool(entropy_grad), compiled)
