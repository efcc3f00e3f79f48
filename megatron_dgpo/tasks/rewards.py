"""Rule-based math rewards (training) and a conservative grader (evaluation), graded safely.

Format rule (both graders). The answer is the content of the LAST complete ``\\boxed{...}`` of
the response. Braces nest (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``), escaped braces
``\\{`` / ``\\}`` do not count as structure, and whitespace between ``\\boxed`` and ``{`` is
allowed. ``\\boxed 5`` (TeX's brace-less one-token argument) is NOT accepted: every prompt of this
project asks for ``\\boxed{}``, and accepting bare forms would reward ``\\boxed`` mentioned in prose.
A response whose last ``\\boxed{`` is never closed (a truncated answer) has no answer.
Answers longer than ``MAX_ANSWER_CHARS`` or nested deeper than ``MAX_ANSWER_DEPTH`` braces count
as no answer (they are never a real final answer and are the classic parser-bomb shapes).

Training reward, ``math_reward`` (the paper: ``math_verify`` after a format check, r in {-1, +1}):
    +1 if the boxed answer is equivalent to the ground truth under math-verify, else -1.
    Both sides are parsed with LaTeX and plain-expression extraction; numbers are compared after
    rounding to 6 decimals (math-verify's default). Before parsing, both sides drop text-mode
    ``$`` delimiters but keep an escaped ``\\$`` (``strip_text_mode``): math-verify reads
    ``\\$32,\\!348`` as 32348, while removing only its ``$`` left the unparsable ``\\32,\\!348``.

Evaluation grader, ``eval_correct`` (the paper evaluates with a stricter, "conservative" grader,
``prime_math``; this is our equivalent, returning True/False). It differs from the training
reward in three ways, each of which can only turn a +1 into a "wrong", never the reverse:
    1. hedging is wrong: if the response boxes several answers that are not all the same string
       (after whitespace removal), it is graded wrong even if the last one is right;
    2. numbers are compared at 10 decimals instead of 6 (0.333333 is not 1/3);
    3. the prediction is parsed as LaTeX only (no plain-expression fallback such as reading
       ``1/2`` typed without LaTeX).

Safety. math-verify guards parsing and comparison with ``signal.alarm``, which works only in
the main thread, and cannot interrupt work stuck inside C code (e.g. big-integer powers such as
``9^{9^{9^9}}``). ``RewardPool`` therefore grades in worker processes (where grading runs in the
worker's main thread, so math-verify's own alarms work as a first line) and enforces a hard
per-item wall-clock deadline from the parent: a worker past its deadline is killed and replaced,
its item scores the grader's "wrong" value, and the batch goes on. A worker that crashes costs
only its current item. The format check runs in the parent in one linear pass, so a 1 MB response
never crosses a pipe: only the (short) boxed answer is sent to a worker.

``math_reward`` / ``eval_correct`` called directly run in-process (fine for trusted strings and
tests); outside the main thread they disable math-verify's alarms, so untrusted model output
should go through ``RewardPool``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as _mp_wait
from numbers import Real
from typing import Literal, Sequence

from megatron_dgpo.runtime.interrupt import children_keep_running
from megatron_dgpo.runtime.lifetime import children_die_with_this_process

MAX_ANSWER_CHARS = 1000
MAX_ANSWER_DEPTH = 20
_INNER_TIMEOUT_S = 2  # math-verify's own alarm (integer seconds), below the pool's hard deadline

Grader = Literal["train", "eval"]


# ---------------------------------------------------------------------------------- format rule


@dataclass(frozen=True)
class BoxedScan:
    """Result of scanning a response for ``\\boxed{...}``.

    answers: contents of the complete boxes, in order (a box nested in a box is part of the
        outer one's content); unclosed: True when a ``\\boxed{`` after the last complete box is
        never closed (truncated response).
    """

    answers: tuple[str, ...]
    unclosed: bool


def scan_boxed(text: str) -> BoxedScan:
    """All top-level ``\\boxed{...}`` contents of ``text`` in one linear pass (O(len(text)))."""
    answers: list[str] = []
    pos, n, tag = 0, len(text), "\\boxed"
    unclosed = False
    while True:
        start = text.find(tag, pos)
        if start < 0:
            break
        j = start + len(tag)
        while j < n and text[j] in " \t\n":
            j += 1
        if j >= n or text[j] != "{":
            pos = start + len(tag)  # a bare \boxed (no brace) is not a box
            continue
        depth, k = 0, j
        while k < n:
            c = text[k]
            if c == "\\":
                k += 2  # an escaped character (\{, \}, \\) is never structure
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        if k >= n:
            unclosed = True
            break
        answers.append(text[j + 1 : k])
        unclosed = False
        pos = k + 1
    return BoxedScan(tuple(answers), unclosed)


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}``; None if there is none or the last is unclosed."""
    scan = scan_boxed(text)
    if scan.unclosed or not scan.answers:
        return None
    return scan.answers[-1]


def _brace_depth(s: str) -> int:
    depth = best = 0
    for c in s:
        if c == "{":
            depth += 1
            best = max(best, depth)
        elif c == "}":
            depth -= 1
    return best


def _acceptable_answer(answer: str | None) -> bool:
    return (
        answer is not None
        and answer.strip() != ""
        and len(answer) <= MAX_ANSWER_CHARS
        and _brace_depth(answer) <= MAX_ANSWER_DEPTH
    )


# An unescaped "$": preceded by an even number (possibly zero) of backslashes.
_TEXT_MATH_DELIMITER = re.compile(r"(?<!\\)((?:\\\\)*)\$")
_PERIOD_AFTER_MATH = re.compile(r"(?<!\\)\$\s*\.$")  # "... $(0, 1)$." ends a sentence


def strip_text_mode(answer: str) -> str:
    """An answer written as text with inline math (``$69$,$84$``, ``$(-\\infty, 0)$.``) as math.

    Every unescaped ``$`` is a text-mode math delimiter and is dropped; an escaped ``\\$`` is a
    dollar sign (``\\$18.90``) and is kept, because math-verify reads it as currency and compares
    the number. A sentence period right after the closing ``$`` (``...$.``) is dropped too; a
    period inside the math is kept. The result is stripped.
    """
    s = answer.strip()
    if _PERIOD_AFTER_MATH.search(s):
        s = s[:-1]
    return _TEXT_MATH_DELIMITER.sub(r"\1", s).strip()


def normalize_ground_truth(ground_truth) -> str:
    """Ground truth of any published layout as one LaTeX string.

    str: ``strip_text_mode`` (text-mode ``$`` delimiters dropped, ``\\$`` kept); int; float (27.0 -> "27", 0.5 -> "0.5");
    list/tuple of those (OlympiadBench's ``final_answer``): normalised items joined by ", ".
    Raises TypeError/ValueError naming the bad value.
    """
    if isinstance(ground_truth, bool):
        raise TypeError(f"ground_truth must be a string or a number, got bool {ground_truth!r}")
    if isinstance(ground_truth, (list, tuple)):
        if not ground_truth:
            raise ValueError("ground_truth is an empty list")
        return ", ".join(normalize_ground_truth(g) for g in ground_truth)
    if isinstance(ground_truth, Real):
        value = float(ground_truth)
        if not math.isfinite(value):
            raise ValueError(f"ground_truth is not finite: {ground_truth!r}")
        return str(int(value)) if value == int(value) else repr(value)
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth must be a string, number or list, got {type(ground_truth).__name__}")
    s = strip_text_mode(ground_truth)
    if not s:
        raise ValueError(f"ground_truth is empty: {ground_truth!r}")
    return s


# ----------------------------------------------------------------------------- grading (math)


def _timeouts_allowed() -> bool:
    return threading.current_thread() is threading.main_thread()


def _parse(expr: str, plain_fallback: bool, timeout_s):
    """math-verify parse of one answer: LaTeX first; plain-expression reading only as a fallback.

    The answer is parsed as ``$...$`` rather than ``\\boxed{...}``: math-verify's boxed path
    falls back to picking a number out of an unparsable expression (``\\frac{1}{3} E_{1} + ...``
    parses to ``2/3``), which would equate different answers; the ``$`` path keeps the string.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    expr = strip_text_mode(expr)  # a "$" inside would close the "$...$" wrapper early
    parsed = parse("$" + expr + "$", extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout_s)
    if plain_fallback and not any(not isinstance(p, str) for p in parsed):
        plain = parse(expr, extraction_config=[ExprExtractionConfig()], parsing_timeout=timeout_s)
        if plain and not isinstance(plain[0], str) and expr.strip() == str(plain[-1]).strip():
            parsed = plain  # the whole answer is a plain expression such as 1/2 or 3*x
    if not parsed:
        parsed = [expr.strip()]  # unparsable: compared as a string
    return parsed


def _equivalent(answer: str, ground_truth: str, grader: Grader) -> bool:
    """math-verify equivalence of a boxed answer and a normalised ground truth."""
    from math_verify import verify

    t = _INNER_TIMEOUT_S if _timeouts_allowed() else None
    gold = _parse(ground_truth, plain_fallback=True, timeout_s=t)
    pred = _parse(answer, plain_fallback=grader == "train", timeout_s=t)
    rounding = 6 if grader == "train" else 10
    return bool(verify(gold, pred, float_rounding=rounding, timeout_seconds=t))


def _grade_answer(answers: tuple[str, ...], ground_truth: str, grader: Grader) -> bool:
    """Grade pre-extracted boxed answers (the last one is the answer). Runs in a worker."""
    if grader == "eval":
        distinct = {"".join(a.split()) for a in answers}
        if len(distinct) > 1:
            return False
    try:
        return _equivalent(answers[-1], ground_truth, grader)
    except Exception:  # noqa: BLE001 - any parser failure on model output is a wrong answer
        return False


def _extract(response: str, grader: Grader) -> tuple[str, ...] | None:
    """Format check (parent side): boxed answers to grade, or None when the format fails."""
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    scan = scan_boxed(response)
    if scan.unclosed or not scan.answers or not _acceptable_answer(scan.answers[-1]):
        return None
    if grader == "eval":
        if any(len(a) > MAX_ANSWER_CHARS for a in scan.answers):
            return None
        return scan.answers
    return scan.answers[-1:]


def math_reward(response: str, ground_truth) -> float:
    """Training reward of the paper: +1.0 if the last ``\\boxed{}`` answer of ``response`` is
    math-verify-equivalent to ``ground_truth``, else -1.0 (no box, unclosed box, wrong answer).

    In-process and unguarded against C-level hangs: use ``RewardPool`` for model output at scale.
    """
    answers = _extract(response, "train")
    if answers is None:
        return -1.0
    return 1.0 if _grade_answer(answers, normalize_ground_truth(ground_truth), "train") else -1.0


def eval_correct(response: str, ground_truth) -> bool:
    """Conservative evaluation grader (see the module docstring for how it differs)."""
    answers = _extract(response, "eval")
    if answers is None:
        return False
    return _grade_answer(answers, normalize_ground_truth(ground_truth), "eval")


def _score_value(correct: bool, grader: Grader) -> float:
    if grader == "train":
        return 1.0 if correct else -1.0
    return 1.0 if correct else 0.0


# ------------------------------------------------------------------------------ worker pool


def _worker_main(conn) -> None:
    """Worker loop: receive (job, answers, ground_truth, grader), send (job, correct)."""
    import math_verify  # noqa: F401 - import once, before the first deadline starts

    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        job, answers, ground_truth, grader = msg
        conn.send((job, _grade_answer(answers, ground_truth, grader)))


@dataclass
class PoolStats:
    """Counters of a ``RewardPool`` since its creation."""

    graded: int = 0
    format_failures: int = 0
    timeouts: int = 0
    crashes: int = 0
    restarts: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Worker:
    proc: mp.Process
    conn: object
    ready: bool = False
    job: int | None = None
    deadline: float = math.inf


@dataclass
class RewardPool:
    """Grade many responses in worker processes with a hard per-item deadline.

    score(responses, ground_truths, grader) -> list[float]: "train" gives +1/-1 (``math_reward``),
    "eval" gives 1/0 (``eval_correct``). An item whose worker exceeds ``timeout_s`` seconds of
    wall-clock grading (not counting waiting for a free worker), or whose worker dies, gets the
    grader's wrong value; the worker is replaced. Use as a context manager or call ``close()``.
    """

    num_workers: int = 2
    timeout_s: float = 4.0
    start_method: str = "spawn"  # fork is unsafe beside vLLM/torch threads
    stats: PoolStats = field(default_factory=PoolStats)

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        self._ctx = mp.get_context(self.start_method)
        children_die_with_this_process()  # the workers too, if this process is SIGKILLed
        self._workers: list[_Worker] = [self._spawn() for _ in range(self.num_workers)]

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="dgpo-grader")
        with children_keep_running():  # SLURM signals every process: the pool closes its workers
            proc.start()
        child.close()
        return _Worker(proc, parent)

    def _replace(self, idx: int) -> None:
        w = self._workers[idx]
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5)
        w.conn.close()
        self._workers[idx] = self._spawn()
        self.stats.restarts += 1

    def score(self, responses: Sequence[str], ground_truths: Sequence, grader: Grader = "train") -> list[float]:
        if grader not in ("train", "eval"):
            raise ValueError(f"grader must be 'train' or 'eval', got {grader!r}")
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        wrong = _score_value(False, grader)
        out = [wrong] * len(responses)
        pending: deque = deque()
        for i, (resp, gt) in enumerate(zip(responses, ground_truths)):
            answers = _extract(resp, grader)
            if answers is None:
                self.stats.format_failures += 1
                continue
            pending.append((i, answers, normalize_ground_truth(gt), grader))
        self._run(pending, out, grader)
        self.stats.graded += len(responses)
        return out

    def _run(self, pending: deque, out: list[float], grader: Grader) -> None:
        while pending or any(w.job is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.job is None and pending:
                    job = pending.popleft()
                    w.job, w.deadline = job[0], time.monotonic() + self.timeout_s
                    w.conn.send(job)
            now = time.monotonic()
            next_deadline = min((w.deadline for w in self._workers if w.job is not None), default=now + 1.0)
            waitables = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            ready = set(_mp_wait(waitables, timeout=max(0.0, min(next_deadline - now, 1.0))))
            for idx, w in enumerate(list(self._workers)):
                if w.conn in ready:
                    try:
                        job, correct = w.conn.recv()
                    except (EOFError, OSError):
                        self._crashed(idx)
                        continue
                    if job == "ready":
                        w.ready = True
                    else:
                        out[job] = _score_value(bool(correct), grader)
                        w.job, w.deadline = None, math.inf
                elif w.proc.sentinel in ready:
                    self._crashed(idx)
                elif w.job is not None and time.monotonic() > w.deadline:
                    self.stats.timeouts += 1
                    self._replace(idx)  # the item keeps its "wrong" value

    def _crashed(self, idx: int) -> None:
        w = self._workers[idx]
        if w.job is not None:
            self.stats.crashes += 1
        elif not w.ready:
            # Dying before "ready" is an environment problem (e.g. math-verify missing), not an item.
            w.proc.join(timeout=5)
            raise RuntimeError(f"reward worker died at start-up (exit code {w.proc.exitcode})")
        self._replace(idx)

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=2)
            w.conn.close()
        self._workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
