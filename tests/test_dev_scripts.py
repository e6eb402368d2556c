"""``scripts/test-versions`` (run by ``make test``): a missing supported Python is a warning on a
developer's machine and a failure where ``ORBIT_REQUIRE_ALL_PYTHONS=1`` (CI) asks for all."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "test-versions"
#: What the script runs besides Python: a PATH of only these finds no other interpreter.
TOOLS = ("bash", "dirname", "mktemp", "rm", "grep")

pytestmark = pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "python").exists() or not SCRIPT.exists(),
    reason="needs a source checkout with its .venv (make test creates it)",
)


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The script with a PATH and a pyenv root where no other Python can be found."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": str(bin_dir), "PYENV_ROOT": str(tmp_path / "no-pyenv"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_missing_pythons_warn_on_a_developer_machine(tmp_path: Path) -> None:
    """Without the other supported Pythons the run passes and says which were not tested."""
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: not tested on Python" in proc.stderr


def test_ci_requires_every_supported_python(tmp_path: Path) -> None:
    """With ORBIT_REQUIRE_ALL_PYTHONS=1 (as .ci/run sets) a missing version fails the run."""
    proc = _run(tmp_path, ORBIT_REQUIRE_ALL_PYTHONS="1")
    assert proc.returncode == 1
    assert "supported Python versions not found" in proc.stderr
    assert "ORBIT_REQUIRE_ALL_PYTHONS=1 make test" in (ROOT / ".ci" / "run").read_text()
