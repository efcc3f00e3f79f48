"""A built-in task in the paper's regime: column addition with the carries written out, a short
worked chain before the boxed sum (why this task: docs/reproduction.md#setup):

    prompt:   "What is 478+385? Add column by column with carries, then put the sum in \\boxed{}."
    response: "8+5+0=13. 7+8+1=16. 4+3+1=8. \\boxed{863}"

``make_task(out_dir)`` writes, disjoint by operand pair: ``sft.jsonl`` (supervised pairs),
``train.jsonl`` (RL prompts in DAPO-Math-17k's layout), ``heldout.jsonl`` (problems for ``dgpo-eval
--benchmarks``) and ``initial_model/`` (a random tiny Qwen2 whose tokenizer splits digits).
CLI: ``python -m megatron_dgpo.arithmetic OUT_DIR [--digits 3] [--seed 0]``."""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_dgpo.runtime.errors import InputError, reported_as

PROG = "python -m megatron_dgpo.arithmetic"

INSTRUCTION = "Add column by column with carries, then put the sum in \\boxed{}."


@dataclass(frozen=True)
class TaskSizes:
    """How many problems of each split ``make_task`` writes (disjoint operand pairs)."""

    sft: int = 6000
    """Supervised warm-start pairs."""
    train: int = 3000
    """RL training prompts."""
    heldout: int = 200
    """Held-out evaluation problems."""


def prompt_text(a: int, b: int) -> str:
    """The user message asking for a + b."""
    return f"What is {a}+{b}? {INSTRUCTION}"


def worked_solution(a: int, b: int, digits: int) -> str:
    """The column-by-column solution of a + b, units first: every column ``x+y+c=s`` with c the
    carry in (0 or 1), the last carry the sum's leading digit, then the boxed sum."""
    columns, carry = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        total = x + y + carry
        columns.append(f"{x}+{y}+{carry}={total}.")
        carry = total // 10
    return " ".join(columns) + f" \\boxed{{{a + b}}}"


def operand_pairs(digits: int, count: int, seed: int) -> list[tuple[int, int]]:
    """``count`` distinct ordered pairs of ``digits``-digit numbers, in a seeded random order."""
    low, high = 10 ** (digits - 1), 10**digits - 1
    space = (high - low + 1) ** 2
    if count > space:
        raise InputError(f"{count} problems asked for, only {space} distinct {digits}-digit pairs "
                         f"exist: use more digits")
    rng = random.Random(seed)
    chosen: dict[tuple[int, int], None] = {}
    while len(chosen) < count:
        chosen.setdefault((rng.randint(low, high), rng.randint(low, high)))
    return list(chosen)


def corpus(pairs: list[tuple[int, int]], digits: int) -> list[str]:
    """Chat-formatted prompt + solution texts (the tokenizer's training corpus)."""
    return [f"<|im_start|>user\n{prompt_text(a, b)}<|im_end|>\n<|im_start|>assistant\n"
            f"{worked_solution(a, b, digits)}<|im_end|>\n" for a, b in pairs]


def make_task(out_dir: str | Path, *, digits: int = 3, seed: int = 0, sizes: TaskSizes = TaskSizes(),
              model_overrides: dict | None = None) -> Path:
    """Write the task's splits and its initial random policy under ``out_dir`` (see the module
    docstring). Deterministic in (digits, seed, sizes, model_overrides). Returns ``out_dir``."""
    from megatron_dgpo.tasks.tiny import make_tiny_model

    if digits < 1:
        raise InputError(f"digits must be >= 1, got {digits}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file; the task is written into a folder")
    out.mkdir(parents=True, exist_ok=True)
    pairs = operand_pairs(digits, sizes.sft + sizes.train + sizes.heldout, seed)
    sft, train, heldout = (pairs[: sizes.sft], pairs[sizes.sft: sizes.sft + sizes.train],
                           pairs[sizes.sft + sizes.train:])
    _write_jsonl(out / "sft.jsonl", [
        {"prompt": [{"role": "user", "content": prompt_text(a, b)}],
         "response": worked_solution(a, b, digits), "id": f"sft-{i}"} for i, (a, b) in enumerate(sft)])
    _write_jsonl(out / "train.jsonl", [
        {"prompt": [{"role": "user", "content": prompt_text(a, b)}],
         "reward_model": {"ground_truth": str(a + b)}, "id": f"train-{i}"}
        for i, (a, b) in enumerate(train)])
    _write_jsonl(out / "heldout.jsonl", [
        {"problem": prompt_text(a, b), "answer": str(a + b), "id": f"heldout-{i}"}
        for i, (a, b) in enumerate(heldout)])
    model_dir = out / "initial_model"
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, seed=seed, tokenizer_texts=corpus(pairs, digits),
                        individual_digits=True, **(model_overrides or {}))
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


@reported_as(PROG)
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG,
                                     description="Write the column-addition task and its initial tiny model.")
    parser.add_argument("out_dir")
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_task(args.out_dir, digits=args.digits, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
