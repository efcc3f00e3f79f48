"""docs/architecture.md stays true to the code.

The page names modules by path (``megatron_dgpo/rollout/refit.py``). Each folder of the package is
a layer and the top-level modules are the driver. It fails here when a module of the package has
no row or sits under another folder's heading, when a folder has no layer, when it names a
module, function or file that does not exist, when a module's "may import" cell differs from the
layers its imports (lazy ones included) belong to, when a module's cell allows more than its
layer does or the layers form a cycle, and when the "uses from comm" table differs from what each
module takes from ``megatron_dgpo.runtime.comm``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_dgpo"
DOC = ROOT / "docs" / "architecture.md"

MODULE_PATH = re.compile(r"megatron_dgpo/[\w/]*\.py")
DOTTED = re.compile(r"\bmegatron_dgpo(?:\.\w+)+")
OTHER_PATH = re.compile(r"\b(?:tests|benchmarks|tools|docs|recipes|slurm)/[\w/.-]*\.(?:py|md|yaml)\b")
SECTIONS = ("Layers", "Modules", "One RL step", "Cross-rank communication", "GPU-only branches")
NONE = "—"


# ----------------------------------------------------------------------------- the package


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _dotted(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, str]:
    """Every module file of the package (``__init__.py`` included): path -> dotted name."""
    return {_rel(p): _dotted(_rel(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def required_modules() -> set[str]:
    """The modules the page must have a row for: every file but ``__init__.py``."""
    return {rel for rel in package_modules() if not rel.endswith("/__init__.py")}


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), rel)


def imported_modules(rel: str) -> set[str]:
    """Package modules (dotted) that ``rel`` imports anywhere, lazy imports included (the same
    reading as the import-cycle test)."""
    from tests.test_imports import _imports

    return _imports(ROOT / rel, set(package_modules().values()))


def top_level_names(tree: ast.AST) -> dict[str, ast.AST]:
    names = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def defines(rel: str, qualified: str) -> bool:
    """Whether module ``rel`` defines ``qualified`` (``f``, ``Class``, ``Class.method``)."""
    node: ast.AST = _tree(rel)
    for part in qualified.split("."):
        node = top_level_names(node).get(part)
        if node is None:
            return False
    return True


def comm_uses(rel: str) -> set[str]:
    """What ``rel`` takes from ``megatron_dgpo.runtime.comm``: ``comm.X`` attributes and names imported
    from it."""
    tree, aliases, used = _tree(rel), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "megatron_dgpo.runtime":
            aliases |= {a.asname or a.name for a in node.names if a.name == "comm"}
        elif isinstance(node, ast.ImportFrom) and node.module == "megatron_dgpo.runtime.comm":
            used |= {a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add(node.attr)
    return used


PARALLEL_STATE = {"parallel_state", "mpu"}  # megatron.core's module and its old alias
PARALLEL_STATE_OWNER = "megatron_dgpo/runtime/parallel.py"


def parallel_state_reads(source: str) -> list[str]:
    """Where ``source`` reaches Megatron's ``parallel_state`` (or ``mpu``): imports of it in any
    spelling, ``megatron.core.parallel_state`` attributes, ``import_module`` of it by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            names = (node.module or "").split(".") + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [part for a in node.names if a.name.startswith("megatron")
                     for part in a.name.split(".")]
        elif isinstance(node, ast.Attribute) and node.attr in PARALLEL_STATE:
            names = [node.attr]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                ("import_module", "__import__")) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names = node.args[0].value.split(".")
        if PARALLEL_STATE & set(names):
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


# -------------------------------------------------------------------------------- the page


@dataclass
class Table:
    section: str  # the enclosing "## " heading
    heading: str  # the nearest heading ("### " or "## ")
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def column(self, name: str) -> int:
        return self.header.index(name)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    out, section, heading = [], "", ""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = heading = line[3:].strip()
        elif line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-", lines[i + 1]):
            table = Table(section, heading, [c.lower() for c in _cells(line)])
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                table.rows.append(_cells(lines[i]))
                i += 1
            out.append(table)
            continue
        i += 1
    return out


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _layer_list(cell: str) -> set[str]:
    return set() if cell.strip() == NONE else {x.strip() for x in cell.split(",") if x.strip()}


DRIVER = "driver"


def folder_layer(rel: str) -> str:
    """The layer a module belongs to: its folder under ``megatron_dgpo/``, or the driver for the
    modules at the top of the package."""
    parts = rel.split("/")
    return DRIVER if len(parts) == 2 else parts[1]


def layer_folders(text: str) -> dict[str, str]:
    """The "Layers" table: layer -> its folder cell."""
    folders = {}
    for table in tables(text):
        if table.section == "Layers" and table.header[:1] == ["layer"]:
            for row in table.rows:
                (layer,) = _ticked(row[0])
                (folders[layer],) = _ticked(row[table.column("folder")])
    return folders


def layer_rules(text: str) -> dict[str, set[str]]:
    """The "Layers" table: layer -> the layers it may import."""
    rules = {}
    for table in tables(text):
        if table.section == "Layers" and table.header[:1] == ["layer"]:
            for row in table.rows:
                (layer,) = _ticked(row[0])
                rules[layer] = _layer_list(row[table.column("may import")])
    return rules


def module_rows(text: str) -> tuple[dict[str, tuple[str, set[str]]], list[str]]:
    """The "Modules" tables: path -> (layer, may import), and the paths listed twice."""
    rows, twice = {}, []
    for table in tables(text):
        if table.section != "Modules" or "may import" not in table.header:
            continue
        (layer,) = _ticked(table.heading)
        for row in table.rows:
            (path,) = _ticked(row[table.column("module")])
            if path in rows:
                twice.append(path)
            rows[path] = (layer, _layer_list(row[table.column("may import")]))
    return rows, twice


def missing_and_unknown(text: str) -> tuple[list[str], list[str]]:
    """Modules without a row; module paths or dotted names the page gives that do not exist."""
    rows, _ = module_rows(text)
    modules = package_modules()
    missing = sorted(required_modules() - set(rows))
    unknown = {p for p in MODULE_PATH.findall(text) if p not in modules}
    dotted = {name: rel for rel, name in modules.items()}
    for ref in set(DOTTED.findall(text)):
        parts = ref.split(".")
        for k in range(len(parts), 1, -1):
            if (owner := ".".join(parts[:k])) in dotted:
                rest = parts[k:]
                if rest and not defines(dotted[owner], rest[0]):
                    unknown.add(ref)
                break
        else:
            unknown.add(ref)
    return missing, sorted(unknown)


def _text() -> str:
    return DOC.read_text()


# --------------------------------------------------------------------------------- tests


def test_the_page_has_its_sections():
    sections = {t for t in re.findall(r"^## (.+)$", _text(), re.M)}
    assert set(SECTIONS) <= sections, f"docs/architecture.md lacks sections {sorted(set(SECTIONS) - sections)}"


def test_every_module_has_one_row_and_every_named_module_exists():
    missing, unknown = missing_and_unknown(_text())
    _, twice = module_rows(_text())
    assert not missing, ("docs/architecture.md has no row for these modules (add each to its "
                         f"layer's table under 'Modules'): {missing}")
    assert not unknown, f"docs/architecture.md names modules that do not exist: {unknown}"
    assert not twice, f"docs/architecture.md lists these modules twice: {twice}"


def test_other_files_the_page_names_exist():
    absent = sorted({p for p in OTHER_PATH.findall(_text()) if not (ROOT / p).exists()})
    assert not absent, f"docs/architecture.md names files that do not exist: {absent}"


def test_each_folder_is_one_layer_and_each_module_sits_under_its_folder():
    folders = layer_folders(_text())
    expected = {layer: f"megatron_dgpo/{layer}/" for layer in folders if layer != DRIVER} | {
        DRIVER: "megatron_dgpo/*.py"}
    assert folders == expected, f"the 'Layers' table's folders: {folders}, expected {expected}"
    package_folders = {folder_layer(rel) for rel in package_modules()}
    assert package_folders == set(folders), ("folders of the package without a layer: "
                                             f"{sorted(package_folders - set(folders))}; layers "
                                             f"without a folder: {sorted(set(folders) - package_folders)}")
    rows, _ = module_rows(_text())
    misplaced = sorted(f"{path} is under `{layer}`, it lives in `{folder_layer(path)}`"
                       for path, (layer, _) in rows.items() if layer != folder_layer(path))
    assert not misplaced, "docs/architecture.md:\n" + "\n".join(misplaced)


def test_test_folders_mirror_the_package():
    """``tests/<folder>/`` holds the tests of ``megatron_dgpo/<folder>/``; ``tests/cluster/`` (the
    cluster's life) is the one folder of its own."""
    test_folders = {p.parent.relative_to(ROOT / "tests").parts[0] for p in (ROOT / "tests").rglob("test_*.py")
                    if p.parent != ROOT / "tests"}
    package_folders = {folder_layer(rel) for rel in package_modules()} - {DRIVER}
    assert test_folders - {"cluster"} <= package_folders, (
        f"test folders with no package folder of that name: {sorted(test_folders - {'cluster'} - package_folders)}")


def test_may_import_is_what_each_module_imports():
    rows, _ = module_rows(_text())
    layer_of_dotted = {_dotted(path): layer for path, (layer, _) in rows.items()}
    wrong, unplaced = [], set()
    for path, (_, claimed) in sorted(rows.items()):
        if not (ROOT / path).exists():
            continue  # reported by the test above
        imported = imported_modules(path)
        unplaced |= {m for m in imported if m not in layer_of_dotted}
        actual = {layer_of_dotted[m] for m in imported if m in layer_of_dotted}
        if actual != claimed:
            wrong.append(f"{path}: imports {sorted(actual) or NONE}, the page says {sorted(claimed) or NONE}"
                         + (f" (not imported: {sorted(claimed - actual)})" if claimed - actual else "")
                         + (f" (not listed: {sorted(actual - claimed)})" if actual - claimed else ""))
    assert not unplaced, f"imported modules with no row in docs/architecture.md: {sorted(unplaced)}"
    assert not wrong, "docs/architecture.md 'may import' differs from the code:\n" + "\n".join(wrong)


def test_modules_stay_inside_their_layer_and_layers_form_no_cycle():
    rules = layer_rules(_text())
    rows, _ = module_rows(_text())
    assert rules, "docs/architecture.md: no 'Layers' table found"
    used = ({layer for layer, _ in rows.values()} | set().union(*(claimed for _, claimed in rows.values()))
            | set().union(*rules.values()))
    undeclared = sorted(used - set(rules))
    assert not undeclared, f"layers used but not in the 'Layers' table: {undeclared}"
    beyond = [f"{path} ({layer}) may import {sorted(claimed - rules[layer])}, which its layer does not allow"
              for path, (layer, claimed) in sorted(rows.items()) if claimed - rules[layer]]
    assert not beyond, "\n".join(beyond)

    state: dict[str, int] = {}

    def cycle_from(layer: str, path: list[str]) -> list[str] | None:
        state[layer] = 1
        for nxt in sorted(rules[layer] - {layer}):
            if state.get(nxt) == 1:
                return path + [layer, nxt]
            if nxt not in state and (found := cycle_from(nxt, path + [layer])):
                return found
        state[layer] = 2
        return None

    for layer in sorted(rules):
        if layer not in state:
            assert (found := cycle_from(layer, [])) is None, f"layer cycle: {' -> '.join(found)}"


def test_functions_the_tables_name_exist_in_their_module():
    absent, seen = [], 0
    for table in tables(_text()):
        if "module" not in table.header or "function" not in table.header:
            continue
        for row in table.rows:
            paths = MODULE_PATH.findall(row[table.column("module")])
            assert len(paths) == 1, f"row {row} of '{table.heading}' names {len(paths)} modules"
            for name in _ticked(row[table.column("function")]):
                seen += 1
                if (ROOT / paths[0]).exists() and not defines(paths[0], name):
                    absent.append(f"{paths[0]}: {name}")
    assert seen > 40, f"only {seen} functions found in the tables: did the table layout change?"
    assert not absent, f"docs/architecture.md names functions that do not exist: {absent}"


def test_comm_table_matches_the_code():
    documented = {}
    for table in tables(_text()):
        if table.section == "Cross-rank communication" and "uses from comm" in table.header:
            for row in table.rows:
                (path,) = MODULE_PATH.findall(row[table.column("module")])
                documented[path] = set(_ticked(row[table.column("uses from comm")]))
    actual = {rel: used for rel in package_modules()
              if rel != "megatron_dgpo/runtime/comm.py" and (used := comm_uses(rel))}
    diff = [f"{rel}: code {sorted(actual.get(rel, ()))}, page {sorted(documented.get(rel, ()))}"
            for rel in sorted(set(actual) | set(documented)) if actual.get(rel) != documented.get(rel)]
    assert not diff, "docs/architecture.md 'uses from comm' differs from the code:\n" + "\n".join(diff)


def test_the_checks_see_a_planted_error():
    text = _text()
    row = next(line for line in text.splitlines() if line.startswith("| `megatron_dgpo/rollout/refit.py`"))
    missing, unknown = missing_and_unknown(text.replace(row + "\n", "")
                                           + "\n`megatron_dgpo/rollout/nowhere.py`, `megatron_dgpo.nowhere`,"
                                           + " `megatron_dgpo.runtime.comm.no_such_function`\n")
    assert missing == ["megatron_dgpo/rollout/refit.py"]
    assert unknown == ["megatron_dgpo.nowhere", "megatron_dgpo.runtime.comm.no_such_function",
                       "megatron_dgpo/rollout/nowhere.py"]
    assert folder_layer("megatron_dgpo/trainer.py") == DRIVER
    assert folder_layer("megatron_dgpo/rollout/dedicated/wire.py") == "rollout"
    assert imported_modules("megatron_dgpo/rollout/replica.py") >= {"megatron_dgpo.tasks.prompts",
                                                                   "megatron_dgpo.rollout.refit"}
    assert comm_uses("megatron_dgpo/runtime/interrupt.py") == {"any_rank"}
    assert defines("megatron_dgpo/rollout/replica.py", "ReplicaRollout.refit")
    assert not defines("megatron_dgpo/rollout/replica.py", "ReplicaRollout.nothing")


def test_only_the_parallel_module_reads_megatrons_parallel_state():
    """The package's groups, ranks and sizes come from ``runtime/parallel.py``'s accessors (one
    vocabulary; a replica is TP x CP x PP there), never from Megatron's ``parallel_state``."""
    offenders = {rel: reads for rel in package_modules()
                 if rel != PARALLEL_STATE_OWNER
                 and (reads := parallel_state_reads((ROOT / rel).read_text()))}
    assert not offenders, f"read megatron.core.parallel_state outside {PARALLEL_STATE_OWNER}: {offenders}"
    assert parallel_state_reads((ROOT / PARALLEL_STATE_OWNER).read_text())
    # the check sees every spelling
    planted = ("from megatron.core import parallel_state as ps\n"
               "from megatron.core import mpu\n"
               "import megatron.core.parallel_state\n"
               "from megatron.core.parallel_state import get_data_parallel_group\n"
               "import megatron\n"
               "g = megatron.core.parallel_state.get_data_parallel_group()\n"
               "m = importlib.import_module('megatron.core.parallel_state')\n"
               "from megatron.core import dist_checkpointing\n")
    assert [r.split(":")[0] for r in parallel_state_reads(planted)] == [
        f"line {n}" for n in (1, 2, 3, 4, 6, 7)]
