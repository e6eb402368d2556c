#!/usr/bin/env python3
"""Counts reaches into private names: by the tests into the package, and across modules inside it.

    python scripts/private_access.py [ROOT ...] [--list]

ROOT is a checkout (default: this one); give two to compare, e.g. an old commit exported with
``git archive <commit> tests orbit_sync | tar -x -C /tmp/old``. ``--list`` prints every hit.

Tests (``ROOT/tests``):
  attributes  ``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is neither a dunder
              nor a sunder (``_value_``); each occurrence counts.
  strings     a private name given as a string to ``getattr``/``setattr``/``hasattr``/``delattr``,
              ``monkeypatch.setattr``/``delattr`` or ``mock.patch(.object)``: the same reach,
              spelled so that the attribute count would miss it.
  imports     ``from orbit_sync.<...>._mod import x`` / ``import orbit_sync._mod``: an import from a
              module with a private segment, or of a private name from a public one; one
              statement counts once, however many names it imports.
``os._exit`` is not counted anywhere: it is a documented function of the standard library.

Package (``ROOT/orbit_sync``), ``cross-module``: ``x._name`` (``x`` not ``self``/``cls``) where no
class or statement of the accessing module defines ``_name``, and ``from m import _name`` where
``_name`` is not a module: a module using another module's private attribute. Importing a private
*module* of the package (``from ._codec import encode``) is how the package is built and is not
counted. The attribute test is by name (no type inference): an access to another module's
``_lock`` from a module that has a ``_lock`` of its own is not seen.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Underscore names that are public API of the standard library: namedtuple's methods.
STDLIB_PUBLIC = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})
# Documented standard-library functions with an underscore, as (module, name): ``os._exit`` ends a
# process without cleanup (a forked child, an orphaned handler process), which nothing else does.
STDLIB_FUNCTIONS = frozenset({("os", "_exit")})
# Calls whose string argument names an attribute (getattr(x, "_n"), monkeypatch.setattr(x, "_n")).
ATTRIBUTE_CALLS = frozenset({"getattr", "setattr", "hasattr", "delattr", "object"})
# Calls whose string argument is a dotted path (monkeypatch.setattr("a._b.c", v), mock.patch("…")).
PATH_CALLS = frozenset({"setattr", "delattr", "patch"})


def is_private(name: str) -> bool:
    """A single-underscore name: not a dunder, not a sunder, not namedtuple's public methods."""
    if not name.startswith("_") or name in STDLIB_PUBLIC:
        return False
    if name.startswith("__") and name.endswith("__"):
        return False
    return not (len(name) > 2 and name.endswith("_") and not name.startswith("__"))


def private_path(dotted: str) -> bool:
    """``orbit_sync.a._b`` or ``orbit_sync._a.b``: a package path with a private segment."""
    parts = dotted.split(".")
    return parts[0] == "orbit_sync" and any(is_private(p) for p in parts[1:])


@dataclass
class Hit:
    path: str
    line: int
    kind: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.what}"


@dataclass
class Counts:
    root: Path
    tests: list[Hit] = field(default_factory=list)
    package: list[Hit] = field(default_factory=list)

    def of(self, kind: str) -> int:
        return sum(1 for h in self.tests if h.kind == kind)

    @property
    def tests_total(self) -> int:
        return len(self.tests)


def _owner_is_self(node: ast.Attribute) -> bool:
    """``self._x``/``cls._x`` (an object's own), or one of :data:`STDLIB_FUNCTIONS`."""
    if not isinstance(node.value, ast.Name):
        return False
    return node.value.id in ("self", "cls") or (node.value.id, node.attr) in STDLIB_FUNCTIONS


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _string_arg(node: ast.Call, index: int) -> str:
    """The call's positional argument *index* when it is a string literal, else ``""``."""
    if len(node.args) > index:
        arg = node.args[index]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return ""


def _string_reaches(node: ast.Call) -> Iterator[str]:
    name = _call_name(node.func)
    if name in ATTRIBUTE_CALLS and is_private(attribute := _string_arg(node, 1)):
        yield attribute
    if name in PATH_CALLS and private_path(path := _string_arg(node, 0)):
        yield path


def _private_import(node: ast.Import | ast.ImportFrom) -> list[str]:
    """What *node* imports through a private path (one statement counts once, as a reach)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if private_path(alias.name)]
    module = node.module or ""
    if node.level or not (module == "orbit_sync" or module.startswith("orbit_sync.")):
        return []
    return [f"{module}.{a.name}" for a in node.names if private_path(f"{module}.{a.name}")]


def scan_tests(root: Path) -> list[Hit]:
    """Every private reach of the test files under ``root/tests``."""
    hits: list[Hit] = []
    for path in sorted((root / "tests").rglob("*.py")):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                if not _owner_is_self(node):
                    hits.append(Hit(rel, node.lineno, "attribute", node.attr))
            elif isinstance(node, ast.Call):
                for what in _string_reaches(node):
                    hits.append(Hit(rel, node.lineno, "string", what))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _private_import(node)
                if names:
                    hits.append(Hit(rel, node.lineno, "import", ", ".join(names)))
    return hits


def _defined_names(tree: ast.Module) -> set[str]:
    """Every name the module itself gives a meaning: defs, assignments, attributes it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if not isinstance(node, ast.ClassDef):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                    if arg is not None:
                        names.add(arg.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            # Set on self or cls: the module's own attribute (set on another object, it is a
            # reach into that object, counted like a read).
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(str(c.value) for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return names


def _resolves_to_module(package: Path, module: str, name: str) -> bool:
    base = package.parent.joinpath(*module.split("."), name)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _absolute(path: Path, package: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    # The importing module's package (for __init__.py, the package itself), then up level - 1.
    parts = list(path.relative_to(package.parent).with_suffix("").parts)[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def scan_package(root: Path) -> list[Hit]:
    """Every use of another module's private attribute inside ``root/orbit_sync``."""
    package = root / "orbit_sync"
    hits: list[Hit] = []
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        own = _defined_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                if not _owner_is_self(node) and node.attr not in own:
                    hits.append(Hit(rel, node.lineno, "cross-module", node.attr))
            elif isinstance(node, ast.Call):
                for what in _string_reaches(node):
                    if what not in own and not private_path(what):
                        hits.append(Hit(rel, node.lineno, "cross-module", what))
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(path, package, node)
                for alias in node.names:
                    if is_private(alias.name) and not _resolves_to_module(
                        package, module, alias.name
                    ):
                        hits.append(Hit(rel, node.lineno, "cross-module", f"{module}.{alias.name}"))
    return hits


def count(root: Path) -> Counts:
    return Counts(root, scan_tests(root), scan_package(root))


def report(counts: Counts, listing: bool) -> str:
    lines = [
        f"{counts.root}:",
        f"  tests: {counts.tests_total} private reaches"
        f" ({counts.of('attribute')} attributes, {counts.of('string')} strings,"
        f" {counts.of('import')} import statements from private modules;"
        f" {len({h.what for h in counts.tests if h.kind == 'attribute'})} distinct attributes)",
        f"  package: {len(counts.package)} cross-module private accesses",
    ]
    if listing:
        hits = [*counts.package, *counts.tests]
        lines += [f"    {hit}" for hit in sorted(hits, key=lambda h: (h.path, h.line))]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    listing = "--list" in argv
    roots = [Path(a) for a in argv if a != "--list"] or [Path(__file__).resolve().parent.parent]
    for root in roots:
        print(report(count(root), listing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
