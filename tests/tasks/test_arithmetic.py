"""The column-addition task: solutions are right and graded so, splits are disjoint and load
through the project's own readers, the tokenizer writes one token per digit."""

import json
import random
import re

import pytest

from megatron_dgpo.tasks.arithmetic import (TaskSizes, make_task, operand_pairs, prompt_text,
                                            worked_solution)


def test_worked_solutions_add_up_and_grade():
    from megatron_dgpo.tasks.rewards import RewardPool

    rng = random.Random(3)
    texts, truths = [], []
    for _ in range(200):
        digits = rng.randint(1, 4)
        a, b = (rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(2))
        solution = worked_solution(a, b, digits)
        columns = re.findall(r"(\d)\+(\d)\+([01])=(\d+)\.", solution)
        assert len(columns) == digits
        carry = 0
        for i, (x, y, c, s) in enumerate(columns):  # units first, carries chained
            assert (int(x), int(y), int(c)) == (a // 10**i % 10, b // 10**i % 10, carry)
            assert int(s) == int(x) + int(y) + int(c)
            carry = int(s) // 10
        texts += [solution, solution.replace(f"{{{a + b}}}", f"{{{a + b + 1}}}")]
        truths += [str(a + b)] * 2
    with RewardPool(num_workers=1) as pool:
        scores = pool.score(texts, truths)
    assert scores[0::2] == [1.0] * 200 and all(s < 1.0 for s in scores[1::2])


def test_make_task_splits_files_and_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from megatron_dgpo.tasks.prompts import load_benchmark, load_prompt_dataset, load_sft_pairs

    sizes = TaskSizes(sft=50, train=30, heldout=20)
    out = make_task(tmp_path / "task", digits=3, seed=1, sizes=sizes)
    sft = load_sft_pairs(out / "sft.jsonl")
    train = load_prompt_dataset(out / "train.jsonl")
    heldout = load_benchmark(out / "heldout.jsonl")
    assert (len(sft), len(train), len(heldout)) == (50, 30, 20)
    prompts = [{m[0]["content"] for m, _ in sft}, {r.messages[0]["content"] for r in train},
               {r.messages[0]["content"] for r in heldout}]
    assert sum(map(len, prompts)) == len(set.union(*prompts)) == 100  # disjoint, no duplicates
    # dgpo-eval's reader keeps the task's own boxed instruction (no second one appended)
    assert heldout[0].messages[0]["content"].count("\\boxed{}") == 1
    a, b = map(int, re.match(r"What is (\d+)\+(\d+)", train[0].messages[0]["content"]).groups())
    assert train[0].ground_truth == str(a + b)

    tokenizer = AutoTokenizer.from_pretrained(out / "initial_model")
    ids = tokenizer(worked_solution(478, 385, 3), add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    # every digit is a token of its own (no merged "13" or "863")
    text = worked_solution(478, 385, 3)
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == [ch for ch in text if ch.isdigit()]
    assert tokenizer.decode(ids) == worked_solution(478, 385, 3)

    again = make_task(tmp_path / "again", digits=3, seed=1, sizes=sizes)
    for name in ("sft.jsonl", "train.jsonl", "heldout.jsonl"):
        assert (again / name).read_text() == (out / name).read_text()
    with pytest.raises(ValueError, match="only 8100 distinct 2-digit pairs"):
        operand_pairs(2, 9000, 0)
    assert json.loads((out / "initial_model" / "config.json").read_text())["model_type"] == "qwen2"
    assert prompt_text(1, 2).startswith("What is 1+2?")
