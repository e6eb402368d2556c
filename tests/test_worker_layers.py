"""orbit_sync.worker's sub-packages import one way (docs/architecture.md, "Inside
orbit_sync.worker"): the pure core, then the Worker's API types, the outbox, the process
executor, the runtime, the sessions, and the Worker on top; no import of the worker's own
modules is hidden behind ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "orbit_sync" / "worker"

#: Each layer may import only from itself and the layers before it.
LAYERS = [
    {"core"},
    {"_context", "_listeners", "_options"},
    {"outbox"},
    {"process"},
    {"runtime"},
    {"session"},
    {"_runner", "_signals", "__init__"},
]


def _layer(parts: tuple[str, ...]) -> int:
    """The layer of a module of the worker, by its path below orbit_sync/worker."""
    head = parts[0].removesuffix(".py")
    return next(i for i, names in enumerate(LAYERS) if head in names)


def _imports(path: Path) -> list[tuple[tuple[str, ...], bool]]:
    """The worker modules *path* imports (as paths below orbit_sync/worker), and whether each
    import sits under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = path.relative_to(WORKER).parent.parts
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            if node.level - 1 > len(here):
                continue  # above orbit_sync.worker: another part of the package
            target = (*base, *(node.module.split(".") if node.module else ()))
            if target:
                found.append((target, id(node) in guarded))
    return found


def test_the_sub_packages_import_one_way() -> None:
    """No module imports one of a later layer; the scan finds the layers' imports."""
    seen = 0
    for path in WORKER.rglob("*.py"):
        mine = _layer(path.relative_to(WORKER).parts)
        for target, _ in _imports(path):
            seen += 1
            assert _layer(target) <= mine, f"{path.relative_to(WORKER)} imports {'.'.join(target)}"
    assert seen > 50


def test_no_import_of_the_worker_is_hidden_behind_type_checking() -> None:
    """A cycle hidden behind TYPE_CHECKING would pass the layer check: there is none."""
    for path in WORKER.rglob("*.py"):
        hidden = [t for t, guarded in _imports(path) if guarded]
        assert not hidden, f"{path.relative_to(WORKER)}: {hidden}"
