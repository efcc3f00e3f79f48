"""The README and the docs pages as a reader follows them: the README's first two commands are the
two CI runs (``make run``, ``make test``), and every relative link of README.md, docs/*.md and
slurm/README.md reaches a file that exists and, with an anchor, a heading of that file (GitHub's
heading slugs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "slurm" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def code_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```\w*\n(.*?)```", text, re.S)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
        if not file.exists():
            broken.append(f"{target} (no {shown})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading '{anchor}' in {shown})")
    return broken


def test_the_readme_starts_with_the_two_commands():
    assert code_blocks((ROOT / "README.md").read_text())[:2] == ["make run", "make test"]


def test_every_link_of_the_docs_reaches_a_file_and_a_heading():
    broken = {page.relative_to(ROOT).as_posix(): found for page in PAGES
              if (found := broken_links(page))}
    assert not broken, broken


def test_the_checks_see_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Reproducibility: CPU and GPU\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#reproducibility-cpu-and-gpu) [bad](other.md#nowhere) "
                    "[gone](missing.md) [web](https://example.org/x)\n")
    assert [b.split(" ")[0] for b in broken_links(page)] == ["other.md#nowhere", "missing.md"]
    assert slug("Differences from the paper's official code") == "differences-from-the-papers-official-code"
