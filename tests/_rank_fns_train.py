"""Rank functions for tests/training/test_train_step.py: one mini-batch, many ways of splitting it."""

from __future__ import annotations

import math

import torch

from tests._rank_fns_model import (TINY_QWEN2, gather_tensor, global_name, hf_model,
                                   hf_to_megatron_full, load_full_state)

LENGTHS = (9, 24, 13, 17, 20, 11, 15, 22)
PROMPTS = (4, 6, 3, 5, 7, 4, 6, 5)
METHOD = "dgpo"
HYPER = dict(eps_low=0.2, eps_high=0.28)  # LossHyperparams(**HYPER)


def sequences():
    """The mini-batch: 8 sequences of unequal lengths with masks, old log-probs, advantages."""
    gen = torch.Generator().manual_seed(11)
    vocab = TINY_QWEN2["vocab_size"]
    out = []
    for i, (n, prompt) in enumerate(zip(LENGTHS, PROMPTS)):
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.arange(n) >= prompt
        # near-uniform random model: log pi ~ -log V; spread old log-probs across all regions
        old = -math.log(vocab) + 0.4 * torch.randn(n, generator=gen)
        adv = torch.full((n,), (1.0 if i % 3 else -1.0) * (0.5 + 0.1 * i))
        out.append((tokens, mask, old, adv))
    return out


# Prompt groups for the aggregation cases: sequence i answers prompt i % 4 (4 groups of 2), so
# a group's two responses sit 4 apart: in different micro-batches and, at DP 2 and 4, on
# different DP ranks. The filter case drops groups 2 and 3, which at DP 4 leaves rank 1 with
# no kept token at all.
GROUP_SIZE, NUM_GROUPS, DROPPED_GROUPS, TIS_CAP = 2, 4, (2, 3), 1.2
CASES = {  # name -> (aggregation, drop degenerate groups, TIS)
    "group": ("group_token_mean", False, False),
    "seq": ("seq_mean_token_mean", False, False),
    "drop": ("token_mean", True, False),
    "group_drop_tis": ("group_token_mean", True, True),
}


def case_weights(case: str) -> torch.Tensor | None:
    """[8] float64 per-sequence aggregation weights of ``case`` (None: unweighted), computed by
    ``losses.sample_loss_weights`` on the group-major order of the sequences."""
    from megatron_dgpo.algorithm.losses import sample_loss_weights

    aggregation, drop, _ = CASES[case]
    order = sorted(range(len(LENGTHS)), key=lambda i: (i % NUM_GROUPS, i))  # group-major
    lengths = torch.tensor([LENGTHS[i] - PROMPTS[i] for i in order])
    keep = torch.tensor([i % NUM_GROUPS not in DROPPED_GROUPS for i in order]) if drop else None
    weights = sample_loss_weights(lengths, GROUP_SIZE, aggregation, keep)
    if weights is None:
        return None
    out = torch.zeros(len(LENGTHS), dtype=torch.float64)
    out[order] = weights
    return out


def rollout_logprobs():
    """The rollout engine's log-probs of each sequence: old log-probs + noise (TIS cases)."""
    gen = torch.Generator().manual_seed(12)
    return [old + 0.5 * torch.randn(len(old), generator=gen) for _, _, old, _ in sequences()]


def _attach_case(mb, idx: list[int], case: str):
    """Fill ``loss_weights`` / ``rollout_logprobs`` of a padded micro-batch of sequences idx
    (row r holds sequence idx[r] at offset r * width; values shifted like old_logprobs)."""
    weights, rollout = case_weights(case), rollout_logprobs()
    width = int(mb.cu_seqlens[1])
    if weights is not None:
        mb.loss_weights = torch.zeros(len(mb.tokens), dtype=torch.float64)
    if CASES[case][2]:
        mb.rollout_logprobs = torch.zeros(len(mb.tokens))
    for row, i in enumerate(idx):
        span = slice(row * width, row * width + LENGTHS[i] - 1)
        if weights is not None:
            mb.loss_weights[span] = weights[i]
        if CASES[case][2]:
            mb.rollout_logprobs[span] = rollout[i][1:]
    return mb


def micro_batch_indices(dp_rank: int, dp_size: int, n_micro: int) -> list[list[int]]:
    """Global sequence indices of each micro-batch: a contiguous DP share, strided pieces."""
    per = len(LENGTHS) // dp_size
    mine = list(range(dp_rank * per, (dp_rank + 1) * per))
    return [mine[k::n_micro] for k in range(n_micro) if mine[k::n_micro]]  # unequal lengths


def micro_batches(dp_rank: int, dp_size: int, n_micro: int, case: str | None = None,
                  only: list[int] | None = None):
    """This DP rank's share of the sequences cut into ``n_micro`` padded pieces (with the loss
    fields of ``case``; ``only``: just those sequences)."""
    from megatron_dgpo.algorithm.packing import padded_micro_batch

    seqs = sequences()
    out = []
    for idx in micro_batch_indices(dp_rank, dp_size, n_micro):
        idx = [i for i in idx if only is None or i in only]
        if not idx:
            continue
        mb = padded_micro_batch([seqs[i][0] for i in idx], [seqs[i][1] for i in idx],
                                [seqs[i][2] for i in idx], [seqs[i][3] for i in idx])
        out.append(_attach_case(mb, idx, case) if case else mb)
    return out


def forward_error(models, dp_rank, dp_size, n_micro, want_logp, want_ent) -> float:
    """Max |forward_logprobs - reference| over every real position of this rank's sequences."""
    from megatron_dgpo.training.train_step import forward_logprobs

    mbs = micro_batches(dp_rank, dp_size, n_micro)
    outputs = forward_logprobs(models, mbs)
    err = 0.0
    for (logp, ent), mb, idx in zip(outputs, mbs, micro_batch_indices(dp_rank, dp_size, n_micro)):
        for row, i in enumerate(idx):
            n, start = LENGTHS[i] - 1, int(mb.cu_seqlens[row])
            err = max(err, float((logp[start:start + n] - want_logp[i, :n]).abs().max()),
                      float((ent[start:start + n] - want_ent[i, :n]).abs().max()))
    return err


def packed_micro_batches(n_rows: int):
    """All sequences packed into ``n_rows`` micro-batches (block-diagonal causal attention),
    right-padded to one width: the padding is its own (masked) sample."""
    from megatron_dgpo.algorithm.packing import MicroBatch, padded_micro_batch

    seqs = sequences()
    rows = []
    for r in range(n_rows):
        parts = [padded_micro_batch([t], [m], [o], [a]) for t, m, o, a in seqs[r::n_rows]]
        rows.append({k: torch.cat([getattr(p, k) for p in parts]) for k in
                     ("tokens", "position_ids", "targets", "loss_mask", "old_logprobs",
                      "advantages")})
        rows[-1]["lengths"] = [len(p.tokens) for p in parts]
    width = max(len(row["tokens"]) for row in rows)
    out = []
    for row in rows:
        extra = width - len(row["tokens"])
        lengths = row.pop("lengths") + ([extra] if extra else [])
        padded = {k: torch.cat([v, torch.zeros(extra, dtype=v.dtype)]) for k, v in row.items()}
        cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        out.append(MicroBatch(**padded, cu_seqlens=cu_seqlens))
    return out


def _build(cfg, tp, pp):
    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.training.policy import wrap_ddp
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=5)
    chunks = build_model(cfg)
    load_full_state(chunks, hf_to_megatron_full(hf_model(cfg).state_dict(), cfg))
    return wrap_ddp(chunks)


def _grads(models, vocab):
    """{global name: full-shape main_grad} of this rank's chunks; padded-row grads checked 0."""
    out, pad_ok = {}, True
    for model in models:
        module = model.module
        for name, param in module.named_parameters():
            grad = param.main_grad
            full = gather_tensor(name, grad, param, vocab_size=10**9)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                # exact: padded rows are never looked up and their logit columns are zeroed:
                # their gradient is a sum of zeros
                pad_ok &= bool((full[vocab:] == 0).all())
                full = full[:vocab]
            out[global_name(module, name)] = full.clone()
    return out, pad_ok


def _step(models, mbs, case: str | None = None):
    from megatron_dgpo.algorithm.losses import LossConfig, LossHyperparams
    from megatron_dgpo.training.train_step import train_step

    extra = {}
    if case:
        aggregation, _, tis = CASES[case]
        extra = dict(loss_aggregation=aggregation, rollout_correction="tis" if tis else "none",
                     rollout_correction_cap=TIS_CAP)
    return train_step(models, mbs, LossConfig(method=METHOD, loss=LossHyperparams(**HYPER),
                                              **extra))


def _case_loss64(mb, logp, case: str) -> float:
    """The case's loss in float64 from ``losses`` directly: weights per token, W = their sum."""
    from megatron_dgpo.algorithm.losses import (LossConfig, LossHyperparams, behaviour_weights,
                                                policy_loss)

    valid = mb.loss_mask.clone()
    weights = torch.ones(len(valid), dtype=torch.float64)
    if mb.loss_weights is not None:
        valid &= mb.loss_weights > 0
        weights = mb.loss_weights.double()
    normaliser = torch.where(valid, weights, 0.0).sum()
    if CASES[case][2]:
        tis = LossConfig(rollout_correction="tis", rollout_correction_cap=TIS_CAP)
        weights = weights * behaviour_weights(tis, mb.old_logprobs, mb.rollout_logprobs, valid)[0]
    loss, _ = policy_loss(METHOD, logp.double(), mb.old_logprobs.double(), mb.advantages.double(),
                          valid, LossHyperparams(**HYPER), num_tokens=normaliser, weights=weights)
    return float(loss)


def _case_runs(models, vocab, dp_rank, dp_size, n_micro) -> dict:
    """{case: (StepResult, grads)} for every aggregation case."""
    out = {}
    for case in CASES:
        res = _step(models, micro_batches(dp_rank, dp_size, n_micro, case), case)
        out[case] = (res, _grads(models, vocab)[0])
    return out


def reference_fn(rank, world_size):
    """Single rank: the reference (1 micro-batch) and the 2/4/8-micro-batch runs."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.algorithm.losses import LossHyperparams, policy_loss
    from megatron_dgpo.runtime.parallel import destroy_parallel
    from megatron_dgpo.training.train_step import forward_logprobs

    vocab = TINY_QWEN2["vocab_size"]
    results = {}
    for tied in (False, True):
        cfg = dict(TINY_QWEN2, tie_word_embeddings=tied)
        models = _build(cfg, 1, 1)
        ref = _step(models, micro_batches(0, 1, 1))
        grads, pad_ok = _grads(models, vocab)
        runs = {}
        for n_micro in (2, 4, 8):
            res = _step(models, micro_batches(0, 1, n_micro))
            runs[n_micro] = (res, _grads(models, vocab)[0])
        res = _step(models, packed_micro_batches(2))  # 2 packed micro-batches
        runs["packed"] = (res, _grads(models, vocab)[0])

        # aggregation / TIS / filter cases: one micro-batch (the reference) and 8 (each
        # sequence alone, so every group straddles micro-batches)
        cases = {case: dict(loss=res.loss, metrics=res.metrics, grads=grads_, summary=res.summary,
                            num_tokens=res.num_tokens)
                 for case, (res, grads_) in _case_runs(models, vocab, 0, 1, 1).items()}
        case_splits = _case_runs(models, vocab, 0, 1, 8)
        kept = [i for i in range(len(LENGTHS)) if i % NUM_GROUPS not in DROPPED_GROUPS]
        kept_only = _step(models, micro_batches(0, 1, 1, only=kept))
        kept_only = dict(loss=kept_only.loss, num_tokens=kept_only.num_tokens,
                         metrics=kept_only.metrics, grads=_grads(models, vocab)[0])
        # Eq. 1 / the sequence mean from the token-mean path alone: the mean over groups
        # (samples) of the token-mean loss and gradient of that group (sample) by itself
        by_definition = {}
        for case, members in (("group", [[i for i in range(len(LENGTHS)) if i % NUM_GROUPS == g]
                                         for g in range(NUM_GROUPS)]),
                              ("seq", [[i] for i in range(len(LENGTHS))])):
            losses_, grads_ = [], []
            for only in members:
                losses_.append(_step(models, micro_batches(0, 1, 1, only=only)).loss)
                grads_.append(_grads(models, vocab)[0])
            by_definition[case] = dict(
                loss=sum(losses_) / len(members),
                grads={k: sum(g[k].double() for g in grads_) / len(members) for k in grads_[0]})
        nothing_kept = micro_batches(0, 1, 2, "drop")
        for mb in nothing_kept:
            mb.loss_weights.zero_()
        res = _step(models, nothing_kept, "drop")
        zero_grads = _grads(models, vocab)[0].values()
        nothing_kept = dict(loss=res.loss, num_tokens=res.num_tokens,
                            grad_max=max(float(g.abs().max()) for g in zero_grads))

        # temperature != 1 and the loss value against independent references
        mb = micro_batches(0, 1, 1)[0]
        temperature = 0.8
        (logp, entropy), = forward_logprobs(models, [mb], temperature=temperature)
        rows = len(mb.cu_seqlens) - 1  # one right-padded sequence per row
        logp, entropy = logp.view(rows, -1), entropy.view(rows, -1)
        with torch.no_grad():
            logits = hf_model(cfg)(mb.tokens.view(rows, -1)).logits.double() / temperature
        logsm = torch.log_softmax(logits, -1)
        want_logp = logsm.gather(-1, mb.targets.view(rows, -1)[..., None]).squeeze(-1)
        want_ent = -(logsm.exp() * logsm).sum(-1)
        (logp1, ent1), = forward_logprobs(models, [mb])
        loss64, _ = policy_loss(METHOD, logp1.double(), mb.old_logprobs.double(),
                                mb.advantages.double(), mb.loss_mask, LossHyperparams(**HYPER))
        for case in CASES:
            cases[case]["loss64"] = _case_loss64(_attach_case(micro_batches(0, 1, 1)[0],
                                                              list(range(len(LENGTHS))), case),
                                                 logp1, case)
        results[tied] = dict(
            loss=ref.loss, num_tokens=ref.num_tokens, metrics=ref.metrics, summary=ref.summary,
            grads=grads, pad_ok=pad_ok, runs=runs,
            temp_logp_err=float((logp.double() - want_logp).abs().max()),
            temp_ent_err=float((entropy.double() - want_ent).abs().max()),
            loss64=float(loss64), n_params=ps.get_tensor_model_parallel_world_size(),
            cases=cases, case_splits=case_splits, kept_only=kept_only,
            nothing_kept=nothing_kept, by_definition=by_definition,
            logp=logp1.view(rows, -1), entropy=ent1.view(rows, -1))
        destroy_parallel()
    return results


LAYOUTS = ((1, 1, 2), (2, 1, 4), (1, 2, 4), (2, 2, 8))  # (TP, PP, micro-batches per DP rank)


class CrossingObjects:
    """Records every object ``comm.broadcast_object`` / ``comm.gather_objects`` send while
    active, and the tensors inside them (found by pickling: any container, any depth)."""

    def __init__(self):
        self.objects, self.tensors = 0, 0

    def __enter__(self):
        import io
        import pickle

        from megatron_dgpo.runtime import comm

        recorder = self

        class Counter(pickle.Pickler):
            def reducer_override(self, obj):
                if isinstance(obj, torch.Tensor):
                    recorder.tensors += 1
                return NotImplemented

        def recording(original):
            def call(obj, *args, **kwargs):
                if obj is not None:
                    self.objects += 1
                    Counter(io.BytesIO()).dump(obj)
                return original(obj, *args, **kwargs)
            return call

        self._saved = comm.broadcast_object, comm.gather_objects
        comm.broadcast_object = recording(comm.broadcast_object)
        comm.gather_objects = recording(comm.gather_objects)
        return self

    def __exit__(self, *exc):
        from megatron_dgpo.runtime import comm

        comm.broadcast_object, comm.gather_objects = self._saved


def split_fn(rank, world_size, reference):
    """Every layout of LAYOUTS on 4 ranks, tied and untied: errors vs the single-rank run."""
    from megatron.core import parallel_state as ps

    from megatron_dgpo.runtime.parallel import destroy_parallel

    vocab = TINY_QWEN2["vocab_size"]
    out = []
    for tp, pp, n_micro in LAYOUTS:
        for tied in (False, True):
            cfg = dict(TINY_QWEN2, tie_word_embeddings=tied)
            want = reference[tied]
            models = _build(cfg, tp, pp)
            dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            with CrossingObjects() as crossing:
                res = _step(models, micro_batches(dp_rank, dp_size, n_micro))
            grads, pad_ok = _grads(models, vocab)
            fwd_err = forward_error(models, dp_rank, dp_size, n_micro, want["logp"],
                                    want["entropy"])
            cases = {case: compare(case_res, case_grads, want["cases"][case])
                     for case, (case_res, case_grads)
                     in _case_runs(models, vocab, dp_rank, dp_size, n_micro).items()}
            out.append(dict(layout=(tp, pp, dp_size, n_micro), tied=tied, fwd_err=fwd_err,
                            **compare(res, grads, want), pad_ok=pad_ok, cases=cases,
                            crossing=(crossing.objects, crossing.tensors)))
            destroy_parallel()
    return out


def compare(res, grads, want) -> dict:
    """Worst relative differences of loss, metrics and gradients against ``want``."""
    def rel(a, b):
        a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
        if not torch.isfinite(b).all():
            # exact: a non-finite reference is a sentinel (+-inf, the min / max over no
            # token), not a rounded value
            return 0.0 if torch.equal(a, b) else math.inf
        return float((a - b).abs().max() / b.abs().max().clamp(min=1.0))

    grad_err, covered = 0.0, []
    for name, grad in grads.items():
        key = name
        if name == "output_layer.weight" and name not in want["grads"]:  # tied, last stage
            key = "embedding.word_embeddings.weight"
        ref = want["grads"][key]
        grad_err = max(grad_err, float((grad.double() - ref.double()).abs().max()
                                        / ref.double().abs().max()))
        covered.append(name)
    metric_err = max(rel(res.metrics[k], want["metrics"][k]) for k in want["metrics"])
    return dict(loss_err=rel(res.loss, want["loss"]), metric_err=metric_err, grad_err=grad_err,
                metric_keys=sorted(res.metrics), covered=covered, num_tokens=res.num_tokens,
                summary=res.summary)


def overlap_and_logits_fn(rank, world_size):
    """DP = world_size. (1) Overlapped grad reduce (the GPU's DDP setting) gives the gradients of
    the plain reduction on a mini-batch of 4 micro-batches that follows one of 2 (RL updates
    pack into varying counts; Megatron's bucket counts are learnt on the first one, so only
    ``no_sync`` for all but the last micro-batch keeps them right). (2) A bf16 model in
    Float16Module returns bf16 logits through DDP with the train step's forward kwargs, fp32
    by Megatron's default."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron_dgpo.models.builder import build_model
    from megatron_dgpo.training.policy import wrap_ddp
    from megatron_dgpo.runtime.parallel import ParallelConfig, initialize_parallel
    from megatron_dgpo.training.train_step import _forward_kwargs

    initialize_parallel(ParallelConfig(), seed=5)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    grads = {}
    for overlap in (False, True):
        chunks = build_model(TINY_QWEN2)
        load_full_state(chunks, hf_to_megatron_full(hf_model(TINY_QWEN2).state_dict(),
                                                    TINY_QWEN2))
        models = wrap_ddp(chunks, overlap_grad_reduce=overlap)
        _step(models, micro_batches(dp_rank, dp_size, 2))
        _step(models, micro_batches(dp_rank, dp_size, 4))
        grads[overlap] = {n: p.main_grad.clone() for n, p in models[0].module.named_parameters()}
    overlap_err = max(float((grads[True][n] - grads[False][n]).abs().max() /
                            grads[False][n].abs().max()) for n in grads[False])

    chunk = build_model(TINY_QWEN2, dtype=torch.bfloat16, bf16=True)[0]
    model = wrap_ddp([Float16Module(chunk.config, chunk)])[0]
    mb = micro_batches(0, 1, 1)[0]
    inputs = (mb.tokens[None], mb.position_ids[None], mb.attention_mask())
    kept = model(*inputs, **_forward_kwargs(model))
    default = model(*inputs)
    return dict(dp_size=dp_size, overlap_err=overlap_err, kwargs=_forward_kwargs(model),
                plain_kwargs=_forward_kwargs(models[0]), kept_dtype=str(kept.dtype),
                default_dtype=str(default.dtype),
                # exact: the same forward; fp32_output=False only skips the last bf16 -> fp32 cast
                same_values=bool(torch.equal(kept.float(), default)))
