"""The documentation stands alone: its links resolve inside the package's own files and it never
points at material a user does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")
#: Pages the README's index announces while they are being written; a link to one of them may
#: point nowhere until it lands. Everything else must resolve.
PENDING = frozenset(
    {"docs/cli.md", "docs/django.md", "docs/observability.md", "docs/mock-server.md"}
)
#: Sources a user of the package does not have.
FOREIGN = re.compile(r"PROTOCOL\.md|\.\./shared|[Cc]hinese|Go client|LIBRARY-NOTES|DESIGN\.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link of a page names a file or folder of the source tree."""
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (page.parent / target).resolve()
        if not resolved.exists() and resolved.relative_to(ROOT).as_posix() not in PENDING:
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_reference_to_material_users_lack(page: Path) -> None:
    """No page cites a document outside the package (the wire contract is docs/protocol.md)."""
    hits = sorted({m.group(0) for m in FOREIGN.finditer(page.read_text(encoding="utf-8"))})
    assert not hits, f"{page.name} mentions {hits}"


#: What only a clone of the source repository has: its tests, benchmarks and make targets.
SOURCE_ONLY = re.compile(r"`tests/|`test_\w+\.py|benchmarks/|`make (?:test|bench|chaos|demo)`")
SOURCE_REPOSITORY = "https://github.com/orbit-sync/orbit-sync"


@pytest.mark.parametrize(
    "page",
    [ROOT / "examples" / "django_project" / "README.md", *PAGES[1:]],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_pages_citing_source_only_material_say_where_it_is(page: Path) -> None:
    """A page installed with the wheel that names a test, a benchmark or a make target (which a
    wheel does not carry) links to the source repository where they are."""
    text = page.read_text(encoding="utf-8")
    cited = sorted({m.group(0) for m in SOURCE_ONLY.finditer(text)})
    if cited:
        assert SOURCE_REPOSITORY in text, f"{page.name} cites {cited} without the source repository"
    assert not re.search(
        r"`(?:orbit_sync/)?(?:\w+/)?_[a-z]\w*\.py`", text.replace("`tests/_", "")
    ), f"{page.name} names a private module of the package"


def test_protocol_sections_cited_by_the_code_exist() -> None:
    """Every ``PROTOCOL §N`` (or ``§N.M``) cited in the package's comments is a section (or an
    item) of docs/protocol.md."""
    protocol = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    sections: dict[str, int] = {}
    current = None
    for line in protocol.splitlines():
        heading = re.match(r"## (\d+)\. ", line)
        if heading:
            current = heading.group(1)
            sections[current] = 0
        elif current and re.match(r"\d+\. ", line):
            sections[current] += 1
    cited = set()
    for source in (ROOT / "orbit_sync").rglob("*.py"):
        for match in re.finditer(r"§(\d+)(?:\.(\d+))?", source.read_text(encoding="utf-8")):
            cited.add((match.group(1), match.group(2), source.name))
    missing = [
        f"§{sec}{'.' + item if item else ''} ({name})"
        for sec, item, name in sorted(cited, key=str)
        if sec not in sections or (item is not None and int(item) > sections[sec])
    ]
    assert not missing, f"cited but not in docs/protocol.md: {missing}"


def test_readme_lists_each_docs_page_once() -> None:
    """The README's documentation table has one row per page of docs/, none twice."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \[(docs/[\w-]+\.md)\]", readme, re.MULTILINE)
    assert sorted(rows) == sorted(set(rows)), (
        f"listed twice: {sorted(r for r in set(rows) if rows.count(r) > 1)}"
    )
    assert set(rows) == {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
