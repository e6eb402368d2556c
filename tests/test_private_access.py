"""Modules talk through public names; tests reach into the package's privates less and less.

The counts come from ``scripts/private_access.py`` (run it with ``--list`` to see every hit).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What the tests reached into at commit 96662c7, counted by the script as it is now: 105
#: attributes, 89 import statements from private modules. The tests may reach half as far.
BASELINE_TESTS = 194
MAX_TESTS = 90


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "private_access", ROOT / "scripts/private_access.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return _load()


def test_no_module_uses_another_modules_private_names(script: ModuleType) -> None:
    """No module of the package reads, calls or imports another module's underscore name."""
    hits = script.scan_package(ROOT)
    assert [str(h) for h in hits] == []


def test_tests_reach_into_privates_at_most_half_as_often_as_before(script: ModuleType) -> None:
    """The tests' private reaches stay under the bound (halving what they were at 96662c7)."""
    hits = script.scan_tests(ROOT)
    assert len(hits) <= MAX_TESTS, "\n".join(str(h) for h in hits)
    assert MAX_TESTS <= BASELINE_TESTS // 2


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_script_counts_each_kind_of_reach_from_the_tests(
    script: ModuleType, tmp_path: Path
) -> None:
    """Attributes, strings and import statements each count; own, dunder and os._exit do not."""
    root = _tree(
        tmp_path,
        {
            "tests/test_x.py": (
                "import os\n"
                "from orbit_sync.worker.core._machine import A, B\n"
                "import orbit_sync._codec\n"
                "from orbit_sync.worker import Worker\n"
                "from tests._helpers import thing\n"
                "def test(monkeypatch, w):\n"
                "    w._handlers\n"
                "    self._own, cls._own, w.__dict__, w._value_, w._replace\n"
                "    monkeypatch.setattr(w, '_clock', None)\n"
                "    monkeypatch.setattr('orbit_sync._json.MAX', 1)\n"
                "    os._exit(0)\n"
            ),
        },
    )
    hits = script.scan_tests(root)
    assert sorted((h.kind, h.what) for h in hits) == [
        ("attribute", "_handlers"),
        ("import", "orbit_sync._codec"),
        ("import", "orbit_sync.worker.core._machine.A, orbit_sync.worker.core._machine.B"),
        ("string", "_clock"),
        ("string", "orbit_sync._json.MAX"),
    ]


def test_the_script_tells_a_modules_own_privates_from_anothers(
    script: ModuleType, tmp_path: Path
) -> None:
    """A private module import or the module's own name is fine; another module's name is not."""
    root = _tree(
        tmp_path,
        {
            "orbit_sync/__init__.py": "",
            "orbit_sync/_codec.py": "_OP = 1\ndef encode(): ...\n",
            "orbit_sync/worker/__init__.py": "",
            "orbit_sync/worker/_a.py": (
                "from .. import _codec\n"
                "from .._codec import _OP, encode\n"
                "class A:\n"
                "    __slots__ = ('_slot',)\n"
                "    def f(self, other, ctx):\n"
                "        self._x = other._x\n"
                "        other._slot\n"
                "        ctx._cancel('shutdown')\n"
            ),
        },
    )
    hits = script.scan_package(root)
    assert sorted((h.path, h.what) for h in hits) == [
        ("orbit_sync/worker/_a.py", "_cancel"),
        ("orbit_sync/worker/_a.py", "orbit_sync._codec._OP"),
    ]


def test_the_script_prints_both_checkouts_it_is_given(
    script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """``private_access.py ROOT ROOT`` reports each root's counts."""
    assert script.main([str(ROOT), str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert out.count("private reaches") == 2
    assert out.count("cross-module private accesses") == 2
