"""Datasets: DAPO layout in jsonl and parquet, the six benchmark layouts, the built-in set,
and chat-template rendering."""

from __future__ import annotations

import json

import pytest

from megatron_dgpo.tasks.prompts import (BOXED_INSTRUCTION, EASY_FAMILIES, PromptRecord,
                                         benchmark_files, builtin_prompts, find_benchmarks_dir,
                                         load_benchmark, load_prompt_dataset, render_prompt)
from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.tasks.rewards import math_reward

DAPO_ROWS = [
    {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve 1+1."}], "ability": "MATH",
     "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": "a-1"}},
    {"prompt": "What is 2^10?", "reward_model": {"ground_truth": 1024}},
]


def test_dapo_layout_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jl = tmp_path / "train.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in DAPO_ROWS) + "\n")
    recs = load_prompt_dataset(jl)
    assert [r.ground_truth for r in recs] == ["2", "1024"]
    assert recs[0].messages == ({"role": "user", "content": "Solve 1+1."},) and recs[0].id == "a-1"
    assert recs[1].messages == ({"role": "user", "content": "What is 2^10?"},)
    pq.write_table(pa.Table.from_pylist([DAPO_ROWS[0]] * 3), tmp_path / "train.parquet")
    precs = load_prompt_dataset(tmp_path / "train.parquet")
    assert len(precs) == 3 and precs[0].messages == recs[0].messages and precs[0].ground_truth == "2"


def test_dataset_errors_name_file_row_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(InputError, match=r"bad.jsonl row 0: missing field 'reward_model.ground_truth'"):
        load_prompt_dataset(bad)
    bad.write_text('{"prompt": "x", "reward_model": {"ground_truth": "1"}}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_prompt_dataset(bad)
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}) + "\n")
    with pytest.raises(ValueError, match="field 'prompt'"):
        load_prompt_dataset(bad)
    with pytest.raises(InputError, match="nope.jsonl"):
        load_prompt_dataset(tmp_path / "nope.jsonl")


def test_builtin_prompts_are_well_formed_and_solvable():
    recs = builtin_prompts()
    assert len(recs) == 215 and len({r.id for r in recs}) == 215
    for r in recs:  # each stated answer, boxed, earns the reward: the set is graded correctly
        assert math_reward(f"\\boxed{{{r.ground_truth}}}", r.ground_truth) == 1.0
        assert "\\boxed{}" in r.messages[0]["content"]
    easy = builtin_prompts(EASY_FAMILIES)
    assert len(easy) == 95 and all(r.ground_truth in list("0123456789") for r in easy)
    add = [r for r in easy if r.family == "add"]
    for r in add:  # "What is a+b?" really has answer a+b
        a, b = r.messages[0]["content"].split("What is ")[1].split("?")[0].split("+")
        assert int(a) + int(b) == int(r.ground_truth)
    with pytest.raises(ValueError, match="unknown built-in families"):
        builtin_prompts(["calculus"])


def test_benchmark_layouts(tmp_path):
    bench_dir = find_benchmarks_dir()
    if bench_dir is None:
        pytest.skip("benchmark folder ../shared/benchmarks (or $DGPO_BENCHMARKS_DIR) is absent")
    files = benchmark_files(bench_dir)
    sizes = {name: len(load_benchmark(path, name)) for name, path in files.items()}
    assert sizes == {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva_math": 272, "olympiadbench": 675}
    amc = load_benchmark(files["amc23"])
    assert amc[0].ground_truth == "27" and amc[0].source == "amc23"  # 27.0 in the file
    first_rows = {n: json.loads(p.read_text().splitlines()[0]) for n, p in files.items()}
    mm = load_benchmark(files["minerva_math"], limit=1)[0]
    assert mm.ground_truth in first_rows["minerva_math"]["solution"]  # the last \boxed of the solution
    ob = load_benchmark(files["olympiadbench"], limit=1)[0]
    assert ob.ground_truth == "2" and first_rows["olympiadbench"]["question"] in ob.messages[0]["content"]
    m5 = load_benchmark(files["math500"], limit=1)[0]
    assert BOXED_INSTRUCTION not in m5.messages[0]["content"]  # its problem already asks for a box
    assert load_benchmark(files["aime25"], limit=1)[0].messages[0]["content"].endswith(BOXED_INSTRUCTION)


def test_benchmark_loader_on_synthetic_layouts(tmp_path):
    # the same layouts written here, so the loader is exercised even without the shared folder
    rows = [
        {"problem": "p1", "answer": 27.0},
        {"question": "p2", "final_answer": ["$69$,$84$"], "context": "ctx"},
        {"problem": "p3", "solution": r"so \boxed{\frac{1}{2}} and finally \boxed{3}"},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    recs = load_benchmark(path)
    assert [r.ground_truth for r in recs] == ["27", "69,84", "3"]
    assert recs[1].messages[0]["content"].startswith("ctx\n\np2")
    path.write_text(json.dumps({"problem": "p", "solution": "no box"}))
    with pytest.raises(ValueError, match=r"mixed.jsonl row 0.*solution"):
        load_benchmark(path)


def test_render_prompt_uses_chat_template(tiny_tokenizer):
    rec = PromptRecord(({"role": "user", "content": "What is 2+3?"},), "5")
    ids = render_prompt(tiny_tokenizer, rec)
    assert tiny_tokenizer.decode(ids) == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")

    class NoTemplate:
        chat_template = None
        name_or_path = "plain"

    with pytest.raises(ValueError, match="no chat_template"):
        render_prompt(NoTemplate(), rec)
