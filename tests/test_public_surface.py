"""The public surface names only public things: every type in a public signature, every module path
in a public docstring, and every public exception's printed name can be imported by a user."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
import sys
import typing
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import orbit_sync

#: A dotted path that goes through a private segment (``orbit_sync.testing._state``), or a
#: cross-reference to a private name (``:class:`_Slot```).
PRIVATE_PATH = re.compile(
    r"(?<![\w.])(?:orbit_sync|testing|worker|contrib)(?:\.\w+)*\._[A-Za-z]\w*"
    r"|:[a-z]+:`~?(?:[\w.]*\.)?_[A-Za-z][\w.]*`"
)


def is_private(module: str) -> bool:
    """Does the dotted module name go through a segment starting with an underscore?"""
    return any(part.startswith("_") for part in module.split("."))


def public_modules() -> list[ModuleType]:
    """``orbit_sync`` and every module under it reached without an underscore that has an
    ``__all__`` (its declared public names)."""
    found = [orbit_sync]
    for info in pkgutil.walk_packages(orbit_sync.__path__, "orbit_sync."):
        if not is_private(info.name):
            module = importlib.import_module(info.name)
            if hasattr(module, "__all__"):
                found.append(module)
    return found


MODULES = public_modules()


def exported() -> dict[int, str]:
    """Every object a public ``__all__`` holds, by id: where a user imports it from."""
    names: dict[int, str] = {}
    for module in MODULES:
        for name in module.__all__:
            names.setdefault(id(getattr(module, name)), f"{module.__name__}.{name}")
    return names


@functools.cache
def namespace(module_name: str) -> dict[str, Any]:
    """The module's globals plus what it imports only for type checkers (``if TYPE_CHECKING:``),
    so a string annotation resolves as a type checker reads it."""
    module = sys.modules[module_name]
    space = dict(vars(module))
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            block = ast.Module(body=node.body, type_ignores=[])
            exec(compile(block, inspect.getsourcefile(module) or module_name, "exec"), space)
    return space


def members(obj: Any) -> Iterator[tuple[str, Any]]:
    """``(qualified name, object with annotations and a docstring)`` for a public object: a class
    itself, its ``__init__`` and the public methods and properties of it and its bases (ours), or
    the function itself."""
    if isinstance(obj, type):
        yield obj.__qualname__, obj
        for klass in obj.__mro__:
            if not klass.__module__.startswith("orbit_sync"):
                continue
            for name, value in vars(klass).items():
                if name.startswith("_") and name != "__init__":
                    continue
                if isinstance(value, property):
                    value = value.fget
                elif isinstance(value, staticmethod | classmethod):
                    value = value.__func__
                if inspect.isfunction(value):
                    yield f"{obj.__qualname__}.{name}", value
    elif inspect.isfunction(obj):
        yield obj.__qualname__, obj


def types_in(annotation: Any) -> Iterator[type]:
    """The classes an annotation names, however deeply nested (``Unpack[X]``, ``X | None``,
    ``Callable[[X], Y]``, ``Iterable[X]``)."""
    if isinstance(annotation, type):
        yield annotation
    for arg in typing.get_args(annotation):
        for part in arg if isinstance(arg, list) else [arg]:
            yield from types_in(part)


def public_annotations() -> Iterator[tuple[str, Any]]:
    """``(where, resolved annotation)`` for every parameter, return and attribute annotation of
    every public object (an unresolvable one is yielded as the error it raises)."""
    for module in MODULES:
        for name in module.__all__:
            for where, obj in members(getattr(module, name)):
                home = getattr(obj, "__module__", None) or module.__name__
                label = f"{module.__name__}.{where}"
                try:
                    hints = typing.get_type_hints(obj, namespace(home), include_extras=True)
                except NameError as exc:
                    yield label, exc
                    continue
                for parameter, annotation in hints.items():
                    yield f"{label}({parameter})", annotation


def public_docstrings() -> Iterator[tuple[str, str]]:
    """``(where, docstring)`` of every public module and every public object and member."""
    for module in MODULES:
        yield module.__name__, module.__doc__ or ""
        for name in module.__all__:
            for where, obj in members(getattr(module, name)):
                yield f"{module.__name__}.{where}", inspect.getdoc(obj) or ""


def test_public_signatures_name_only_public_types() -> None:
    """Every annotation of a public class, function, method or property resolves, and every
    class it names is public: defined in a public module, or exported by one."""
    public = exported()
    seen: set[str] = set()
    problems = []
    for where, annotation in public_annotations():
        seen.add(where)
        if isinstance(annotation, NameError):
            problems.append(f"{where}: does not resolve ({annotation})")
            continue
        for kind in types_in(annotation):
            if is_private(kind.__module__) and id(kind) not in public:
                problems.append(f"{where}: {kind.__module__}.{kind.__qualname__}")
    # The walk reaches what it exists for (a vacuous walk would pass too).
    for where in (
        "orbit_sync.Worker.__init__(client)",
        "orbit_sync.connection.WorkerConnection.__init__(transport)",
        "orbit_sync.testing.MockOrbitServer.enqueue(options)",
        "orbit_sync.testing.MockOrbitServer.__init__(admin_handler)",
        "orbit_sync.testing.AdminAPI.handle(request)",
    ):
        assert where in seen, where
    assert problems == []


def test_public_docstrings_name_no_private_module() -> None:
    """No public module, class, function, method or property sends its reader to a private
    module (``orbit_sync._x``, ``testing._x``): the reader could not import what it names."""
    problems = [
        f"{where}: {path}"
        for where, doc in public_docstrings()
        for path in PRIVATE_PATH.findall(doc)
    ]
    assert problems == []


def test_public_exceptions_print_where_they_are_imported_from() -> None:
    """A traceback prints an exception's ``__module__``: for every public exception it is a
    public module that exports it (``orbit_sync.worker.Fail``, not ``worker._outcomes.Fail``)."""
    problems = []
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                home = sys.modules.get(obj.__module__)
                if is_private(obj.__module__) or getattr(home, obj.__name__, None) is not obj:
                    problems.append(f"{module.__name__}.{name}: {obj.__module__}")
    assert problems == []


def test_the_private_path_pattern_catches_what_it_is_for() -> None:
    """The docstring check recognizes a private module path and leaves public ones alone."""
    hits: Callable[[str], list[str]] = PRIVATE_PATH.findall
    assert hits("see orbit_sync.testing._state.OrbitState") == ["orbit_sync.testing._state"]
    assert hits("(:mod:`orbit_sync._realtime`)") == [":mod:`orbit_sync._realtime`"]
    assert hits("testing._state and worker._link") == ["testing._state", "worker._link"]
    assert hits("each slot (:class:`_Slot`), :meth:`~.worker._link.Gate.acquire`") == [
        ":class:`_Slot`",
        ":meth:`~.worker._link.Gate.acquire`",
    ]
    assert hits("orbit_sync.testing.MockOrbitServer, ctx.raise_if_cancelled()") == []
    assert hits(":meth:`Worker.stop`, :class:`~orbit_sync.Clock`, :meth:`__enter__`") == []
