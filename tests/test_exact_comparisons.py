"""Every exact comparison of tensors in the tests says why it holds bitwise on any machine.

Two code paths that compute the same floats differently (another op order, fused against
unfused kernels, other batch or chunk sizes, TP=1 against TP=2, packed against unpadded, other
thread counts) agree only to rounding, and how far apart they land depends on the host's CPU
kernels: one test here compared such log-probs exactly and failed on another machine at 4.8e-7.
So an exact comparison belongs only where bitwise equality holds everywhere: integers (token
ids, counts, masks), a copy or a round trip through storage, the same ops in the same order on
the same inputs (the same function run twice, a resumed run replaying the same kernels), or a
comparison that must differ. Each one carries ``# exact: <why>`` on one of its lines, on a line
of the statement holding it, or in the comment lines directly above that statement.

What is found (by its syntax; ``ast``, no types): ``torch.equal`` and ``x.equal(y)``;
``assert_close`` / ``allclose`` / ``isclose`` with ``rtol=0`` and ``atol=0`` (numpy's
``assert_allclose`` with ``rtol=0``: its atol is 0 by default); ``assert_array_equal``,
``array_equal``, ``assert_equal``; ``(a == b).all()`` / ``.any()``, ``a.eq(b).all()`` and
``torch.all(a == b)``; and ``==`` / ``!=`` with a tensor read-out on one side (``.tolist()``,
``.item()``, or a ``.max()`` / ``.min()`` / ``.sum()`` / ... reduction, maybe inside
``float()``), unless the other side is ``pytest.approx``. Not found: ``==`` between plain Python
values that a rank function returned (a float and an int look alike without types); those
comparisons live next to the arithmetic that makes them and are reviewed by hand.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

JUSTIFIED = re.compile(r"#\s*exact:\s*\S")
EQUAL_CALLS = {"equal", "array_equal", "assert_array_equal", "assert_equal"}
TOLERANCE_CALLS = {"assert_close", "allclose", "isclose", "assert_allclose"}
READOUTS = {"tolist", "item", "max", "min", "amax", "amin", "sum", "mean", "prod", "norm"}
NOT_TENSORS = {"math", "builtins", "statistics"}  # modules whose max() / prod() read Python values
WRAPPERS = {"float", "int", "bool"}


def _attr(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _zero(node: ast.expr | None) -> bool:
    return (isinstance(node, ast.Constant) and not isinstance(node.value, bool)
            and isinstance(node.value, (int, float)) and node.value == 0)


def _elementwise_eq(node: ast.expr) -> bool:
    """``a == b`` / ``a != b`` (a comparison) or ``a.eq(b)`` / ``a.ne(b)``."""
    if isinstance(node, ast.Compare):
        return any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("eq", "ne")


def _readout(node: ast.expr) -> bool:
    """A tensor's value read out for ``==``: ``t.tolist()``, ``t.item()``, ``t.abs().max()``..."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in WRAPPERS \
            and len(node.args) == 1:
        node = node.args[0]
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    owner = node.func.value
    return node.func.attr in READOUTS and not (isinstance(owner, ast.Name) and owner.id in NOT_TENSORS)


def _approx(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and _attr(node.func) == "approx"


def exact_kind(node: ast.AST) -> str | None:
    """What kind of exact comparison ``node`` is, or None."""
    if isinstance(node, ast.Call):
        name = _attr(node.func)
        if name in EQUAL_CALLS:
            return name
        if name in TOLERANCE_CALLS:
            kw = {k.arg: k.value for k in node.keywords}
            atol = kw.get("atol", ast.Constant(0) if name == "assert_allclose" else None)
            if "rtol" in kw and _zero(kw["rtol"]) and _zero(atol):
                return f"{name} rtol=0 atol=0"
        if name in ("all", "any"):
            if isinstance(node.func, ast.Attribute) and _elementwise_eq(node.func.value):
                return f"(a == b).{name}()"
            if node.args and _elementwise_eq(node.args[0]):
                return f"{name}(a == b)"
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
        sides = [node.left, *node.comparators]
        if not any(_approx(s) for s in sides) and any(_readout(s) for s in sides):
            return "== of a read-out"
    return None


def _comments(source: str) -> dict[int, str]:
    """Line -> the comment on it (tokenize, so a '#' inside a string is no comment)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def _statement_lines(stmt: ast.stmt) -> range:
    """The lines of a simple statement, or of a compound statement's header (not its body)."""
    body = getattr(stmt, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return range(stmt.lineno, body[0].lineno)
    return range(stmt.lineno, stmt.end_lineno + 1)


def unjustified(source: str, name: str = "<string>") -> tuple[list[tuple[int, str]], int]:
    """The exact comparisons in ``source`` without a justification, as (line, kind), and how many
    comparisons there are in all."""
    tree = ast.parse(source, name)
    comments = _comments(source)
    code_lines = source.splitlines()
    found: dict[int, tuple[int, str]] = {}
    total = 0

    def justified_above(line: int) -> bool:
        line -= 1
        while line >= 1 and code_lines[line - 1].strip().startswith("#"):
            if JUSTIFIED.search(comments.get(line, "")):
                return True
            line -= 1
        return False

    def visit(node: ast.AST, stmt: ast.stmt | None) -> None:
        nonlocal total
        if isinstance(node, ast.stmt):
            stmt = node
        kind = exact_kind(node)
        if kind is not None:
            total += 1
            lines = set(range(node.lineno, node.end_lineno + 1))
            if stmt is not None:
                lines |= set(_statement_lines(stmt))
            first = min(lines)
            if not (any(JUSTIFIED.search(comments.get(n, "")) for n in lines) or justified_above(first)):
                found.setdefault(node.lineno, (node.lineno, kind))
        for child in ast.iter_child_nodes(node):
            visit(child, stmt)

    visit(tree, None)
    return sorted(found.values()), total


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


PLANTED_BAD = '''
import torch
def check(a, b, c):
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    assert (a == b).all() and a.tolist() == [0.5, 0.25]
    assert float((a - b).abs().max()) == 0.0
    # exact:
    assert a.equal(b)
'''

PLANTED_GOOD = '''
import numpy as np
import torch
import pytest
def check(a, b, c):
    assert torch.equal(a, b)  # exact: b is a.clone()
    # the argument for the next line, over two comment lines:
    # exact: the same function run twice on the same input
    torch.testing.assert_close(
        a, c,
        rtol=0, atol=0)
    out = dict(same=all(torch.equal(x, y)
                        for x, y in zip(a, b)))  # exact: a copy through storage
    assert a.tolist() == [1, 2]  # exact: token ids
    torch.testing.assert_close(a, c, rtol=1e-6, atol=0)  # a tolerance: not exact
    np.testing.assert_allclose(a, c, rtol=1e-7)
    assert a.item() == pytest.approx(0.5)
    s = "torch.equal(a, b)"  # a string, not a call
'''


def test_the_check_catches_a_planted_unjustified_comparison_and_accepts_a_justified_one():
    bad, total = unjustified(PLANTED_BAD)
    assert [line for line, _ in bad] == [4, 5, 6, 7, 9] and total == 6, bad  # line 6 holds two
    good, total = unjustified(PLANTED_GOOD)
    assert good == [] and total == 4, good


def test_every_exact_comparison_of_tensors_says_why_it_is_exact_on_any_machine():
    problems, total, files = [], 0, _test_files()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        bad, count = unjustified(path.read_text(), rel)
        total += count
        problems += [f"{rel}:{line} ({kind})" for line, kind in bad]
    # the scan reads the helpers too (tests/_rank_fns_*.py, tests/cluster/, tests/planner/)
    assert any(p.name.startswith("_rank_fns_") for p in files) and any(p.parent.name == "planner" for p in files)
    assert total >= 50, f"only {total} exact comparisons found: is the scan still reading the tests?"
    assert not problems, (
        "exact comparisons of tensors without '# exact: <why>' (bitwise equal on any machine only for "
        "integers, copies, or the same ops in the same order; else compare with a tolerance):\n  "
        + "\n  ".join(problems))
