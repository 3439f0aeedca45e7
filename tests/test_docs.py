"""The documentation holds together: the README stays short, and every relative link in the README,
docs/ and the notebook, and every docs/ pointer in a code comment, names a file and a section that
exist (GitHub's heading anchors), so a renamed section cannot leave a dangling reference."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = [ROOT / "README.md", ROOT / "benchmarks" / "NOTES.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("torch-ext", "scripts", "benchmarks", "tests")
README_MAX_LINES = 250

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_POINTER = re.compile(r"\bdocs/([\w-]+\.md)(#[\w-]+)?")


def _prose_lines(text: str):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def anchors(path: Path) -> set:
    """GitHub's anchors of the headings of a markdown file: lower case, punctuation dropped,
    spaces as hyphens, repeats numbered."""
    seen: dict = {}
    for line in _prose_lines(path.read_text()):
        heading = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            slug = f"{slug}-{count}"
        seen.setdefault(slug, 1)
    return set(seen)


def _check(target: Path, anchor: str, where: str, problems: list):
    if not target.exists():
        problems.append(f"{where}: {target.relative_to(ROOT)} does not exist")
    elif anchor and anchor not in anchors(target):
        problems.append(f"{where}: no section #{anchor} in {target.relative_to(ROOT)}")


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(page):
    problems = []
    for number, line in enumerate(_prose_lines(page.read_text()), 1):
        for link in LINK.findall(line):
            if re.match(r"[a-z]+:", link):
                continue  # an absolute URL
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            _check(target, anchor, f"{page.relative_to(ROOT)}: {link}", problems)
    assert not problems, "\n".join(problems)


def test_code_pointers_resolve():
    """Comments and docstrings cite docs sections as docs/<page>.md#<section>."""
    problems = []
    for folder in CODE_DIRS:
        for source in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(source.read_text().splitlines(), 1):
                for page, anchor in CODE_POINTER.findall(line):
                    _check(ROOT / "docs" / page, anchor[1:], f"{source.relative_to(ROOT)}:{number}", problems)
    assert not problems, "\n".join(problems)


def test_code_cites_docs_not_the_notebook():
    """The notebook is an archive: code points to docs/, not to its versions."""
    cites = [f"{source.relative_to(ROOT)}:{number}"
             for source in sorted((ROOT / "torch-ext").rglob("*.py"))
             for number, line in enumerate(source.read_text().splitlines(), 1)
             if re.search(r"NOTES(\.md)?,? v\d", line)]
    assert not cites, cites
