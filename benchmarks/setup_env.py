"""Set up what ``make bench`` needs, idempotently: Debian's redis-server and the benchmark's own
venv (``benchmarks/.venv``) with orbit-sync, Dramatiq 2.x, Celery 5.x (Redis clients) and py-spy.

The peers live only in that venv, never in the project's dependencies. Standard library only: it
runs before any venv exists. Prints the venv's python on its last line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = HERE / ".venv"
STAMP = VENV / ".installed"
REQUIREMENTS = [
    "-e",
    f"{ROOT}[testing]",
    "dramatiq[redis]>=2,<3",
    "celery[redis]>=5,<6",
    "py-spy>=0.3",
]


def _run(*cmd: str) -> None:
    print("[bench setup]", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def ensure_redis() -> None:
    """apt-get install redis-server when it is missing (``apt-get update`` once first)."""
    if shutil.which("redis-server"):
        return
    if not shutil.which("apt-get"):
        raise SystemExit("make bench needs redis-server (Debian: apt-get install redis-server)")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "redis-server"]):
        print("[bench setup]", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run([*sudo, *cmd], check=True, env=env)


def ensure_venv() -> Path:
    """Create or refresh the benchmark venv; returns its python."""
    python = VENV / "bin" / "python"
    inputs = [ROOT / "setup.cfg", ROOT / "pyproject.toml", Path(__file__)]
    fresh = STAMP.exists() and all(STAMP.stat().st_mtime >= p.stat().st_mtime for p in inputs)
    if python.exists() and fresh:
        return python
    if not python.exists():
        _run(sys.executable, "-m", "venv", str(VENV))
    _run(str(python), "-m", "pip", "install", "-q", "--upgrade", "pip")
    _run(str(python), "-m", "pip", "install", "-q", *REQUIREMENTS)
    STAMP.touch()
    return python


def main() -> int:
    ensure_redis()
    print(ensure_venv())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
