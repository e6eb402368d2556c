"""examples/blocking_script.py runs as a script and finishes its task."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "blocking_script.py"


def test_blocking_script_runs() -> None:
    """The example exits 0 and reports its task SUCCEEDED with the handler's result."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=45, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert " SUCCEEDED: " in done.stdout
    assert "'width': 20" in done.stdout and "'height': 10" in done.stdout
