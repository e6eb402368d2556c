"""docs/architecture.md and the README's layout list stay true to the source tree: every module
and every thread the code starts is named, and nothing they name is gone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "orbit_sync"
DOC = ROOT / "docs" / "architecture.md"
_TICKED = re.compile(r"`([^`]+)`")
_HEADING = re.compile(r"^(#+) (.*)$")
#: A string that names a thread or a process: lowercase words joined by dashes; an f-string's
#: start of one ends in the dash before its tag.
_THREAD_NAME = re.compile(r"(?:orbit|cutlink)(?:-[a-z]+)+")
_THREAD_NAME_HEAD = re.compile(r"(?:orbit|cutlink)(?:-[a-z]+)*-")
#: Keywords whose values have that shape without naming a thread: a program, a temp directory.
_NOT_A_THREAD = frozenset({"prog", "prefix"})
#: A module named through its subpackage: `worker._pool.DaemonPool`, `orbit_sync.testing._state`.
_THROUGH_PACKAGE = re.compile(
    r"`(?:orbit_sync\.)?(worker|testing|contrib|_supervisor)\.(_[a-z]\w*)"
)


def _modules() -> set[str]:
    """Every module of the package, dotted from ``orbit_sync`` (``__init__`` stands for its
    package, which is not a module of its own here)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            found.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def _exists(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Each table of *text*: the package its section is about (from the last heading naming
    ``orbit_sync...`` in backticks, else ``orbit_sync``), its header cells and its rows."""
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    scope = "orbit_sync"
    header: list[str] | None = None
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            named = [t for t in _TICKED.findall(heading.group(2)) if t.startswith("orbit_sync")]
            scope = named[0] if named else "orbit_sync"
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            tables.append((scope, header, []))
        elif not set("".join(cells)) <= set("-: "):
            tables[-1][2].append(cells)
    return tables


def _column(name: str) -> list[tuple[str, str]]:
    """(package, cell) for each cell of every table column headed *name* in the doc."""
    cells = []
    for scope, header, rows in _tables(DOC.read_text(encoding="utf-8")):
        if name in header:
            i = header.index(name)
            cells += [(scope, row[i]) for row in rows]
    return cells


def _named_modules() -> dict[str, str]:
    """Each module named in a ``module``/``modules`` column, dotted from ``orbit_sync``, and how
    the doc wrote it (relative to its section's package unless it starts with ``orbit_sync``)."""
    named = {}
    for scope, cell in _column("module") + _column("modules"):
        for token in _TICKED.findall(cell):
            dotted = token.rstrip("/").replace("/", ".")
            named[dotted if dotted.startswith("orbit_sync") else f"{scope}.{dotted}"] = token
    return named


def test_every_module_is_named() -> None:
    """Each module under orbit_sync/ is in a module table of docs/architecture.md."""
    missing = sorted(_modules() - set(_named_modules()))
    assert not missing, f"docs/architecture.md names no {missing}"


def test_every_module_named_exists() -> None:
    """Each module the module tables name, and each one the rules table credits, exists."""
    gone = sorted(token for dotted, token in _named_modules().items() if not _exists(dotted))
    for _, cell in _column("where"):
        # Outside the parentheses, which name what in the module: functions, classes, steps.
        for token in _TICKED.findall(re.sub(r"\([^)]*\)", "", cell)):
            module = token.split(".")[0]
            if not any(_exists(f"{p}.{module}") for p in ("orbit_sync", "orbit_sync.worker")):
                gone.append(token)
    # Anywhere in the page: a module reached through its package (`worker._shell.AttemptShell`).
    for package, module in _THROUGH_PACKAGE.findall(DOC.read_text(encoding="utf-8")):
        if not _exists(f"orbit_sync.{package}.{module}"):
            gone.append(f"{package}.{module}")
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _started_names() -> set[str]:
    """The name of every thread and process the package starts, without a numbered or tagged
    tail (``f"orbit-sync-reader-{tag}"`` is ``orbit-sync-reader``): each string literal shaped
    like one, each f-string starting like one."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            for kw in node.keywords
            if kw.arg in _NOT_A_THREAD
            for sub in ast.walk(kw.value)
        }
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.JoinedStr):
                skip.update(id(v) for v in node.values)
                head = _text(node.values[0]) if node.values else None
                if head is not None and _THREAD_NAME_HEAD.fullmatch(head):
                    names.add(head.rstrip("-"))
            elif (text := _text(node)) is not None and _THREAD_NAME.fullmatch(text):
                names.add(text)
    return names


def _documented_names() -> set[str]:
    """The names in the doc's thread tables, without their ``-N``/``-*`` tail."""
    return {
        re.sub(r"(?:-(?:N|\*))+$", "", token)
        for _, cell in _column("thread")
        for token in _TICKED.findall(cell)
    }


def test_every_thread_started_is_in_a_threads_table() -> None:
    """Each thread (and process) name the code gives is in a threads table of the doc."""
    missing = sorted(_started_names() - _documented_names())
    assert not missing, f"docs/architecture.md's threads tables miss {missing}"


def test_every_thread_in_the_tables_is_started() -> None:
    """Each name in the threads tables is one the code still gives."""
    gone = sorted(_documented_names() - _started_names())
    assert not gone, f"docs/architecture.md lists threads the code no longer starts: {gone}"


def test_the_scan_finds_the_threads_it_must() -> None:
    """The scans see a literal name, a tagged f-string name and a default argument's name, and
    read the doc's tables and modules (a scan that found nothing would pass the tests above)."""
    started = _started_names()
    assert {"orbit-worker-connection", "orbit-sync-reader", "orbit-handler"} <= started
    assert "orbit-sync" not in started  # the program's name
    assert {"orbit-worker-connection", "orbit-handler"} <= _documented_names()
    assert "orbit_sync.worker.core._machine" in _named_modules()


def test_readme_layout_names_every_top_level_module_and_package() -> None:
    """The README's layout list names each module (``name.py``) and subpackage (``name/``) at the
    top of orbit_sync/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text[text.index("Layout: ") :].split("\n\n")[0]
    named = set(_TICKED.findall(layout))
    entries = {
        p.name if p.is_file() else f"{p.name}/"
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
    }
    missing = sorted(e for e in entries if e not in named and f"orbit_sync/{e}" not in named)
    assert not missing, f"the README's layout list misses {missing}"
