"""The public surface: a sorted ``__all__`` whose every name resolves."""

from __future__ import annotations

import orbit_sync


def test_all_sorted_and_resolvable() -> None:
    """``__all__`` is sorted, unique, and every name is importable from the package."""
    names = orbit_sync.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(orbit_sync, name), name


def test_error_tree() -> None:
    """Every public error derives from OrbitError; CallTimeout is also a TimeoutError."""
    for name in orbit_sync.__all__:
        obj = getattr(orbit_sync, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, orbit_sync.OrbitError), name
    assert issubclass(orbit_sync.CallTimeout, TimeoutError)
