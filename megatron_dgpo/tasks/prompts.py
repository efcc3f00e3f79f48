"""Prompt datasets (training), evaluation benchmarks, and the built-in prompt set.

One record type, ``PromptRecord``, serves the three prompt sources:

* training sets in DAPO-Math-17k's layout, jsonl or parquet: ``prompt`` is a list of chat
  messages (``[{"role": "user", "content": ...}]``) or a string, the answer is
  ``reward_model.ground_truth`` (other field paths are configurable);
* the six evaluation benchmarks of the paper, each in the layout its public copy uses
  (``load_benchmark``; the layout is detected per row, see ``_benchmark_row``);
* ``builtin_prompts()``: 215 math prompts with answers written for this project (package data,
  ``megatron_dgpo/assets/builtin_math.jsonl``) so that a job runs with no download.

Supervised (prompt, response) pairs for the warm start (``megatron_dgpo.sft``) are read by
``load_sft_pairs``.

Built-in families (``PromptRecord.family``), from easiest to hardest:
    repeat (10)  "Repeat the digit 7. Put it in \\boxed{}."           -> 7
    add (55)     "What is 3+4? ..." with a+b <= 9                        -> one digit
    sub (30)     "What is 8-5? ..." with a result in 0..9                -> one digit
    word (40), mul (30), frac (20, answers like \\frac{7}{12}), linear (20, negative answers),
    series (10): multi-digit answers, for pipelines that need a real grader.
``repeat``/``add``/``sub`` (``EASY_FAMILIES``) are the learnable set for a tiny random model:
their answers are single digits, and the tiny tokenizer (``megatron_dgpo.tasks.tiny``) encodes each
``\\boxed{d}`` as ONE token, so a random policy already earns +1 now and then (about 1 sample in
500 per token position) and RL can raise the reward within minutes on a CPU.

Prompts are rendered with the tokenizer's own chat template (``render_prompt``). A run visits
its prompts (or its SFT pairs) in ``prompt_order``: an endless stream, shuffled per epoch, that a
resumed run picks up at the position it had reached.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron_dgpo.runtime.errors import InputError
from megatron_dgpo.tasks.rewards import last_boxed, normalize_ground_truth

BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")
EASY_FAMILIES = ("repeat", "add", "sub")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BENCHMARKS_ENV = "DGPO_BENCHMARKS_DIR"


@dataclass(frozen=True)
class PromptRecord:
    """One problem. messages: chat messages ([{"role", "content"}]); ground_truth: normalised
    LaTeX string (``rewards.normalize_ground_truth``); id/source/family: provenance."""

    messages: tuple[dict, ...]
    ground_truth: str
    id: str = ""
    source: str = ""
    family: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)


# ------------------------------------------------------------------------------------ readers


def _read_rows(path: Path) -> list[dict]:
    """Rows of a .jsonl/.json/.parquet file; ``InputError`` naming the file and line (a missing
    file, bytes that are not UTF-8, a line that is not a JSON object)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except pa.ArrowException as e:
            raise InputError(f"{path}: not a readable parquet file ({e})") from None
    if suffix not in (".json", ".jsonl"):
        raise InputError(f"{path}: unsupported dataset format {suffix!r} (use .jsonl, .json or .parquet)")
    lines = _utf8_lines(path)
    if suffix == ".json":
        try:
            data = json.loads("".join(lines))
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
            raise InputError(f"{path}: a .json dataset must hold a list of objects")
        return data
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _utf8_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file; ``InputError`` naming the first line that is not."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as e:
        lineno = raw.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                         f"{e.start}); datasets are read as UTF-8") from None


def _get_path(row: dict, dotted: str, where: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise InputError(f"{where}: missing field {dotted!r}")
        value = value[part]
    return value


def _as_messages(prompt: Any, where: str) -> tuple[dict, ...]:
    if isinstance(prompt, str):
        return ({"role": "user", "content": prompt},)
    if hasattr(prompt, "tolist"):  # numpy arrays from parquet readers
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)) and prompt:
        msgs = []
        for m in prompt:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InputError(f"{where}: field 'prompt' must hold messages with string 'role' and 'content'")
            msgs.append({"role": m["role"], "content": m["content"]})
        return tuple(msgs)
    raise InputError(f"{where}: field 'prompt' must be a string or a non-empty list of chat messages")


def load_prompt_dataset(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    limit: int | None = None,
) -> list[PromptRecord]:
    """Training prompts from a jsonl/json/parquet file in DAPO-Math-17k's layout.

    prompt_key / answer_key are dotted field paths. Errors name the file, the row and the field.
    """
    path = Path(path)
    records = []
    for i, row in enumerate(_read_rows(path)):
        if limit is not None and len(records) >= limit:
            break
        where = f"{path} row {i}"
        messages = _as_messages(_get_path(row, prompt_key, where), where)
        answer = _get_path(row, answer_key, where)
        try:
            gt = normalize_ground_truth(answer)
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}: field {answer_key!r}: {e}") from None
        rid = row.get("id", row.get("extra_info", {}).get("index", i) if isinstance(row.get("extra_info"), dict) else i)
        records.append(
            PromptRecord(messages, gt, id=str(rid), source=path.stem, family=str(row.get("family", "")))
        )
    return records


def load_sft_pairs(path: str | os.PathLike, *, prompt_key: str = "prompt",
                   response_key: str = "response") -> list[tuple[tuple[dict, ...], str]]:
    """Supervised (messages, response text) pairs from a jsonl/json/parquet file whose rows hold
    a prompt (string or chat messages) and a response string (dotted field paths). Errors name
    the file, the row and the field."""
    pairs = []
    for i, row in enumerate(_read_rows(Path(path))):
        where = f"{path} row {i}"
        messages = _as_messages(_get_path(row, prompt_key, where), where)
        response = _get_path(row, response_key, where)
        if not isinstance(response, str) or not response:
            raise InputError(f"{where}: field {response_key!r} must be a non-empty string")
        pairs.append((messages, response))
    if not pairs:
        raise InputError(f"{path}: no (prompt, response) pairs")
    return pairs


def builtin_prompts(families: Sequence[str] | None = None) -> list[PromptRecord]:
    """The built-in prompt set (see the module docstring), optionally only some families."""
    ref = resources.files("megatron_dgpo") / "assets" / "builtin_math.jsonl"
    with resources.as_file(ref) as path:
        records = load_prompt_dataset(path)
    if families is not None:
        known = {r.family for r in records}
        unknown = set(families) - known
        if unknown:
            raise InputError(f"data.builtin_families: unknown built-in families {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        records = [r for r in records if r.family in families]
    return records


# --------------------------------------------------------------------------------- benchmarks


# DAPO-Math-17k wraps every problem in an "Answer: $Answer" format instruction; the paper's
# reward grades the last \\boxed{} instead (see ``boxed_instruction``).
_DAPO_PREAMBLE = re.compile(r"^\s*Solve the following math problem step by step\. The last line of "
                            r"your response should be of the form Answer: \$Answer \(without "
                            r"quotes\) where \$Answer is the answer to the problem\.\s*")
_DAPO_REMINDER = re.compile(r"\s*Remember to put your answer on its own line after "
                            r"\"Answer:\"\.?\s*$")


def boxed_instruction(record: PromptRecord) -> PromptRecord:
    """``record`` asking for a ``\\boxed{}`` answer: DAPO-Math-17k's "Answer: $Answer"
    preamble and closing reminder are removed from the last user message and
    ``BOXED_INSTRUCTION`` appended (unless the text already asks for \\boxed{})."""
    messages = [dict(m) for m in record.messages]
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        raise InputError(f"data.boxed_instruction: prompt {record.id!r} of {record.source!r} has "
                         f"no user message to rewrite")
    problem = _DAPO_REMINDER.sub("", _DAPO_PREAMBLE.sub("", messages[last]["content"]))
    messages[last]["content"] = _with_instruction(problem)
    return dataclasses.replace(record, messages=tuple(messages))


def _with_instruction(problem: str) -> str:
    # MATH-500's copy already ends its prompt with a boxed instruction; do not say it twice.
    if "\\boxed" in problem:
        return problem
    return f"{problem.rstrip()}\n\n{BOXED_INSTRUCTION}"


def _benchmark_row(row: dict, where: str) -> tuple[str, Any]:
    """(problem text, raw answer) of one benchmark row, whatever its published layout:

    aime24 / amc23: problem + answer (string of an integer / float such as 27.0)
    aime25: problem + answer (string); math500: problem (ends with a boxed instruction) + answer
    minerva_math: problem + solution, the answer being the last \\boxed{} of the solution
    olympiadbench: question (+ optional context) + final_answer (list of LaTeX strings)
    """
    problem = row.get("problem")
    if not isinstance(problem, str):
        problem = row.get("question")
    if not isinstance(problem, str) or not problem.strip():
        raise InputError(f"{where}: no problem text (fields 'problem' or 'question')")
    context = row.get("context")
    if isinstance(context, str) and context.strip() and context.strip() not in problem:
        problem = f"{context.strip()}\n\n{problem}"
    if row.get("final_answer") is not None:
        answer = row["final_answer"]
    elif row.get("answer") is not None:
        answer = row["answer"]
    elif isinstance(row.get("solution"), str):
        answer = last_boxed(row["solution"])
        if answer is None:
            raise InputError(f"{where}: field 'solution' has no \\boxed{{}} answer")
    else:
        raise InputError(f"{where}: no answer (fields 'final_answer', 'answer' or a boxed 'solution')")
    return problem, answer


def load_benchmark(path: str | os.PathLike, name: str | None = None, *, limit: int | None = None) -> list[PromptRecord]:
    """One evaluation benchmark file (jsonl/json/parquet) in any of the six published layouts.

    The prompt is the problem followed by ``BOXED_INSTRUCTION`` (unless it already asks for a box).
    name defaults to the file stem and is stored as ``PromptRecord.source``.
    """
    path = Path(path)
    name = name or path.stem
    records = []
    for i, row in enumerate(_read_rows(path)):
        if limit is not None and len(records) >= limit:
            break
        where = f"{path} row {i}"
        problem, answer = _benchmark_row(row, where)
        try:
            gt = normalize_ground_truth(answer)
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}: answer: {e}") from None
        rid = row.get("id", row.get("unique_id", row.get("idx", i)))
        records.append(
            PromptRecord(({"role": "user", "content": _with_instruction(problem)},), gt, id=str(rid), source=name)
        )
    return records


def find_benchmarks_dir(repo_root: str | os.PathLike | None = None) -> Path | None:
    """The benchmark folder: $DGPO_BENCHMARKS_DIR, else <repo>/../shared/benchmarks; None if absent.

    Only tests and the ``dgpo-eval`` defaults use it; nothing in the package requires it.
    """
    env = os.environ.get(BENCHMARKS_ENV)
    if env:
        return Path(env) if Path(env).is_dir() else None
    root = Path(repo_root) if repo_root else Path(__file__).resolve().parents[2]
    candidate = root.parent / "shared" / "benchmarks"
    return candidate if candidate.is_dir() else None


def benchmark_files(directory: str | os.PathLike) -> dict[str, Path]:
    """{name: path} of the known benchmarks present in ``directory`` (jsonl, json or parquet)."""
    directory = Path(directory)
    found = {}
    for name in BENCHMARKS:
        for ext in (".jsonl", ".json", ".parquet"):
            if (directory / f"{name}{ext}").is_file():
                found[name] = directory / f"{name}{ext}"
                break
    return found


DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")


def resolve_benchmarks(specs: Sequence[str], directory: str | os.PathLike | None = None, *,
                       limit: int | None = None) -> dict[str, list[PromptRecord]]:
    """``{name: problems}`` of the benchmarks ``specs`` name, in their order (``dgpo-eval
    --benchmarks`` and the trainer's ``eval.benchmarks``). A spec is a file (an existing path,
    or one ending in .jsonl/.json/.parquet; any layout ``load_benchmark`` reads; named by its
    stem) or one of ``BENCHMARKS``, read from ``directory`` (default: ``find_benchmarks_dir``).
    ``limit``: the first problems of each. Raises ``ValueError`` naming the spec when it is
    neither, when two specs give the same name, or when one has no problems
    (``FileNotFoundError`` for a missing file)."""
    folder = Path(directory) if directory else find_benchmarks_dir()
    available = benchmark_files(folder) if folder and folder.is_dir() else {}
    out: dict[str, list[PromptRecord]] = {}
    for spec in specs:
        path = Path(spec)
        if path.is_file() or path.suffix.lower() in DATASET_SUFFIXES:
            name, records = path.stem, load_benchmark(path, limit=limit)
        elif spec in available:
            name, records = spec, load_benchmark(available[spec], spec, limit=limit)
        else:
            where = (f"in {folder}: {', '.join(sorted(available)) or 'none'}" if folder else
                     f"(no benchmark folder: set ${BENCHMARKS_ENV} or give a folder)")
            raise InputError(f"benchmark {spec!r} is neither a dataset file (.jsonl, .json, "
                             f".parquet) nor one of the benchmarks found {where}")
        if name in out:
            raise InputError(f"two benchmarks are named {name!r} (a name and a file, or two files "
                             f"with the same stem): metrics are keyed by name")
        if not records:
            raise InputError(f"benchmark {spec!r} has no problems")
        out[name] = records
    return out


# ---------------------------------------------------------------------------------- rendering


def render_prompt(tokenizer, record: PromptRecord | Sequence[dict]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant turn's header.

    The template is the tokenizer's own (``tokenizer.chat_template``); a tokenizer without one is
    an error, because a bare prompt silently changes what the policy sees.
    """
    messages = list(record.messages if isinstance(record, PromptRecord) else record)
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template "
                         f"(prompts are rendered with the model's own chat template)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompts(tokenizer, records: Iterable[PromptRecord]) -> list[list[int]]:
    """``render_prompt`` for each record."""
    return [render_prompt(tokenizer, r) for r in records]


@dataclass
class DataConfig:
    """Training prompts."""

    source: str = "builtin"
    """``builtin`` (the package's prompts), or a .jsonl/.json/.parquet file in DAPO-Math-17k's
    layout (``megatron_dgpo.tasks.prompts.load_prompt_dataset``)."""
    builtin_families: list[str] | None = None
    """With ``source: builtin``: only these families (e.g. [repeat, add, sub]); None: all."""
    prompt_field: str = "prompt"
    """Dotted field holding the prompt (a string or chat messages)."""
    answer_field: str = "reward_model.ground_truth"
    """Dotted field holding the ground-truth answer."""
    boxed_instruction: bool = False
    """Rewrite each prompt to ask for a \\boxed{} answer, which is what the reward grades:
    DAPO-Math-17k's "Answer: $Answer" preamble and reminder are removed
    (``megatron_dgpo.tasks.prompts.boxed_instruction``). Set it for DAPO-Math-17k."""


def training_prompts(config: DataConfig) -> list[PromptRecord]:
    """The training prompts of ``config`` (the built-in set or its dataset file), asking for a
    ``\\boxed{}`` answer with ``config.boxed_instruction``. ``InputError`` names the file, row
    or field that is wrong."""
    if config.source == "builtin":
        records = builtin_prompts(config.builtin_families)
    else:
        records = load_prompt_dataset(config.source, prompt_key=config.prompt_field,
                                      answer_key=config.answer_field)
    if not records:
        raise InputError(f"data.source {config.source!r} holds no prompts")
    if config.boxed_instruction:
        records = [boxed_instruction(r) for r in records]
    return records


def fitting_prompts(records: Sequence[PromptRecord], tokenizer, max_prompt_tokens: int, *,
                    source: str, first_only: bool = False) -> list[tuple[PromptRecord, list[int]]]:
    """``(record, token_ids)`` of the ``records`` whose chat-templated prompt fits in
    ``max_prompt_tokens`` (only the first such with ``first_only``); ``InputError`` naming
    ``source`` (``data.source``) and the shortest prompt when none does."""
    kept, shortest = [], None
    for record in records:
        ids = render_prompt(tokenizer, record)
        if len(ids) <= max_prompt_tokens:
            kept.append((record, ids))
            if first_only:
                break
        else:
            shortest = len(ids) if shortest is None else min(shortest, len(ids))
    if not kept:
        raise InputError(f"data.source {source!r}: none of its {len(records)} prompts fits in "
                         f"rollout.max_prompt_tokens={max_prompt_tokens} (the shortest is "
                         f"{shortest} tokens with the chat template): raise "
                         f"rollout.max_prompt_tokens")
    return kept


def load_prompts(config: DataConfig, hf_dir: str | os.PathLike, max_prompt_tokens: int):
    """``(prompts, tokenizer)``: the training prompts of ``config`` as ``(PromptRecord,
    token_ids)`` pairs rendered by the policy's chat template (the tokenizer of ``hf_dir``);
    prompts longer than ``max_prompt_tokens`` are dropped (``prompt_census`` counts them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return fitting_prompts(training_prompts(config), tokenizer, max_prompt_tokens,
                           source=config.source), tokenizer


def prompt_census(config: DataConfig, hf_dir: str | os.PathLike,
                  max_prompt_tokens: int) -> tuple[int, int]:
    """``(kept, total)``: how many of the training prompts ``load_prompts`` keeps, of all."""
    from transformers import AutoTokenizer

    records = training_prompts(config)
    kept = fitting_prompts(records, AutoTokenizer.from_pretrained(str(hf_dir)),
                           max_prompt_tokens, source=config.source)
    return len(kept), len(records)


def prompt_order(num_prompts: int, seed: int, start: int, count: int) -> list[int]:
    """Prompt indices ``start .. start+count-1`` of an endless stream that visits every prompt
    once per epoch, in an order shuffled with ``seed + epoch``."""
    import torch

    if num_prompts < 1:
        raise ValueError("the prompt dataset is empty")
    out, permutations = [], {}
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_prompts)
        if epoch not in permutations:
            generator = torch.Generator().manual_seed(seed + epoch)
            permutations[epoch] = torch.randperm(num_prompts, generator=generator).tolist()
        out.append(permutations[epoch][offset])
    return out
