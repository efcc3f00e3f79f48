"""Transformers rollout engine: a fallback where vLLM is unavailable, and the throughput baseline.

Same contract as ``VLLMEngine`` (see ``megatron_dgpo.rollout.base``). It runs in-process with
``model.generate`` on left-padded batches; log-probs are ``log_softmax`` of the processed scores
(temperature / top-p applied), so with temperature 1.0 and top-p 1.0 they are the model's
log-softmax. Seeds: prompt i is sampled under ``torch.manual_seed(seeds[i])`` (``s + i n`` for
a call with ``seed=s``, as vLLM), one prompt per generate call when seeds are given, so results do not
depend on batching (slower, which is why the benchmark passes ``seed=None``). Its ``n`` samples
are the rows of that one generator's batched draws, so they take disjoint parts of one stream;
vLLM instead gives sample j the stream ``seeds[i] + j``. Either way the trainer's seeds
(``placement.prompt_seeds``: one per global prompt index, spaced by the group size) give every
(step, prompt, sample) of a run its own random numbers: here each prompt of the run owns a
generator seed no other prompt uses. Samples differ from vLLM's for the same seed (different
random streams); distributions are the same.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from megatron_dgpo.rollout.base import RolloutEngine, Completion, check_generate_args


class HFEngine(RolloutEngine):
    """``RolloutEngine`` on a transformers causal LM. model: an HF folder or a loaded model."""

    def __init__(self, model, *, dtype: torch.dtype = torch.float32, device: str = "cpu", batch_size: int = 64):
        from transformers import AutoModelForCausalLM

        if isinstance(model, (str, os.PathLike)):
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        self.model = model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_id = int(pad if pad is not None else next(iter(self.eos_ids)))

    @torch.no_grad()
    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``seeds[i]`` (or ``seed + i n``) seeds prompt i's generator, which draws all its ``n``
        samples (see the module docstring)."""
        check_generate_args(prompts_token_ids, n, temperature, top_p, max_tokens)
        results: list[list[Completion]] = [[] for _ in prompts_token_ids]
        if seeds is not None:
            if seed is not None or len(seeds) != len(prompts_token_ids):
                raise ValueError("generate: give seed or one seed per prompt (seeds), not both")
        elif seed is not None:
            seeds = [seed + i * n for i in range(len(prompts_token_ids))]
        if seeds is not None:
            groups = [[i] for i in range(len(prompts_token_ids))]
        else:
            per_call = max(1, self.batch_size // n)
            groups = [list(range(s, min(s + per_call, len(prompts_token_ids)))) for s in range(0, len(prompts_token_ids), per_call)]
        for group in groups:
            with torch.random.fork_rng(devices=[]):
                if seeds is not None:
                    torch.manual_seed(int(seeds[group[0]]))
                self._generate_group(prompts_token_ids, group, n, temperature, top_p, max_tokens, results)
        return results

    def _generate_group(self, prompts, group, n, temperature, top_p, max_tokens, results) -> None:
        width = max(len(prompts[i]) for i in group)
        ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, i in enumerate(group):  # left padding: every prompt ends at the same column
            p = torch.tensor(list(prompts[i]), dtype=torch.long)
            ids[row, width - len(p):] = p
            mask[row, width - len(p):] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_tokens,
            num_return_sequences=n,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
        new_tokens = out.sequences[:, width:].cpu()  # [B*n, T]
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [B*n, T, V], processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        for k in range(new_tokens.shape[0]):
            toks = new_tokens[k].tolist()
            length, reason = len(toks), "length"
            for t, tok in enumerate(toks):
                if tok in self.eos_ids:
                    length, reason = t + 1, "stop"
                    break
            prompt_index = group[k // n]
            results[prompt_index].append(Completion(prompt_index, toks[:length], logprobs[k, :length].tolist(), reason))

    def update_weights(self, groups: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        state = self.model.state_dict()
        new = {}
        for name, tensor in (pair for group in groups for pair in group):
            if name not in state:
                raise KeyError(f"update_weights: unknown tensor {name!r} for {type(self.model).__name__}")
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(state[name].shape)}")
            new[name] = tensor
        missing = set(state) - set(new)
        if self.model.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise KeyError(f"update_weights: stream lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
        self.model.load_state_dict(new, strict=False)
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()

    def update_weights_from_dir(self, hf_dir: str | os.PathLike) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"update_weights_from_dir: no *.safetensors in {hf_dir}")
        pairs = []
        for f in files:
            pairs += list(load_file(str(f)).items())
        self.update_weights([pairs])  # one load_state_dict: no fused group to keep whole

    def shutdown(self) -> None:
        self.model = None
