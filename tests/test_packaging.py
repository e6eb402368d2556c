"""The distributions: an sdist that is a complete, testable source tree and a wheel that carries
the licence, metadata, docs and examples. Builds both (sdist, then the wheel from the sdist, as
``python -m build`` does) from a copy of this tree, without network access."""

from __future__ import annotations

import email
import email.message
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from orbit_sync import _dial

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".*_cache",
    ".hypothesis",
)

pytestmark = pytest.mark.slow


def _source_files(folder: str) -> set[str]:
    """Files under *folder* of this tree that belong to the source (caches excluded)."""
    base = ROOT / folder
    return {
        p.relative_to(ROOT).as_posix()
        for p in base.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
    }


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """Build the sdist and, from it, the wheel; yield both paths."""
    work = tmp_path_factory.mktemp("dist")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    out = work / "out"
    # --no-isolation: build with this environment's setuptools and wheel (the test extra), so no
    # package index is contacted; -x: without asking the backend for its build requirements first
    # (two more interpreters that import setuptools) when the test extra has installed them.
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "-x", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    yield sdist, wheel


def _dotted(version: tuple[int, ...]) -> str:
    """(1, 10, 0) -> "1.10" (trailing zero dropped, as written in setup.cfg)."""
    parts = list(version)
    while len(parts) > 2 and parts[-1] == 0:
        parts.pop()
    return ".".join(map(str, parts))


def _sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(zf.read(meta))


def test_sdist_is_a_complete_source_tree(dists: tuple[Path, Path]) -> None:
    """The sdist carries the licence, changelog, docs, examples, tests with their helpers and
    frame vectors: every file of those folders in this tree."""
    names = _sdist_names(dists[0])
    for required in (
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
        "docs/protocol.md",
        "docs/reliability.md",
        "docs/comparison.md",
        "examples/test_user_handler.py",
        "tests/conftest.py",
        "tests/vectors/frames.json",
        "orbit_sync/py.typed",
    ):
        assert required in names, required
    for folder in ("docs", "examples", "tests", "orbit_sync"):
        missing = _source_files(folder) - names
        assert not missing, f"not in the sdist: {sorted(missing)}"


def test_sdist_tests_run_from_it(dists: tuple[Path, Path], tmp_path: Path) -> None:
    """Unpacked, the sdist's tests find every helper module they import, and a frame-vector test
    passes there against the unpacked package."""
    with tarfile.open(dists[0]) as tar:
        # Our own archive; the "data" filter (where this Python has it) silences 3.12+'s warning.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path, **safe)
    (tree,) = tmp_path.iterdir()
    tests = tree / "tests"
    helpers = {p.stem for p in tests.glob("_*.py")}
    for module in tests.glob("*.py"):
        imported = re.findall(r"^\s*(?:from|import) (_[a-z]\w*)", module.read_text(), re.MULTILINE)
        missing = set(imported) - helpers
        assert not missing, f"{module.name} imports {missing}, not in the sdist"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "tests/test_wire_vectors.py::test_valid_client_frames_reencode_identically",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout


def test_wheel_carries_package_licence_docs_and_examples(dists: tuple[Path, Path]) -> None:
    """The wheel holds every module, py.typed, the licence, and the docs and examples (the
    Django project included) under share/doc/orbit-sync; it installs no ``tests`` package."""
    with zipfile.ZipFile(dists[1]) as zf:
        names = set(zf.namelist())
    modules = {p for p in _source_files("orbit_sync") if p.endswith((".py", "py.typed"))}
    assert not modules - names, f"not in the wheel: {sorted(modules - names)}"
    assert any(n.endswith(".dist-info/LICENSE") or "/licenses/LICENSE" in n for n in names)
    data = {n.split(".data/data/share/doc/orbit-sync/", 1)[1] for n in names if ".data/" in n}
    for required in (
        "README.md",
        "CHANGELOG.md",
        "LICENSE",
        "docs/protocol.md",
        "docs/reliability.md",
        "docs/comparison.md",
        "examples/test_user_handler.py",
        "examples/quickstart.py",
        *(p for p in _source_files("docs") if p.endswith(".md") and p.count("/") == 1),
        # The runnable Django project docs/django.md points to, folder by folder.
        *(p for p in _source_files("examples/django_project") if p.endswith((".py", ".md"))),
    ):
        assert required in data, required
    assert not any(n.startswith("tests/") for n in names)


def test_wheel_metadata(dists: tuple[Path, Path]) -> None:
    """Licence, supported Pythons 3.10-3.13, frameworks, typing, project URLs and the verified
    websocket-client range are in the wheel's metadata."""
    meta = _wheel_metadata(dists[1])
    license_field = meta.get("License-Expression") or meta.get("License")
    assert license_field == "Apache-2.0"
    classifiers = set(meta.get_all("Classifier") or [])
    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    for classifier in ("Framework :: Pytest", "Framework :: Django", "Typing :: Typed"):
        assert classifier in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    assert meta.get("Requires-Python") == ">=3.10"
    urls = {u.split(",", 1)[0] for u in meta.get_all("Project-URL") or []}
    assert {"Documentation", "Source", "Changelog", "Issues"} <= urls
    requires = meta.get_all("Requires-Dist") or []
    (ws,) = [r for r in requires if r.startswith("websocket-client")]
    # The range the internals check and transport tests were run against (see _transport.py).
    low, high = _dial.SUPPORTED_WEBSOCKET_CLIENT
    bounds = set(ws.replace(" ", "").removeprefix("websocket-client").split(","))
    assert bounds == {f">={_dotted(low)}", f"<{_dotted(high)}"}, ws


def test_readme_installs_the_wheel_the_build_writes(
    dists: tuple[Path, Path], tmp_path: Path
) -> None:
    """The README's install-from-a-wheel lines name the file the build writes, and that wheel
    installs: the package imports from where it went, and the console script is there."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert set(re.findall(r"dist/(orbit_sync-[^\s'\[]+\.whl)", readme)) == {dists[1].name}
    target = tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    done = subprocess.run(
        [*pip, "--target", str(target), str(dists[1])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    where = subprocess.run(
        [sys.executable, "-c", "import orbit_sync; print(orbit_sync.__file__)"],
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip() == str(target / "orbit_sync" / "__init__.py"), where.stderr
    assert (target / "bin" / "orbit-sync").exists()


def test_editable_install_prints_no_warning(tmp_path: Path) -> None:
    """The editable wheel ``pip install -e .`` builds (``make`` does, once per Python) is a
    plain .pth file naming the source tree, not the import hook ("meta path finder") for
    which setuptools prints its "Editable installation" warning."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    out = tmp_path / "out"
    out.mkdir()
    build = "import sys\nfrom setuptools import build_meta\nbuild_meta.build_editable(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", build, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Editable installation" not in done.stdout + done.stderr
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert not [name for name in names if name.endswith("_finder.py")], names
        (pth,) = [name for name in names if name.endswith(".pth")]
        assert zf.read(pth).decode().split() == [str(src)]
